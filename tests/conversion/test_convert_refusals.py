"""What `path-hf convert` refuses: one `error: ...` line, exit code 1, and nothing at the destination."""

import json
import re
from collections import namedtuple
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, MixtralConfig

import path_hf.conversion.convert
import path_hf.conversion.gguf
import path_hf.conversion.staging
from path_hf.conversion.io import SafetensorsWriter
from path_hf.conversion.plan import model_code_bytes
from path_hf.conversion.staging import check_destination
from path_hf.errors import ConversionError
from tests.conversion.checkpoints import TINY, make_source, run_cli
from tests.conversion.gguf_files import tiny_model, write_gguf
from tests.tiny import tiny_config


def save_config(directory, config) -> None:
    directory.mkdir()
    config.architectures = [config.architectures[0]]
    config.save_pretrained(directory)


def assert_refused(capsys, tmp_path, source, *flags, message, output=None):
    output = output or tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not output.exists()
    assert not [path for path in output.parent.iterdir() if path.name.startswith(f".{output.name}.")]
    return err


# id: (config, message)
UNSUPPORTED = {
    "gpt2": (GPT2Config(n_layer=2, architectures=["GPT2LMHeadModel"]), "learned absolute position embeddings"),
    "moe": (MixtralConfig(num_hidden_layers=2, architectures=["MixtralForCausalLM"]), "mixture-of-experts"),
    "mistral-sliding-window": (
        tiny_config("mistral", **TINY, sliding_window=32, architectures=["MistralForCausalLM"]),
        "sliding-window attention (sliding_window=32)",
    ),
    "qwen2-sliding-window": (
        tiny_config("qwen2", **TINY, use_sliding_window=True, max_window_layers=1, architectures=["Qwen2ForCausalLM"]),
        "sliding-window attention",
    ),
}
RAW_CONFIGS = {
    "bert": ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "an encoder"),
    "multimodal": (
        {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "vision_config": {}},
        "it is multimodal",
    ),
    "already-path": ({"architectures": ["PaTHLlamaForCausalLM"], "model_type": "path_llama"}, "already a PaTH model"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_architecture(case, tmp_path, capsys):
    config, message = UNSUPPORTED[case]
    save_config(tmp_path / "source", config)
    assert_refused(capsys, tmp_path, tmp_path / "source", message=message)


@pytest.mark.parametrize("case", list(RAW_CONFIGS))
def test_unsupported_config(case, tmp_path, capsys):
    raw, message = RAW_CONFIGS[case]
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "config.json").write_text(json.dumps(raw))
    assert_refused(capsys, tmp_path, tmp_path / "source", message=message)


def test_head_dim_fla_cannot_run(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", head_dim=24)
    err = assert_refused(capsys, tmp_path, source, message="head dim 24 is not one FLA's PaTH kernel runs")
    assert "torch backend still runs it" in err and "--allow-torch-only-head-dim" in err
    code, _, err = run_cli(
        capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--allow-torch-only-head-dim"
    )
    assert code == 0, err
    assert (tmp_path / "converted" / "model.safetensors").is_file()


def test_missing_shard(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", max_shard_size="100KB")
    (source / "model-00002-of-00006.safetensors").unlink()
    assert_refused(capsys, tmp_path, source, message="missing from")


def test_corrupt_safetensors_shard(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", max_shard_size="100KB")
    shard = source / "model-00003-of-00006.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_refused(capsys, tmp_path, source, message="model-00003-of-00006.safetensors is not a valid safetensors file")


def test_corrupt_bin_shard(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", pytorch_bin=True)
    (source / "pytorch_model-00002-of-00002.bin").write_bytes(b"not a checkpoint")
    assert_refused(capsys, tmp_path, source, message="is not a readable PyTorch checkpoint")


def test_index_disagrees_with_shards(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", max_shard_size="100KB")
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00006.safetensors"
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(capsys, tmp_path, source, message="and the index disagree")


def test_shapes_disagree_with_config(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    config = json.loads((source / "config.json").read_text())
    config["intermediate_size"] = 128
    (source / "config.json").write_text(json.dumps(config))
    assert_refused(
        capsys, tmp_path, source, message="but the config implies [64, 128] (hidden_size x intermediate_size)"
    )


def test_missing_tensor(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert_refused(capsys, tmp_path, source, message="'model.layers.1.mlp.up_proj.weight'")


def test_destination_inside_source(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    assert_refused(capsys, tmp_path, source, output=source / "converted", message="is inside the source")


def test_source_inside_destination(tmp_path, capsys):
    source = make_source(tmp_path / "out" / "source", "llama")
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "out", "--force")
    assert code == 1 and "is inside the destination" in err
    assert (source / "model.safetensors").is_file()


def test_not_enough_disk_space(tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    # 529 KB of weights and tokenizer files, 211 KB of code and metadata, and the margin
    monkeypatch.setattr(
        path_hf.conversion.staging.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**6, 600_000)
    )
    source = make_source(tmp_path / "source", "llama")
    err = assert_refused(capsys, tmp_path, source, message="not enough free disk space")
    # the weights and tokenizer files, and the model code and card beside them
    needed = re.search(r"the output needs ([\d.]+) KB \(\+ [\d.]+ KB margin\), 600.00 KB is free\.", err)
    assert needed and float(needed[1]) == pytest.approx((528_820 + model_code_bytes()) / 1000, abs=0.01), err


def test_existing_model_needs_force(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    output = tmp_path / "converted"
    assert run_cli(capsys, "convert", "--from", source, "--to", output, "--seed", "1")[0] == 0
    (output / ".cache" / "huggingface").mkdir(parents=True)  # what `hf download --local-dir` leaves in a model
    before = (output / "model.safetensors").read_bytes()
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output)
    assert code == 1 and err == f"error: {output} exists and holds a model; pass --force to replace it.\n"
    assert (output / "model.safetensors").read_bytes() == before

    assert run_cli(capsys, "convert", "--from", source, "--to", output, "--force")[0] == 0
    assert (output / "model.safetensors").read_bytes() != before and not (output / ".cache").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["converted", "source"]


def user_folder(directory):
    """A folder of someone's own work: a file and a subfolder."""
    (directory / "notes").mkdir(parents=True)
    (directory / "thesis.tex").write_text("my thesis")
    (directory / "notes" / "todo.txt").write_text("finish")
    return directory


def assert_intact(directory):
    assert sorted(path.name for path in directory.iterdir()) == ["notes", "thesis.tex"]
    assert (directory / "thesis.tex").read_text() == "my thesis" and (directory / "notes" / "todo.txt").is_file()


@pytest.mark.parametrize("flags", [(), ("--force",), ("--force", "--dry-run")])
def test_force_replaces_only_a_model_or_an_empty_folder(flags, tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    work = user_folder(tmp_path / "work")
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", work, *flags)
    assert code == 1 and out == ""
    assert err == (
        f"error: the destination {work} is not a model folder (no config.json or weights; it holds notes/, "
        "thesis.tex): --force replaces only a model folder or an empty one; choose a new or empty folder.\n"
    )
    assert_intact(work)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source", "work"]  # no lock or staging left

    # A folder that looks like a model but holds a folder of someone's: path-hf never writes one.
    (work / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", work, *flags)
    assert code == 1 and "(it holds folders that are not a model's: notes/)" in err, err
    assert (work / "config.json").is_file()
    (work / "config.json").unlink()
    assert_intact(work)

    (tmp_path / "empty").mkdir()
    assert run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "empty", *flags)[0] == 0


def test_the_current_directory_is_never_replaced(tmp_path, capsys, monkeypatch):
    """`cd ~/work && path-hf convert --from SRC --to . --force`: refused, even once the folder holds a model."""
    source = make_source(tmp_path / "source", "llama")
    work = user_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", ".", "--force")
    assert code == 1
    assert err == (
        f"error: the destination {work} is the current directory, which a conversion would replace whole; write the "
        f"model to a new folder, e.g. --to {work / 'model-path'}.\n"
    )
    assert_intact(work)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source", "work"]
    monkeypatch.chdir(work / "notes")
    (work / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", "..", "--force", "--dry-run")
    assert code == 1 and f"is a folder that holds the current directory ({work / 'notes'})" in err
    assert (work / "config.json").is_file() and (work / "notes" / "todo.txt").is_file()


def test_the_home_directory_and_root_are_never_replaced(tmp_path, capsys, monkeypatch):
    source = make_source(tmp_path / "source", "llama")
    home = tmp_path / "home"
    assert run_cli(capsys, "convert", "--from", source, "--to", home)[0] == 0  # a model, even
    monkeypatch.setenv("HOME", str(home))
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", "~", "--force")
    assert code == 1 and f"error: the destination {home} is your home directory, which a conversion" in err, err
    assert (home / "model.safetensors").is_file()
    # Checked alone: a test must not hand `/` to a conversion.
    with pytest.raises(ConversionError, match=r"the destination / is a folder that holds the current directory"):
        check_destination(Path("/"), force=True)


@pytest.mark.parametrize("flags", [(), ("--force",)])
def test_a_file_is_not_a_destination(flags, tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    output = tmp_path / "model.safetensors"
    output.write_bytes(b"mine")
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 1
    assert err == f"error: the destination {output} is a file, not a model folder; choose a new or empty folder.\n"
    assert output.read_bytes() == b"mine"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors", "source"]


def test_a_destination_is_checked_before_a_gguf_is_read(tmp_path, capsys, monkeypatch):
    def read(*args):
        raise AssertionError("the GGUF was read before the destination was checked")

    monkeypatch.setattr(path_hf.conversion.gguf.GGUFFile, "read", read)
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    work = user_folder(tmp_path / "work")
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", work, "--force")
    assert code == 1 and "is not a model folder" in err, err
    assert_intact(work)


def test_layers_out_of_range(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    assert_refused(capsys, tmp_path, source, "--layers", "1-3", message="--layers names layer 3")


def test_hub_id_not_in_cache_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert_refused(capsys, tmp_path, "nobody/no-such-model", message="cannot get 'nobody/no-such-model' from the hub")


def test_verify_failure_leaves_nothing(tmp_path, capsys, monkeypatch):
    """A weight that lands in the wrong place fails --verify, and the output is not moved into place."""
    write_conversion = path_hf.conversion.convert.write_conversion

    def misplace_a_weight(plan, directory):
        write_conversion(plan, directory)
        tensors = load_file(directory / "model.safetensors")
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].clone()
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(path_hf.conversion.convert, "write_conversion", misplace_a_weight)
    source = make_source(tmp_path / "source", "llama")
    assert_refused(capsys, tmp_path, source, "--verify", message="verification failed: the converted model's logits")


def test_interrupted_conversion_leaves_nothing(tmp_path, capsys, monkeypatch):
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(SafetensorsWriter, "copy_tensor", interrupt)
    source = make_source(tmp_path / "source", "llama")
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output)
    assert code == 130 and "interrupted" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


def test_failure_shows_traceback_only_with_debug(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", max_shard_size="100KB")
    (source / "model.safetensors.index.json").write_text("{")
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--debug")
    assert code == 1 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: ")
    assert not (tmp_path / "converted").exists()


def test_verify_with_dry_run_is_refused(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    assert_refused(capsys, tmp_path, source, "--verify", "--dry-run", message="cannot run with --dry-run")


def test_bad_layer_list_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(capsys, "convert", "--from", tmp_path, "--to", tmp_path / "converted", "--layers", "3-1")
    assert exit_info.value.code == 2
    assert "ends before it starts" in capsys.readouterr().err


# Source config values that made transformers fail with a raw exception, or built a model computing only NaN.
BAD_VALUES = {
    "no-heads": ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    "kv-heads": ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    "layers-as-text": ({"num_hidden_layers": "3"}, "num_hidden_layers must be a positive integer, got '3'"),
    "no-positions": ({"max_position_embeddings": -1}, "max_position_embeddings must be a positive integer, got -1"),
    "eps-nan": ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive number, got nan"),
    "one-token": ({"vocab_size": 1}, "vocab_size 1 leaves one token"),
    "theta-0": ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta must be a positive"),
    "rope-bogus": ({"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e4}}, "rope_type 'bogus' is not one"),
    "yarn-half": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 0.5}},
        "the yarn RoPE scaling factor must be a number >= 1, got 0.5",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_source_config_value_is_refused_by_name(case, tmp_path, capsys):
    patch, message = BAD_VALUES[case]
    source = make_source(tmp_path / "source", "llama")
    config_file = source / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **patch}))
    assert_refused(capsys, tmp_path, source, message=f"the source's config.json: {message}")


def test_a_config_that_is_not_an_object_is_refused(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    (source / "config.json").write_text("[1, 2]")
    assert_refused(capsys, tmp_path, source, message="config.json must hold a JSON object, got a list")


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--layers", "0", "--local-window", "8", "--local-sinks", "8"), "--local-sinks 8 must be fewer than the"),
        (("--seed", str(2**64)), "--seed must be an integer from 0 to 2**63 - 1"),
    ],
)
def test_sinks_or_a_seed_out_of_range_are_refused(tmp_path, capsys, flags, message):
    assert_refused(capsys, tmp_path, make_source(tmp_path / "source", "llama"), *flags, message=message)


def test_a_window_past_the_sources_positions_is_said(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    flags = ("--layers", "0", "--local-window", "1000", "--dry-run")
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", *flags)
    assert code == 0 and "warning: --local-window 1000 is longer than the source's 256 positions" in err, err


LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0] * 8,
    "long_factor": [1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0, 4.0],
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope, name",
    [(LONGROPE, "LongRoPE"), ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "dynamic NTK")],
    ids=["longrope", "dynamic"],
)
def test_a_band_of_a_length_dependent_rope_is_refused(tmp_path, capsys, rope, name):
    """`--rope-max-wavelength` fixes the rotated pairs once; a source RoPE whose frequencies change with the length
    (LongRoPE's long factors, dynamic NTK) has no single band, and the model would be silently wrong past its
    context. Without the option the same sources convert."""
    source = make_source(tmp_path / "source", "llama", rope_parameters=rope)
    message = f"but the source's {name} RoPE changes its frequencies with the sequence length"
    assert_refused(capsys, tmp_path, source, "--rope", "keep", "--rope-max-wavelength", "100", message=message)
    flags = ("--rope", "keep", "--init", "identity", "--verify")
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", *flags)
    assert code == 0 and "verify:" in out, err
