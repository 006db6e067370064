"""The pieces of the converter: shard writing and cutting, and the options that become CLI flags."""

import re
from dataclasses import fields

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file, save_file

from path_hf import PaTHLlamaConfig
from path_hf.arguments import flag
from path_hf.cli import build_parser
from path_hf.conversion.io import SafetensorsWriter, TensorMeta, read_safetensors_header, split_into_shards
from path_hf.conversion.options import ConvertOptions, format_layers, parse_layers, parse_size
from path_hf.errors import ConversionError


def test_writer_streams_tensors_and_raw_copies(tmp_path):
    source = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, dtype=torch.bfloat16),
    }
    save_file(source, tmp_path / "source.safetensors")
    headers = {tensor.name: tensor for tensor in read_safetensors_header(tmp_path / "source.safetensors")}
    new = torch.randn(4, 4, dtype=torch.float16)
    entries = [TensorMeta("copied.c", torch.bfloat16, (2,)), TensorMeta("new", torch.float16, (4, 4))]
    entries.append(TensorMeta("copied.a", torch.float32, (3, 5)))

    with (
        SafetensorsWriter(tmp_path / "out.safetensors", entries, metadata={"note": "test"}) as writer,
        open(tmp_path / "source.safetensors", "rb") as file,
    ):
        writer.copy_tensor(entries[0], file, headers["c"].offset)
        writer.write_tensor(entries[1], new)
        writer.copy_tensor(entries[2], file, headers["a"].offset)

    written = load_file(tmp_path / "out.safetensors")
    assert torch.equal(written["copied.a"], source["a"]) and torch.equal(written["copied.c"], source["c"])
    assert torch.equal(written["new"], new)


def test_writer_writes_the_bytes_safetensors_writes_for_tensors_in_its_order(tmp_path):
    # save_file orders tensors by dtype alignment, then name: these already are.
    tensors = {
        "a": torch.arange(5, dtype=torch.int64),
        "b": torch.randn(3, 5),
        "c": torch.randn(2, dtype=torch.bfloat16),
        "d": torch.tensor([True, False, True]),
    }
    save_file(tensors, tmp_path / "safetensors.safetensors", metadata={"format": "pt"})
    entries = [TensorMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
    with SafetensorsWriter(tmp_path / "ours.safetensors", entries) as writer:
        for entry in entries:
            writer.write_tensor(entry, tensors[entry.name])
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "safetensors.safetensors").read_bytes()


def test_writer_refuses_what_the_header_did_not_announce(tmp_path):
    writer = SafetensorsWriter(tmp_path / "out.safetensors", [TensorMeta("x", torch.float32, (2,))])
    with pytest.raises(RuntimeError, match="where the header has"):
        writer.write_tensor(TensorMeta("y", torch.float32, (2,)), torch.zeros(2))
    with pytest.raises(RuntimeError, match="announced but not written"):
        writer.close()


def test_split_into_shards():
    tensors = [TensorMeta(str(i), torch.float32, (size,)) for i, size in enumerate([10, 10, 30, 5, 5, 5])]
    shards = split_into_shards(tensors, max_shard_bytes=80)
    assert [[t.name for t in shard] for shard in shards] == [["0", "1"], ["2"], ["3", "4", "5"]]
    assert [[t.name for t in shard] for shard in split_into_shards(tensors, 10**6)] == [[t.name for t in tensors]]


@pytest.mark.parametrize("spec, layers", [("0-3,7", (0, 1, 2, 3, 7)), ("5", (5,)), ("2, 0-1 ,2", (0, 1, 2))])
def test_layers_round_trip(spec, layers):
    assert parse_layers(spec) == layers
    assert parse_layers(format_layers(layers)) == layers


@pytest.mark.parametrize("spec", ["", "a", "3-1", "1,,2", "-1"])
def test_bad_layer_lists(spec):
    with pytest.raises(ValueError):
        parse_layers(spec)


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size("1234") == 1234


def test_every_option_is_a_documented_flag():
    convert_parser = build_parser()._subparsers._group_actions[0].choices["convert"]
    actions = {action.dest: action for action in convert_parser._actions}
    for option in fields(ConvertOptions):
        assert option.name in actions and actions[option.name].help, option.name
    args = convert_parser.parse_args(["--from", "a", "--to", "b", "--layers", "0-2", "--max-shard-size", "1GB"])
    assert (args.source, args.output, args.layers, args.max_shard_size) == ("a", "b", (0, 1, 2), 10**9)


def test_config_options_are_documented_by_the_config():
    """A flag that sets a config field shows the config's own documentation of it (the docstring's Args entry), so
    each PaTH option is explained once."""
    convert_parser = build_parser()._subparsers._group_actions[0].choices["convert"]
    actions = {action.dest: action for action in convert_parser._actions}
    documented = 0
    for option in fields(ConvertOptions):
        if "config" in option.metadata:
            doc = " ".join(PaTHLlamaConfig.__doc__.split(f"        {option.metadata['config']} (", 1)[1].split())
            first_sentence = doc.split("):", 1)[1].strip().split(". ")[0]
            assert first_sentence in " ".join(actions[option.name].help.split()), option.name
            documented += 1
    assert documented == 13


def test_options_are_checked_in_python_too():
    with pytest.raises(ConversionError, match="--dtype must be one of float32, bfloat16, float16; got 'float64'"):
        ConvertOptions(source="a", output="b", dtype="float64")
    with pytest.raises(ConversionError, match="--w-rank must be a positive integer"):
        ConvertOptions(source="a", output="b", w_rank=0)
    with pytest.raises(ConversionError, match="--forget-gate-bias sets the forget gate's init: it needs --forget-gate"):
        ConvertOptions(source="a", output="b", forget_gate_bias=6)
    assert ConvertOptions(source="a", output="b", forget_gate=True, forget_gate_bias=6).forget_gate_bias == 6


# (options, the same settings as config fields, the message with config names); the options' message names flags
SHARED_CHECKS = {
    "wavelength-drop": (
        {"rope_max_wavelength": 64},
        {"rope_max_wavelength": 64.0},
        "rope_max_wavelength limits the RoPE that PaTH layers keep, but rope_mode='drop' removes it: use "
        "rope_mode='keep' or rope_mode='interleave' with it.",
    ),
    "wavelength-negative": (
        {"rope": "keep", "rope_max_wavelength": -5},
        {"rope_mode": "keep", "rope_max_wavelength": -5.0},
        "rope_max_wavelength must be a positive number of tokens, got -5.",
    ),
    "temperature": (
        {"attn_temperature_scale": -0.5},
        {"path_attn_temperature_scale": -0.5},
        "path_attn_temperature_scale must be a number >= 0 (0 turns the temperature off), got -0.5.",
    ),
    "conv": (
        {"conv_size": -1},
        {"path_conv_size": -1},
        "path_conv_size must be >= 0 (0 turns the convolution off), got -1.",
    ),
    "rank": ({"w_rank": 0}, {"path_w_rank": 0}, "path_w_rank must be a positive integer (unset: full rank), got 0."),
    "sinks": (
        {"local_sinks": 2},
        {"local_sinks": 2},
        "local_sinks are the sinks of the local layers: they need local_window.",
    ),
}


@pytest.mark.parametrize("case", SHARED_CHECKS)
def test_config_checks_are_the_options_checks(case):
    """A PaTH option is checked once, by the config's `check_path_fields`: the converter refuses what the config
    refuses, with the same words, naming its flags where the config names its fields."""
    options, config_fields, message = SHARED_CHECKS[case]
    with pytest.raises(StrictDataclassClassValidationError) as refused:
        PaTHLlamaConfig(num_hidden_layers=2, **config_fields)
    assert message in str(refused.value)
    flags = {
        option.metadata["config"]: flag(option) for option in fields(ConvertOptions) if "config" in option.metadata
    }
    as_flags = re.sub(r"(\w+)='(\w+)'", lambda m: f"{flags[m[1]]} {m[2]}", message)
    as_flags = re.sub(r"\b(" + "|".join(flags) + r")\b", lambda m: flags[m[1]], as_flags)
    with pytest.raises(ConversionError) as refused:
        ConvertOptions(source="a", output="b", **options)
    assert str(refused.value) == as_flags
