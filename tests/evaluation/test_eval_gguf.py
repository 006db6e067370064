"""`path-hf eval --model FILE.gguf`: the GGUF evaluates as its export does (transformers' own GGUF model, saved as an
ordinary checkpoint), and an unreadable GGUF is refused on one line."""

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from path_hf.cli import main
from path_hf.commands.eval import run_eval
from path_hf.conversion import ConvertOptions
from path_hf.conversion.convert import convert
from path_hf.errors import ConversionError, EvaluationError, SourceError
from path_hf.evaluation import EvalOptions, ModelSpec
from path_hf.loading import GGUFFile, load_config
from tests.conversion.gguf_files import tiny_model, write_gguf
from tests.evaluation.eval_models import EVAL_DATA, TOKENIZER


def export(gguf_path: Path, directory: Path) -> Path:
    """What a user would export by hand: transformers' GGUF model and tokenizer, as a plain checkpoint."""
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = loaded.config
    del config.quantization_config  # `save_pretrained` refuses a model loaded with a GGUF quantizer
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(directory)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(directory)
    return directory


def test_a_gguf_evaluates_as_its_export(tmp_path, capsys):
    gguf_path = write_gguf(tmp_path / "tiny.Q8_0.gguf", tiny_model(), "llama", "Q8_0")
    output = tmp_path / "eval.json"
    code = main([
        "eval", "--data", str(EVAL_DATA), "--no-progress", "--model", f"gguf={gguf_path}",
        "--model", f"export={export(gguf_path, tmp_path / 'export')}", "--lengths", "32,128", "--max-tokens", "160",
        "--passkey-trials", "2", "--output", str(output),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    models = json.loads(output.read_text())["models"]
    assert models["gguf"]["model_type"] == "llama" and models["gguf"]["tokens"] == models["export"]["tokens"] == 160
    for length in ("32", "128"):
        gguf_entry, export_entry = models["gguf"]["lengths"][length], models["export"]["lengths"][length]
        assert gguf_entry["ppl"] == pytest.approx(export_entry["ppl"], rel=1e-6)
        if gguf_entry["passkey"] is not None:  # the same verdicts; the likelihood to float32's rounding
            nll = pytest.approx(gguf_entry["passkey"]["nll"])
            assert gguf_entry["passkey"] == export_entry["passkey"] | {"nll": nll}
            pairs = zip(gguf_entry["passkey_trials"], export_entry["passkey_trials"], strict=True)
            assert all(a == b | {"nll": pytest.approx(a["nll"])} for a, b in pairs)
        else:
            assert export_entry["passkey"] is None


def test_an_unreadable_gguf_is_refused(tmp_path, capsys):
    gguf_path = tmp_path / "broken.gguf"
    gguf_path.write_bytes(b"GGUF" + bytes(100))
    code = main(["eval", "--data", str(EVAL_DATA), "--model", str(gguf_path), "--lengths", "32"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: --model {gguf_path}: {gguf_path} is not a readable GGUF file"), err


def test_loading_errors_are_each_commands_own(tmp_path):
    """`path_hf.loading` raises `SourceError`: `path-hf eval` turns it into an `EvaluationError` naming the option, the
    converter into a `ConversionError` (never the other command's type)."""
    gguf_path = tmp_path / "broken.gguf"
    gguf_path.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(SourceError, match="is not a readable GGUF file") as raised:
        load_config(str(gguf_path))
    assert not isinstance(raised.value, (ConversionError, EvaluationError))
    options = EvalOptions(models=[ModelSpec.parse(str(gguf_path))], data=[str(EVAL_DATA)], lengths=(32,))
    with pytest.raises(EvaluationError, match=f"--model {gguf_path}: {gguf_path} is not a readable GGUF file"):
        run_eval(options)
    with pytest.raises(ConversionError, match="is not a readable GGUF file"):
        convert(ConvertOptions(source=str(gguf_path), output=str(tmp_path / "out")))


@pytest.mark.parametrize("arch", ["phi3", "mixture-of-experts"])
def test_the_converters_limits_are_not_the_loaders(arch, tmp_path):
    """What the converter refuses of a GGUF (an architecture it does not convert, a mixture of experts) is its own
    check: `path_hf.loading` reads the header and leaves judging the model to the command (eval hands it to
    transformers)."""
    extra = {"llama.expert_count": 4} if arch == "mixture-of-experts" else None
    gguf_arch = "llama" if arch == "mixture-of-experts" else arch
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model(), gguf_arch, "F32", extra=extra, tokenizer=False)
    with pytest.raises(ConversionError, match="which path-hf cannot convert"):
        convert(ConvertOptions(source=str(gguf_path), output=str(tmp_path / "out"), dry_run=True))
    file = GGUFFile.read(gguf_path)  # the header reads: loading does not judge the architecture
    assert file.architecture == gguf_arch and file.experts == (4 if extra else 0)


def test_the_tokenizer_of_a_gguf(other_tokenizer, tmp_path, capsys):
    """A GGUF carries its tokenizer: --tokenizer must write the same ids (the one it was made from does), and a
    tokenizer of another model is refused, though its ids fit the embedding (it was evaluated, to a meaningless
    perplexity)."""
    gguf_path = write_gguf(tmp_path / "tiny.gguf", tiny_model(), "llama", "F32")
    command = ["eval", "--data", str(EVAL_DATA), "--no-progress", "--model", f"tiny={gguf_path}", "--lengths", "32,64"]
    command += ["--max-tokens", "64", "--passkey-trials", "0"]
    code = main([*command, "--output", str(tmp_path / "own.json")])
    assert code == 0, capsys.readouterr().err
    code = main([*command, "--tokenizer", str(TOKENIZER), "--output", str(tmp_path / "given.json")])
    assert code == 0, capsys.readouterr().err
    own, given = (json.loads((tmp_path / f"{name}.json").read_text())["models"]["tiny"] for name in ("own", "given"))
    assert given["tokenizer"] == str(TOKENIZER)
    assert [entry["ppl"] for entry in own["lengths"].values()] == [entry["ppl"] for entry in given["lengths"].values()]

    code = main([*command, "--tokenizer", str(other_tokenizer), "--output", str(tmp_path / "other.json")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and not (tmp_path / "other.json").exists()
    # 4097 tokens: transformers' tokenizer of the GGUF adds one to the 4096 of the tokenizer it was made from, and
    # writes the same ids (above)
    assert err.splitlines()[-1] == (
        f"error: --tokenizer {other_tokenizer} does not belong to --model {gguf_path}: on the first 4000 characters "
        "of --data it writes other token ids than the model's own tokenizer (300 tokens; the model's: 4097): leave "
        "out --tokenizer to use the model's own"
    )
