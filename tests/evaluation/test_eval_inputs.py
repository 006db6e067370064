"""What `path-hf eval` refuses to score, and the inputs it reads: empty data, a data directory, `PATH@ROPE` specs."""

import json
import re
import shutil

import pytest
from eval_models import EVAL_DATA

from conversion.cli import main
from conversion.evaluate import ModelSpec
from path_hf.evaluation import data_files, read_texts


def run_eval(capsys, *args) -> tuple[int, str]:
    """`path-hf eval` at lengths 32 and 64 without passkey; returns the exit code and stderr."""
    command = ["eval", "--lengths", "32,64", "--max-tokens", "64", "--passkey-trials", "0", "--no-progress"]
    code = main([*command, *map(str, args)])
    return code, capsys.readouterr().err


def refused(capsys, *args, output) -> str:
    """The one-line error of a refused `path-hf eval` (after any progress bars of `datasets`), which wrote nothing."""
    code, err = run_eval(capsys, *args, "--output", output)
    last = err.splitlines()[-1]
    assert code == 1 and last.startswith("error: ") and "Traceback" not in err, err
    assert not output.exists()
    return last


# Data


@pytest.mark.parametrize(
    "name, content",
    [
        ("empty.jsonl", b""),
        ("empty.txt", b""),
        ("empty.parquet", b""),
        ("blank.jsonl", b"\n  \n"),
        ("whitespace-documents.jsonl", b'{"text": "  "}\n{"text": "\\n\\t"}\n'),
        ("whitespace-documents.txt", b"  \n\n \t\n\n"),
    ],
)
def test_data_without_documents(name, content, checkpoints, tmp_path, capsys):
    data = tmp_path / name
    data.write_bytes(content)
    err = refused(capsys, "--model", checkpoints["llama"], "--data", data, output=tmp_path / "eval.json")
    assert err == f"error: --data {data}: no non-empty documents"


def test_blank_files_are_skipped(tmp_path):
    """The recipes read their data through the same function: an empty file among others adds no documents."""
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert read_texts([tmp_path / "empty.jsonl", EVAL_DATA]) == read_texts([EVAL_DATA])


def test_a_data_directory(checkpoints, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("b.jsonl", "a.jsonl.xz", ".hidden.jsonl", "notes.md"):
        shutil.copy(EVAL_DATA, folder / name)
    (folder / "b.jsonl").write_text(json.dumps({"text": "The last document."}) + "\n")
    (folder / "nested.jsonl").mkdir()
    assert data_files([folder]) == ("json", {"data_files": [str(folder / "a.jsonl.xz"), str(folder / "b.jsonl")]})
    assert read_texts([folder]) == [*read_texts([EVAL_DATA]), "The last document."]

    output = tmp_path / "eval.json"
    code, err = run_eval(capsys, "--model", checkpoints["llama"], "--data", folder, "--output", output)
    assert code == 0, err
    assert json.loads(output.read_text())["models"]["llama"]["tokens"] == 64

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.md").write_text("no data here")
    err = refused(capsys, "--model", checkpoints["llama"], "--data", empty, output=output.with_name("none.json"))
    assert f"--data: {empty} is a directory with no data files (looked for *.txt, *.jsonl, *.json, *.parquet" in err


# PATH@ROPE


def test_rope_suffixes(tmp_path, monkeypatch):
    assert ModelSpec.parse("a/b@YARN:2") == ModelSpec("b+yarn", "a/b", "yarn", 2.0)  # the type in any case
    assert ModelSpec.parse("L=runs/lr=1e-3/final@Dynamic") == ModelSpec("L", "runs/lr=1e-3/final", "dynamic")
    for spec, message in [
        ("a/b@longrope", "unknown RoPE scaling 'longrope' (choices: linear, dynamic, yarn, then optionally :FACTOR)"),
        ("a/b@yarn:abc", "the RoPE scaling factor must be a number of at least 1, got 'abc'"),
        ("a/b@yarn:", "the RoPE scaling factor must be a number of at least 1, got ''"),
        ("a/b@linear:inf", "the RoPE scaling factor must be a number of at least 1, got 'inf'"),
        ("a/b@yarn:0.5", "the RoPE scaling factor must be a number of at least 1, got '0.5'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"--model '{spec}': {message}")):
            ModelSpec.parse(spec)
    # A path that exists is taken whole, '@' and all; a scaling may follow it.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt@v2").mkdir()
    assert ModelSpec.parse("ckpt@v2") == ModelSpec("ckpt@v2", "ckpt@v2")
    assert ModelSpec.parse("ckpt@v2@yarn") == ModelSpec("ckpt@v2+yarn", "ckpt@v2", "yarn")
    assert ModelSpec.parse("x@y/ckpt") == ModelSpec("ckpt", "x@y/ckpt")  # '@' before the last '/': never a scaling


def test_a_directory_with_at_in_its_name_evaluates(checkpoints, tmp_path, capsys):
    (tmp_path / "llama@v2").symlink_to(checkpoints["llama"], target_is_directory=True)
    output = tmp_path / "eval.json"
    code, err = run_eval(capsys, "--model", tmp_path / "llama@v2", "--data", EVAL_DATA, "--output", output)
    assert code == 0, err
    assert list(json.loads(output.read_text())["models"]) == ["llama@v2"]
    with pytest.raises(SystemExit):  # argparse's refusal (exit code 2), naming the choices
        run_eval(capsys, "--model", f"{checkpoints['llama']}@longrope", "--data", EVAL_DATA)
    assert (
        "unknown RoPE scaling 'longrope' (choices: linear, dynamic, yarn, then optionally :FACTOR)"
        in capsys.readouterr().err
    )
