"""The long-context fields of PaTHLlamaConfig: critical-band RoPE (`rope_max_wavelength`) and the log-length attention
temperature (`path_attn_temperature_scale`, `path_attn_temperature_length`), each against a reference built apart
from the code under test: transformers' own Llama with the slow frequencies zeroed, and Llama 4's formula written out
with `math`."""

import math

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import LlamaForCausalLM

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from tests.models.tiny_models import SOURCES, TINY, path_config_from, random_tokens, tiny_model

# The tiny models' head dim is 8 (4 pairs) with rope_theta 1e4: wavelengths 2 pi * 1e4^(i/4) = 6.3, 63, 628, 6283.
WAVELENGTHS = [2 * math.pi * 10000 ** (i / 4) for i in range(4)]


def zero_slow_pairs(model: LlamaForCausalLM, max_wavelength: float) -> None:
    """transformers' Llama with the pairs of wavelength above `max_wavelength` at frequency 0 (never turned); the
    wavelengths are the model's own, after its RoPE type (YaRN's interpolated pairs turn slower)."""
    rotary = model.model.rotary_emb
    slow = 2 * math.pi / rotary.inv_freq > max_wavelength
    rotary.inv_freq[slow] = 0.0


@pytest.mark.parametrize("max_wavelength", [5.0, 100.0, 1000.0])
@pytest.mark.parametrize("rope_mode", ["keep", "interleave"])
@pytest.mark.parametrize("source", ["llama-tied", "llama-yarn-rope", "qwen3"])
def test_identity_band_is_the_source_without_its_slow_pairs(source, rope_mode, max_wavelength, tmp_path):
    """With beta = 0 a critical-band model computes its source with the slow frequencies set to 0 (YaRN's magnitude
    factor included): the pairs above the wavelength do not turn, the others turn as before."""
    model_class, source_config, path_fields = SOURCES[source]
    torch.manual_seed(0)
    source_model = model_class(source_config).eval()
    with torch.no_grad():  # sharper attention than the 0.02 init gives, so that positions matter
        for layer in source_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    source_model.save_pretrained(tmp_path)
    config = path_config_from(
        source_config, rope_mode=rope_mode, path_init="identity", rope_max_wavelength=max_wavelength, **path_fields
    )
    model = PaTHLlamaForCausalLM.from_pretrained(tmp_path, config=config).eval()
    ids = random_tokens(2, 40)
    unchanged = source_model(ids).logits
    zero_slow_pairs(source_model, max_wavelength)
    expected = source_model(ids).logits
    tolerance = 1e-5 * expected.abs().max().item()
    assert (expected - unchanged).abs().max() > 100 * tolerance  # the band removes something
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=tolerance)


def test_band_above_every_wavelength_changes_nothing():
    ids = random_tokens(2, 30)
    full = tiny_model(rope_mode="interleave")(ids).logits
    banded = tiny_model(rope_mode="interleave", rope_max_wavelength=1e6)(ids).logits
    torch.testing.assert_close(banded, full, rtol=0, atol=0)


def test_band_applies_to_path_layers_only():
    """The RoPE layers of a mixed model keep every pair: they receive RoPE's own (cos, sin); the PaTH layer gets them
    with the slow pairs at angle 0."""
    model = tiny_model(rope_mode="keep", path_layers=[1], rope_max_wavelength=100.0)
    seen = {}
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: seen.__setitem__(index, kwargs["position_embeddings"]),
            with_kwargs=True,
        )
    x_ids = random_tokens(1, 25)
    model(x_ids)
    cos, sin = model.model.rotary_emb(model.model.embed_tokens(x_ids), torch.arange(25)[None])
    torch.testing.assert_close(seen[0], (cos, sin), rtol=0, atol=0)
    slow = torch.tensor([w > 100.0 for w in WAVELENGTHS]).repeat(2)
    band_cos, band_sin = seen[1]
    torch.testing.assert_close(band_cos[..., ~slow], cos[..., ~slow], rtol=0, atol=0)
    assert torch.all(band_cos[..., slow] == 1) and torch.all(band_sin[..., slow] == 0)


def test_band_keeps_interleave_shift_invariant():
    model = tiny_model(rope_mode="interleave", rope_max_wavelength=100.0).double()
    ids = random_tokens(2, 20)
    at_start = model(ids, position_ids=torch.arange(20)[None]).logits
    moved = model(ids, position_ids=torch.arange(20)[None] + 37).logits
    assert ((moved - at_start).abs().max() / at_start.abs().max()).item() < 1e-6


@pytest.mark.parametrize("length", [4, 7])
def test_temperature_scales_each_query_by_llama4s_formula(length):
    """The PaTH layers' queries at position p are multiplied by 1 + s * log(floor((p + 1) / L) + 1): the model equals
    the same model without the temperature whose q_proj outputs are multiplied by that factor, computed with math."""
    scale, T = 0.3, 23
    ids = random_tokens(2, T)
    hot = tiny_model(path_attn_temperature_scale=scale, path_attn_temperature_length=length)
    reference = tiny_model()
    factors = torch.tensor([1 + scale * math.log(math.floor((p + 1) / length) + 1) for p in range(T)])
    assert factors[: length - 1].eq(1).all() and factors[-1] > 1
    for layer in reference.model.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda module, args, out: out * factors[:, None])
    expected = reference(ids).logits
    torch.testing.assert_close(hot(ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert (expected - tiny_model()(ids).logits).abs().max() > 1e-3


def test_temperature_is_one_inside_its_length():
    ids = random_tokens(2, 15)
    plain = tiny_model()(ids).logits
    torch.testing.assert_close(
        tiny_model(path_attn_temperature_scale=0.5, path_attn_temperature_length=16)(ids).logits, plain, rtol=0, atol=0
    )


def test_temperature_length_defaults_to_the_source_context():
    assert PaTHLlamaConfig(**TINY).attn_temperature_length == TINY["max_position_embeddings"]
    yarn = PaTHLlamaConfig(
        **TINY,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    assert yarn.attn_temperature_length == 16
    assert PaTHLlamaConfig(**TINY, path_attn_temperature_length=5).attn_temperature_length == 5


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rope_mode": "drop", "rope_max_wavelength": 8192}, "rope_mode='drop' removes it"),
        ({"rope_mode": "keep", "rope_max_wavelength": 0}, "rope_max_wavelength must be a positive"),
        ({"path_attn_temperature_scale": -0.1}, "path_attn_temperature_scale must be a number >= 0"),
        ({"path_attn_temperature_length": 0}, "path_attn_temperature_length must be a positive"),
    ],
)
def test_bad_long_context_fields_are_refused(fields, message):
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        PaTHLlamaConfig(**TINY, **fields)


def test_fields_round_trip(tmp_path):
    model = tiny_model(rope_mode="interleave", rope_max_wavelength=100.0, path_attn_temperature_scale=0.1)
    model.save_pretrained(tmp_path)
    loaded = PaTHLlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.rope_max_wavelength == 100.0 and loaded.config.path_attn_temperature_scale == 0.1
    ids = random_tokens(1, 12)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_yarn_turns_w_without_stretching_it():
    """Under YaRN, RoPE's cos/sin carry a magnitude factor (0.1 ln(s) + 1) meant for q.k; with rope_mode="interleave"
    w is turned by the same angles but must stay a unit vector, so that H_t stays a reflection: the layer equals the
    reference with w turned by the unscaled angles."""
    from tests.models.test_modeling_path_llama import reference_path_layer

    rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 8}
    model = tiny_model(rope_mode="interleave", rope_parameters=rope_parameters).double()
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 21, model.config.hidden_size, dtype=torch.float64)
    position_ids = torch.arange(21)[None]
    cos, sin = model.model.rotary_emb(x, position_ids)
    scaling = model.model.rotary_emb.attention_scaling
    assert scaling > 1.2
    out, _ = attn(x, position_embeddings=(cos, sin), position_ids=position_ids)
    # the reference turns q and k with the scaled cos/sin, and w with the same angles at unit magnitude
    q_k = reference_path_layer(attn, x, (cos, sin), w_cos_sin=(cos / scaling, sin / scaling))
    assert ((out - q_k).abs().max() / q_k.abs().max()).item() < 1e-6  # RoPE computes its angles in float32
    stretched = reference_path_layer(attn, x, (cos, sin))
    assert ((out - stretched).abs().max() / stretched.abs().max()).item() > 1e-3
