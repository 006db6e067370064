"""`path-hf convert` end to end on tiny Llama, Qwen2, Qwen3 and Mistral checkpoints: the output loads, its logits
equal the source's with the transforms at identity, every source tensor is copied bit for bit, and the new
tensors are the model's own init."""

import json
from dataclasses import fields

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import path_hf
from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.conversion import ConvertOptions
from path_hf.conversion.write import layer_seed
from tests.conversion.checkpoints import CHAT_TEMPLATE, make_source, read_tensors, run_cli

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
# id: (architecture, how the source is saved and configured, convert flags)
CASES = {
    "llama-sharded-gqa-tokenizer": (
        "llama",
        {"max_shard_size": "100KB", "tokenizer": True},
        ["--rope", "keep", "--init", "identity", "--max-shard-size", "150KB", "--verify"],
    ),
    "llama3-rope-tied-bias-fp16": (
        "llama",
        {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True},
        ["--seed", "7", "--dtype", "float16", "--verify"],
    ),
    "qwen2-tied-some-layers": (
        "qwen2",
        {"tie_word_embeddings": True},
        ["--rope", "keep", "--layers", "0,2", "--verify"],
    ),
    "qwen3-sharded-interleave-forget-gate-low-rank": (
        "qwen3",
        {"head_dim": 32, "max_shard_size": "100KB", "num_key_value_heads": 4},
        ["--rope", "interleave", "--forget-gate", "--forget-gate-bias", "4", "--w-rank", "8", "--init", "identity"]
        + ["--verify"],
    ),
    "mistral-bin-bf16": (
        "mistral",
        {"pytorch_bin": True, "sliding_window": None},
        ["--conv-size", "0", "--dtype", "bfloat16", "--verify"],
    ),
}
# FLA's names and the gains, in the attention's registration order
NEW_MODULES = ("w_proj", "w_conv1d", "bt_proj", "bt_gain", "g_proj", "g_gain")


def model_init(config: PaTHLlamaConfig, layer_idx: int, seed: int) -> dict[str, torch.Tensor]:
    """The new parameters of one PaTH layer as the model's own weight init makes them after seeding."""
    with torch.device("meta"):
        model = PaTHLlamaForCausalLM(config)  # only for its bound `_initialize_weights`
    attention = path_hf.PaTHLlamaAttention(config, layer_idx)
    torch.manual_seed(layer_seed(seed, layer_idx))
    model._initialize_weights(attention)
    prefix = f"model.layers.{layer_idx}.self_attn."
    return {
        prefix + name: param.detach()
        for name, param in attention.named_parameters()
        if name.split(".")[0] in NEW_MODULES
    }


def identity_logits(model: PaTHLlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits with RoPE kept and every Householder transform (and forget gate) at the identity."""
    model.config.rope_mode = "keep"
    for module in model.modules():
        if isinstance(module, path_hf.modeling_path_llama.PaTHGain):
            module.weight.data.zero_()
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("case", list(CASES))
def test_convert(case, tmp_path, capsys):
    kind, source_fields, flags = CASES[case]
    source = make_source(tmp_path / "source", kind, **source_fields)
    output = tmp_path / "out" / "converted"
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 0, err
    if "--verify" in flags:
        assert "verify: max |logits - source logits|" in out
        if source_fields.get("tokenizer"):
            assert "verify: perplexity on the built-in text: source" in out
        else:
            assert "perplexity skipped" in out
    assert not [p for p in output.parent.iterdir() if p.name.startswith(".")], "staging directory left behind"

    # config.json: path_llama, source fields kept, the conversion recorded, code for trust_remote_code beside it
    saved = json.loads((output / "config.json").read_text())
    source_config = json.loads((source / "config.json").read_text())
    assert saved["model_type"] == "path_llama" and saved["architectures"] == ["PaTHLlamaForCausalLM"]
    for key in ("hidden_size", "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rope_parameters"):
        assert saved[key] == source_config[key], key
    assert saved["path_conversion"]["source"] == str(source)
    assert saved["rope_mode"] == (flags[flags.index("--rope") + 1] if "--rope" in flags else "drop")
    assert saved["auto_map"] == {
        "AutoConfig": "configuration_path_llama.PaTHLlamaConfig",
        "AutoModelForCausalLM": "modeling_path_llama.PaTHLlamaForCausalLM",
    }
    for code_file in ("configuration_path_llama.py", "modeling_path_llama.py", "ops.py"):
        assert (output / code_file).is_file()
    assert (output / "generation_config.json").is_file() and "path-hf convert" in (output / "README.md").read_text()
    if source_fields.get("tokenizer"):
        assert AutoTokenizer.from_pretrained(output).chat_template == CHAT_TEMPLATE

    # weights: shards and index, every source tensor bit-identical (after --dtype), new tensors = the model's init
    shards = sorted(output.glob("*.safetensors"))
    if "--max-shard-size" in flags:
        assert len(shards) > 1
        weight_map = json.loads((output / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(weight_map.values()) == {shard.name for shard in shards}
    source_tensors, output_tensors = read_tensors(source), read_tensors(output)
    dtype = getattr(torch, flags[flags.index("--dtype") + 1]) if "--dtype" in flags else None
    for name, tensor in source_tensors.items():
        expected = tensor.to(dtype) if dtype is not None else tensor
        assert output_tensors[name].dtype == expected.dtype, name
        assert torch.equal(output_tensors[name].view(torch.uint8), expected.view(torch.uint8)), name

    config = PaTHLlamaConfig.from_pretrained(output)
    seed = int(flags[flags.index("--seed") + 1]) if "--seed" in flags else 0
    expected_new = {}
    for layer_idx in range(config.num_hidden_layers):
        if config.is_path_layer(layer_idx):
            expected_new.update(model_init(config, layer_idx, seed))
    assert set(output_tensors) == set(source_tensors) | set(expected_new)
    for name, tensor in expected_new.items():
        assert torch.equal(output_tensors[name], tensor.to(output_tensors[name].dtype)), name

    # loads with from_pretrained after `import path_hf`; with the transforms at identity it is the source model
    model, info = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32, output_loading_info=True)
    assert isinstance(model, PaTHLlamaForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    source_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if dtype is not None:
        for param in source_model.parameters():
            param.data = param.data.to(dtype).float()
    input_ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected_logits = source_model(input_ids).logits
    torch.testing.assert_close(identity_logits(model, input_ids), expected_logits, rtol=0, atol=1e-5)


def test_identity_start_is_the_source_model(tmp_path, capsys):
    """With --rope keep --init identity the converted model, as loaded, computes the source's logits."""
    source = make_source(tmp_path / "source", "qwen2")
    output = tmp_path / "converted"
    assert run_cli(capsys, "convert", "--from", source, "--to", output, "--rope", "keep", "--init", "identity")[0] == 0
    input_ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(output)(input_ids).logits
        source_logits = AutoModelForCausalLM.from_pretrained(source)(input_ids).logits
    torch.testing.assert_close(logits, source_logits, rtol=0, atol=1e-5)


def test_dry_run_writes_nothing(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", max_shard_size="100KB")
    output = tmp_path / "converted"
    code, out, _ = run_cli(capsys, "convert", "--from", source, "--to", output, "--dry-run", "--layers", "1-2")
    assert code == 0
    assert "architecture: LlamaForCausalLM, 3 layers" in out
    assert "PaTH layers:  1-2 (2 of 3)" in out
    # 2 layers x (w_proj, w_conv1d, bt_proj weight/bias, bt_gain); kv_dim 32, hidden 64, conv 3, 2 kv heads
    assert f"add:          10 tensors, {2 * (32 * 64 + 32 * 3 + 2 * 64 + 2 + 2):,} parameters" in out
    assert not output.exists() and list(tmp_path.iterdir()) == [source]


def test_legacy_tensors_are_left_out(tmp_path, capsys):
    """Old checkpoints hold RoPE's `inv_freq` buffers, and some tied ones a copy of the head: neither is copied."""
    source = make_source(tmp_path / "source", "llama", tie_word_embeddings=True)
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    output = tmp_path / "converted"
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--verify")
    assert code == 0, err
    assert "leave out:    2 tensor(s): lm_head.weight, model.layers.0.self_attn.rotary_emb.inv_freq" in out
    written = read_tensors(output)
    assert "lm_head.weight" not in written and not any("inv_freq" in name for name in written)


def test_hub_style_llama3_config(tmp_path, capsys):
    """Llama 3.x configs on the hub spell RoPE as `rope_theta` and `rope_scaling`: they arrive as rope_parameters."""
    source = make_source(tmp_path / "source", "llama", rope_parameters=LLAMA3_ROPE)
    config = json.loads((source / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (source / "config.json").write_text(json.dumps(config))
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--verify")
    assert code == 0, err
    assert json.loads((output / "config.json").read_text())["rope_parameters"] == LLAMA3_ROPE


def test_every_config_option_sets_its_config_field(tmp_path, capsys):
    """Each option that sets a `PaTHLlamaConfig` field (metadata "config") defaults to the config's own default and,
    given another value on the command line, lands in the converted config.json under the config's name."""
    config_options = {
        option.name: option.metadata["config"] for option in fields(ConvertOptions) if "config" in option.metadata
    }
    for name, config_field in config_options.items():
        assert getattr(ConvertOptions, name, None) == getattr(PaTHLlamaConfig, config_field), name
    flags = ["--rope", "interleave", "--rope-max-wavelength", "64", "--attn-temperature-scale", "0.25"]
    flags += ["--attn-temperature-length", "16", "--forget-gate", "--forget-gate-bias", "3", "--layers", "0"]
    flags += ["--local-window", "8", "--local-sinks", "2", "--w-rank", "8", "--conv-size", "2", "--init", "identity"]
    flags += ["--local-full-heads", "1:0"]
    expected = {
        "rope_mode": "interleave", "rope_max_wavelength": 64.0, "path_attn_temperature_scale": 0.25,
        "path_attn_temperature_length": 16, "path_forget_gate": True, "path_forget_gate_bias": 3.0,
        "path_layers": [0], "local_window": 8, "local_sinks": 2, "path_w_rank": 8, "path_conv_size": 2,
        "path_init": "identity", "local_full_heads": [[1, 0]],
    }  # fmt: skip
    assert set(expected) == set(config_options.values())
    source = make_source(tmp_path / "source", "llama")
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "out", *flags)
    assert code == 0, err
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {key: saved[key] for key in expected} == expected
    assert all(expected[key] != getattr(PaTHLlamaConfig, key) for key in expected)  # each one moved off its default
