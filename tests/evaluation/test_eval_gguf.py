"""`path-hf eval --model FILE.gguf`: the GGUF evaluates as its export does (transformers' own GGUF model, saved as an
ordinary checkpoint), and an unreadable GGUF is refused on one line."""

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from path_hf.cli import main
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
        assert gguf_entry["passkey"] == export_entry["passkey"]


def test_an_unreadable_gguf_is_refused(tmp_path, capsys):
    gguf_path = tmp_path / "broken.gguf"
    gguf_path.write_bytes(b"GGUF" + bytes(100))
    code = main(["eval", "--data", str(EVAL_DATA), "--model", str(gguf_path), "--lengths", "32"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: --model {gguf_path}: {gguf_path} is not a readable GGUF file"), err


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
