"""NaN and Inf weights: refused with the tensor named and its values counted, before anything lands at DST, on the
raw-copy path, the cast path and `.bin` sources alike; converted with `--allow-nonfinite` (named in a warning), and
then `--verify` says why it cannot compare rather than blaming the weight mapping."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from path_hf.cli import main
from tests.conversion.checkpoints import make_source, read_tensors, run_cli

NAME = "model.layers.1.mlp.up_proj.weight"  # [96, 64]: 6,144 values


def spoil(source, name=NAME, values=(float("nan"),) * 3 + (float("inf"),)):
    """Put `values` at the start of tensor `name` of the single-file safetensors checkpoint `source`."""
    tensors = load_file(source / "model.safetensors")
    tensors[name].view(-1)[: len(values)] = torch.tensor(values)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    return source


def assert_refused(capsys, tmp_path, source, *flags, message):
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not output.exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".converted.")]
    return err


def test_copied_tensor_with_nan_and_inf(tmp_path, capsys):
    source = spoil(make_source(tmp_path / "source", "llama"))
    err = assert_refused(capsys, tmp_path, source, message=f"tensor '{NAME}' holds 3 NaN and 1 Inf of its 6,144 values")
    assert "--allow-nonfinite" in err


def test_bin_source_with_inf(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", pytorch_bin=True)
    shard = next(source.glob("pytorch_model-*.bin"))
    state_dict = torch.load(shard, weights_only=True)
    name = next(name for name in state_dict if name.endswith("o_proj.weight"))
    state_dict[name][3, 5] = -float("inf")
    torch.save(state_dict, shard)
    assert_refused(capsys, tmp_path, source, message=f"tensor '{name}' holds 1 Inf of its 4,096 values")


def test_cast_that_overflows(tmp_path, capsys):
    source = spoil(make_source(tmp_path / "source", "llama"), values=(1e5, -7e4, 6e4))  # float16 stops at 65504
    assert_refused(
        capsys,
        tmp_path,
        source,
        "--dtype",
        "float16",
        message=f"tensor '{NAME}' becomes 2 Inf of its 6,144 values when cast to float16",
    )
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--dtype", "bfloat16")
    assert code == 0, err


def test_allow_nonfinite_converts_and_names_them(tmp_path, capsys):
    source = spoil(make_source(tmp_path / "source", "llama"))
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--allow-nonfinite")
    assert code == 0, err
    warning = next(line for line in err.splitlines() if line.startswith("warning: "))
    assert warning == (
        "warning: 1 tensor(s) hold NaN or Inf, converted as they are (--allow-nonfinite): "
        f"{NAME} (3 NaN and 1 Inf of its 6,144 values)"
    )
    converted, original = read_tensors(output)[NAME], read_tensors(source)[NAME]
    assert torch.equal(converted.view(torch.int32), original.view(torch.int32))  # NaN bits included


def test_verify_names_nonfinite_logits_not_the_mapping(tmp_path, capsys):
    source = spoil(make_source(tmp_path / "source", "llama", tokenizer=True))
    output = tmp_path / "converted"
    flags = ["--rope", "keep", "--init", "identity", "--allow-nonfinite", "--verify"]
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 1
    message = err.splitlines()[-1]
    assert message.startswith("error: verification failed: the source's logits hold NaN or Inf (first at layer 1's")
    assert "--allow-nonfinite" in message and "mapping" not in message
    assert not output.exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2], ids=str)
def test_count_nonfinite_across_chunks(tmp_path, dtype):
    from path_hf.conversion.io import SourceReader, count_nonfinite, read_safetensors_header, value_chunks

    values = torch.zeros(1000)
    values[[0, 511, 999]] = float("nan")
    values[[300, 700]] = float("inf")
    values[[512]] = -float("inf")
    save_file({"finite": torch.ones(100, dtype=dtype), "t": values.to(dtype)}, tmp_path / "t.safetensors")
    finite, tensor = read_safetensors_header(tmp_path / "t.safetensors")
    with SourceReader() as reader:
        assert count_nonfinite("finite", reader.chunks(finite, chunk_bytes=64)) is None
        found = count_nonfinite("t", reader.chunks(tensor, chunk_bytes=64))  # 64-byte pieces
    assert (found.nan, found.inf, found.numel) == (3, 3, 1000)
    assert count_nonfinite("t", value_chunks(values.to(dtype), chunk_bytes=24)) == found
    assert count_nonfinite("i", value_chunks(torch.arange(10))) is None


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("flags", [["--forget-gate", "--forget-gate-bias"], ["--attn-temperature-scale"]])
def test_a_non_finite_option_is_refused(tmp_path, capsys, flags, value):
    """A NaN or infinite float option would write a model that computes NaN: refused by the flag, nothing written."""
    source = make_source(tmp_path / "source", "llama")
    output = tmp_path / "converted"
    with pytest.raises(SystemExit) as stopped:
        main(["convert", "--from", str(source), "--to", str(output), *flags[:-1], f"{flags[-1]}={value}"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument {flags[-1]}: must be a finite number, got {value}" in err, err
    assert not output.exists()


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_wavelength_is_refused(tmp_path, capsys, value):
    """`--rope-max-wavelength` also takes the word `context`, so its number is checked with the config's fields."""
    source = make_source(tmp_path / "source", "llama")
    assert_refused(capsys, tmp_path, source, "--rope", "keep", f"--rope-max-wavelength={value}",
                   message=f"--rope-max-wavelength must be a positive number of tokens, got {value}")  # fmt: skip


def test_a_non_finite_value_in_a_recipe_is_refused():
    """The recipes' `model.convert` (YAML, `key=value` overrides) is checked as the flags are: `.nan` is refused."""
    from path_hf.errors import RecipeError
    from path_hf.recipes.models import conversion_options
    from path_hf.recipes.settings import ModelSettings

    for key, value in (("forget_gate_bias", float("nan")), ("attn_temperature_scale", float("inf"))):
        convert = {"forget_gate": True, key: value}
        with pytest.raises(RecipeError, match=f"must be a finite number|must be a number >= 0.*got {value}"):
            conversion_options(ModelSettings(path="SRC", convert=convert), "OUT")


def test_a_new_tensor_that_overflows_its_dtype_is_refused(tmp_path, capsys):
    """The tensors the conversion adds are checked as the copied ones are: a finite forget-gate bias beyond float16's
    range becomes Inf in a float16 conversion, and no --allow-nonfinite lets it through."""
    source = make_source(tmp_path / "source", "llama")
    flags = ["--forget-gate", "--forget-gate-bias", "1e6", "--dtype", "float16"]
    err = assert_refused(capsys, tmp_path, source, *flags, message="the new tensor")
    assert "holds" in err and "Inf" in err
