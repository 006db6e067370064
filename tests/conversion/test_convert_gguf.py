"""`path-hf convert` from llama.cpp GGUF files (tiny ones, written here with gguf-py the way llama.cpp writes them):
the converted model gives the logits transformers' own GGUF loading gives, for each architecture and for float and
quantised tensor types; the tokenizer, chat template and generation config come along; and every GGUF refusal is
one line with nothing left behind."""

import json
from collections import Counter, namedtuple

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import path_hf  # noqa: F401  (registers path_llama)
import path_hf.conversion.convert
import path_hf.conversion.plan
import path_hf.conversion.staging
from path_hf.conversion.gguf import gguf_source
from path_hf.conversion.options import ConvertOptions
from path_hf.conversion.verify import TEXT_FILE
from tests.conversion.checkpoints import run_cli
from tests.conversion.gguf_files import CHAT_TEMPLATE, default_tokenizer, tiny_model, write_gguf

EXACT = ["--rope", "keep", "--init", "identity"]


def text_ids(max_tokens: int = 128) -> torch.Tensor:
    """The built-in text in the tiny models' vocabulary (the default model's tokenizer)."""
    return default_tokenizer()(TEXT_FILE.read_text(), return_tensors="pt").input_ids[:, :max_tokens]


def transformers_gguf_model(path):
    """The reference: transformers' own `from_pretrained(folder, gguf_file=...)`."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


def logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def leftovers(directory, output) -> list:
    """Anything a conversion to `output` may have left beside it: the output, its staging or GGUF directory."""
    return [path.name for path in directory.iterdir() if path.name.startswith((output.name, f".{output.name}."))]


@pytest.mark.parametrize(
    "arch, tensor_type",
    [
        ("llama", "F32"),
        ("llama", "F16"),
        ("llama", "Q8_0"),
        ("llama", "Q4_0"),
        ("llama", "Q4_1"),
        ("qwen2", "F32"),
        ("qwen2", "Q8_0"),
        ("qwen3", "F32"),
        ("qwen3", "Q4_1"),
    ],
)
def test_converted_gguf_gives_the_logits_of_transformers_gguf_model(arch, tensor_type, tmp_path, capsys):
    # One case carries a tokenizer (then --verify runs on text): gguf-py takes ~0.5 s to parse its vocabulary, and a
    # conversion and the reference read the file six times.
    tokenizer = (arch, tensor_type) == ("llama", "Q4_1")
    source = write_gguf(
        tmp_path / f"{arch}.{tensor_type}.gguf", tiny_model(arch), arch, tensor_type, tokenizer=tokenizer
    )
    output = tmp_path / "converted"
    verify = ["--verify"] if tokenizer else []  # --verify compares with the materialised checkpoint
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, *EXACT, *verify)
    assert code == 0, err
    assert f"source:       {source} (GGUF {arch}, tensors " in out and "dequantised to float32" in out

    reference = transformers_gguf_model(source)
    converted = AutoModelForCausalLM.from_pretrained(output)
    assert type(converted).__name__ == "PaTHLlamaForCausalLM"
    input_ids = text_ids()
    torch.testing.assert_close(logits(converted, input_ids), logits(reference, input_ids), rtol=1e-5, atol=1e-5)
    # Every weight is the dequantised one, bit for bit.
    written = load_file(output / "model.safetensors")
    for name, tensor in reference.state_dict().items():
        if name != "lm_head.weight":  # tied
            assert torch.equal(written[name], tensor), name
    assert leftovers(tmp_path, output) == ["converted"]


def test_dtype_and_the_conversion_record(tmp_path, capsys):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "Q8_0", tokenizer=False)
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--dtype", "bfloat16")
    assert code == 0, err
    written = load_file(output / "model.safetensors")
    assert {tensor.dtype for tensor in written.values()} == {torch.bfloat16}
    for name, tensor in transformers_gguf_model(source).state_dict().items():
        if name != "lm_head.weight":  # tied
            assert torch.equal(written[name], tensor.to(torch.bfloat16)), name

    record = json.loads((output / "config.json").read_text())["path_conversion"]
    counts = Counter(tensor.tensor_type.name for tensor in gguf.GGUFReader(source).tensors)
    assert record["source"] == str(source)
    assert record["gguf"] == {"file_type": None, "tensor_types": counts, "dtype": "bfloat16"}
    assert "gguf_file" not in record["options"]


def test_tokenizer_chat_template_and_generation_config_come_along(tmp_path, capsys):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F16")
    output = tmp_path / "converted"
    assert run_cli(capsys, "convert", "--from", source, "--to", output)[0] == 0

    original = default_tokenizer()  # the tokenizer written into the GGUF
    converted = AutoTokenizer.from_pretrained(output)
    text = TEXT_FILE.read_text()
    assert converted(text).input_ids == original(text).input_ids
    assert converted.decode(converted(text).input_ids, skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "Where is the lighthouse?"}]
    assert converted.chat_template == CHAT_TEMPLATE
    assert converted.apply_chat_template(messages, tokenize=False) == "<s>Where is the lighthouse?</s>"
    generation = json.loads((output / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (original.bos_token_id, original.eos_token_id)
    assert "GGUF file `model.gguf`" in (output / "README.md").read_text()


def test_a_directory_of_ggufs_with_gguf_file(tmp_path, capsys):
    folder = tmp_path / "ggufs"
    folder.mkdir()
    write_gguf(folder / "a.gguf", tiny_model(seed=1), "llama", "Q8_0", tokenizer=False)
    write_gguf(folder / "b.gguf", tiny_model(seed=2), "llama", "Q8_0", tokenizer=False)
    output = tmp_path / "converted"
    assert run_cli(capsys, "convert", "--from", folder, "--gguf-file", "b.gguf", "--to", output, *EXACT)[0] == 0
    input_ids = text_ids(32)
    expected = logits(transformers_gguf_model(folder / "b.gguf"), input_ids)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(output), input_ids), expected)
    assert json.loads((output / "config.json").read_text())["path_conversion"]["source"] == str(folder / "b.gguf")


def test_a_directory_holding_one_gguf(tmp_path, capsys):
    folder = tmp_path / "ggufs"
    folder.mkdir()
    write_gguf(folder / "only.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    code, out, _ = run_cli(capsys, "convert", "--from", folder, "--to", tmp_path / "converted")
    assert code == 0 and f"source:       {folder / 'only.gguf'} (GGUF llama" in out


def test_dry_run_plans_from_the_header_and_writes_nothing(tmp_path, capsys, monkeypatch):
    source = write_gguf(tmp_path / "model.gguf", tiny_model("qwen2"), "qwen2", "Q4_0", tokenizer=False)
    output = tmp_path / "converted"
    with monkeypatch.context() as patch:
        patch.setattr("path_hf.conversion.gguf.gguf_state_dict", lambda *args: pytest.fail("dequantised for a dry run"))
        code, planned, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--dry-run")
    assert code == 0, err
    assert leftovers(tmp_path, output) == []
    code, converted, _ = run_cli(capsys, "convert", "--from", source, "--to", output)
    assert code == 0
    assert planned in converted  # the same plan


def test_llama3_rope_factors_are_left_out_with_a_warning(tmp_path, capsys):
    rope_freqs = {"rope_freqs.weight": (np.ones(8, dtype=np.float32).view(np.uint8), "F32")}
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "Q8_0", raw_tensors=rope_freqs, tokenizer=False)
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted")
    assert code == 0
    assert "warning: model.gguf: rope_freqs.weight left out (Llama 3 RoPE scaling factors" in err


def test_an_interrupted_conversion_leaves_nothing(tmp_path, capsys, monkeypatch):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    output = tmp_path / "converted"

    def interrupted(plan, directory):
        assert (plan.source.path / "model.safetensors").is_file()  # the GGUF is materialised by now
        raise KeyboardInterrupt

    monkeypatch.setattr(path_hf.conversion.convert, "write_conversion", interrupted)
    assert run_cli(capsys, "convert", "--from", source, "--to", output)[0] == 130
    assert leftovers(tmp_path, output) == []


# ---------------------------------------------------------------------------------------------------------------------
# Refusals


def assert_refused(capsys, tmp_path, source, *flags, message, output=None) -> str:
    output = output or tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert leftovers(output.parent, output) == []
    return err


@pytest.mark.parametrize("arch", ["gpt2", "phi3", "mistral"])
def test_unsupported_architecture(arch, tmp_path, capsys):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), arch, "F32", tokenizer=False)
    assert_refused(
        capsys,
        tmp_path,
        source,
        message=f"model.gguf is a GGUF of architecture {arch!r}, which path-hf cannot convert; supported: llama, "
        "qwen2, qwen3",
    )


def test_mixture_of_experts(tmp_path, capsys):
    source = write_gguf(
        tmp_path / "model.gguf", tiny_model(), "llama", "F32", extra={"llama.expert_count": 4}, tokenizer=False
    )
    assert_refused(capsys, tmp_path, source, message="model.gguf is a mixture-of-experts model")


def test_unsupported_quantisation_type(tmp_path, capsys):
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = {"blk.0.ffn_up.extra.weight": (np.zeros((64, 2 * type_size), dtype=np.uint8), "Q8_1")}
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "Q8_0", raw_tensors=raw, tokenizer=False)
    assert_refused(
        capsys,
        tmp_path,
        source,
        message="model.gguf: tensor 'blk.0.ffn_up.extra.weight' is stored as Q8_1, which gguf",
    )


def test_a_tensor_the_model_has_no_place_for(tmp_path, capsys):
    raw = {"blk.0.mystery.weight": (np.ones(64, dtype=np.float32).view(np.uint8), "F32")}
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", raw_tensors=raw, tokenizer=False)
    assert_refused(
        capsys, tmp_path, source, message="tensor 'blk.0.mystery.weight' has no place in a transformers llama model"
    )


@pytest.mark.parametrize("kept", [0.5, 0.999])
def test_truncated_file(kept, tmp_path, capsys):
    complete = write_gguf(tmp_path / "complete.gguf", tiny_model(), "llama", "Q8_0", tokenizer=False).read_bytes()
    source = tmp_path / "model.gguf"
    source.write_bytes(complete[: int(len(complete) * kept)])
    assert_refused(capsys, tmp_path, source, message="is not a readable GGUF file: it is truncated or corrupt")


def test_corrupt_file(tmp_path, capsys):
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 8)
    assert_refused(capsys, tmp_path, source, message="is not a readable GGUF file: it is truncated or corrupt")


def test_several_ggufs_and_no_gguf_file(tmp_path, capsys):
    folder = tmp_path / "ggufs"
    folder.mkdir()
    for name in ("b.gguf", "a.gguf"):
        (folder / name).write_bytes(b"")
    assert_refused(
        capsys, tmp_path, folder, message="holds 2 GGUF files (a.gguf, b.gguf); choose one with --gguf-file NAME"
    )


def test_gguf_file_missing(tmp_path, capsys):
    folder = tmp_path / "ggufs"
    folder.mkdir()
    (folder / "a.gguf").write_bytes(b"")
    assert_refused(
        capsys, tmp_path, folder, "--gguf-file", "b.gguf", message=f"--gguf-file b.gguf: no such file in {folder}"
    )


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_gguf_file_given_as_a_path_is_refused(tmp_path, capsys, where):
    """--gguf-file names a file in SRC; a path (absolute, or `../x.gguf`) is refused as such, not called a link."""
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    folder = tmp_path / "folder"
    folder.mkdir()
    named = str(gguf_path) if where == "absolute" else "../model.gguf"
    assert_refused(capsys, tmp_path, folder, "--gguf-file", named, message=f"takes the name of a file in {folder}")


def test_gguf_file_with_a_file_as_source(tmp_path, capsys):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    assert_refused(capsys, tmp_path, source, "--gguf-file", "model.gguf", message="names a file in the directory SRC")
    assert_refused(capsys, tmp_path, source, "--gguf-file", "x.gguf", message="is not a directory")


def test_revision_with_a_gguf(tmp_path, capsys):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    assert_refused(capsys, tmp_path, source, "--revision", "main", message="--revision applies to hub ids")


def test_existing_destination_is_refused_before_dequantising(tmp_path, capsys, monkeypatch):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    output = tmp_path / "converted"
    output.mkdir()
    (output / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setattr("path_hf.conversion.gguf.materialise", lambda *args, **kwargs: pytest.fail("materialised"))
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output)
    assert code == 1 and "exists and holds a model; pass --force" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["converted", "model.gguf"]


def test_not_enough_disk_space_counts_the_materialised_checkpoint(tmp_path, capsys, monkeypatch):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "Q4_0", tokenizer=False)
    options = ConvertOptions(source=str(source), output=str(tmp_path / "converted"), dry_run=True)
    with gguf_source(options) as materialised:
        output_bytes = path_hf.conversion.plan.plan_conversion(options, materialised).bytes_to_write
    weights = sum(int(tensor.n_elements) for tensor in gguf.GGUFReader(source).tensors) * 4  # in float32
    # Room for the output, not for the materialised checkpoint beside it.
    free = path_hf.conversion.staging.disk_margin(2 * weights) + int(1.5 * weights)
    assert path_hf.conversion.staging.disk_margin(output_bytes) + output_bytes < free
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(
        path_hf.conversion.staging.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free)
    )
    assert_refused(capsys, tmp_path, source, message="not enough free disk space")
