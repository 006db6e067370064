import pytest
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicLayer

from path_hf import PaTHCacheLayer, PaTHLlamaConfig, RopeMode


def test_defaults_and_derived_fields():
    config = PaTHLlamaConfig(num_hidden_layers=3, path_layers=[2, 0, 2], attention_bias=True)
    assert config.model_type == "path_llama"
    assert config.path_layers == [0, 2]
    assert config.attention_o_bias is True  # None follows attention_bias
    assert config.layer_types == ["path_attention", "full_attention", "path_attention"]
    assert PaTHLlamaConfig(num_hidden_layers=2).layer_types == ["path_attention"] * 2
    assert (config.rope_mode, config.path_conv_size, config.path_beta_max) == ("drop", 3, 1.9)


def test_explicit_head_dim_need_not_divide_hidden_size():
    config = PaTHLlamaConfig(hidden_size=32, num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    assert config.head_dim == 16


def test_round_trip_through_auto_config(tmp_path):
    config = PaTHLlamaConfig(num_hidden_layers=4, path_layers=[1, 3], rope_mode="keep", path_w_rank=8, qk_norm=True)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, PaTHLlamaConfig)
    assert {**loaded.to_dict(), "_name_or_path": ""} == config.to_dict()
    assert "layer_types" not in loaded.to_dict()  # derived from path_layers, never stored twice


def test_dynamic_cache_from_config_builds_path_layers():
    cache = DynamicCache(config=PaTHLlamaConfig(num_hidden_layers=3, path_layers=[1]))
    assert [type(layer) for layer in cache.layers] == [DynamicLayer, PaTHCacheLayer, DynamicLayer]


INVALID = [
    ({"rope_mode": "rotate"}, "rope_mode"),
    ({"path_backend": "cuda"}, "path_backend"),
    ({"path_init": "zeros"}, "path_init"),
    ({"path_beta_max": 2.5}, "path_beta_max"),
    ({"path_beta_max": 0.0}, "path_beta_max"),
    ({"path_conv_size": -1}, "path_conv_size"),
    ({"path_w_rank": 0}, "path_w_rank"),
    ({"path_layers": [0, 4]}, "path_layers"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "multiple"),
    ({"attention_dropout": 0.1}, "dropout"),
]


@pytest.mark.parametrize(
    "fields, message", INVALID, ids=["-".join(f"{k}={v}" for k, v in fields.items()) for fields, _ in INVALID]
)
def test_invalid_values_raise(fields, message):
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        PaTHLlamaConfig(**{"num_hidden_layers": 4, "hidden_size": 64, **fields})


def test_layer_types_cannot_be_set():
    with pytest.raises(ValueError, match="set path_layers"):
        PaTHLlamaConfig(num_hidden_layers=2, layer_types=["full_attention"] * 2)


def test_attention_dropout_allowed_without_path_layers():
    assert (
        PaTHLlamaConfig(num_hidden_layers=2, path_layers=[], attention_dropout=0.1).layer_types
        == ["full_attention"] * 2
    )


def test_rope_mode_is_one_enum_stored_as_its_string(tmp_path):
    """`RopeMode` members are the strings a config stores: config.json holds the plain word, a config built from a
    member or from the word is the same, and only `drop` applies no RoPE."""
    assert [mode.value for mode in RopeMode] == ["drop", "keep", "interleave"]
    assert PaTHLlamaConfig().rope_mode == RopeMode.DROP
    from_member = PaTHLlamaConfig(num_hidden_layers=2, rope_mode=RopeMode.INTERLEAVE)
    from_member.save_pretrained(tmp_path)
    assert '"rope_mode": "interleave"' in (tmp_path / "config.json").read_text()
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded.rope_mode) is str and RopeMode(loaded.rope_mode) is RopeMode.INTERLEAVE
    assert [mode.keeps_rope for mode in RopeMode] == [False, True, True]
    with pytest.raises(StrictDataclassClassValidationError, match="rope_mode must be one of"):
        PaTHLlamaConfig(rope_mode="rotate")
