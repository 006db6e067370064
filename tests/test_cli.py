# Copyright 2026 The path-hf authors. Apache-2.0.
"""The `path-hf` command line: its version, the launcher that answers `--help` without torch, and how an unexpected
error is reported (one line, its type, a hint)."""

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import path_hf_cli
from path_hf import cli

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"path-hf {version('path-hf')}"


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (
            ValueError("the first line\nand more"),
            "error: ValueError: the first line (rerun with --debug for the traceback)",
        ),
        (RuntimeError(), "error: RuntimeError (rerun with --debug for the traceback)"),
    ],
)
def test_an_unexpected_error_is_one_line_with_its_type(monkeypatch, capsys, error, shown):
    def fail(options):
        raise error

    monkeypatch.setattr(cli, "run_eval", fail)
    assert cli.main(["eval", "--model", "m", "--data", "d.txt", "--lengths", "64"]) == 1
    assert capsys.readouterr().err.strip() == shown


def run_launcher(*argv: str) -> subprocess.CompletedProcess:
    """`path-hf ARGV` as the console script runs it (`path_hf_cli.main`), in a fresh interpreter that then prints the
    modules of torch, transformers and path_hf it imported."""
    code = (
        "import sys, path_hf_cli\n"
        "try:\n    code = path_hf_cli.main(sys.argv[1:])\nexcept SystemExit as stop:\n    code = stop.code\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'path_hf'})\n"
        "print('IMPORTED', ','.join(heavy), 'EXIT', code)\n"
    )
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--version"], [], ["no-such-command"]])
def test_the_launcher_answers_without_torch_or_transformers(argv):
    done = run_launcher(*argv)
    assert done.stdout.strip().splitlines()[-1].startswith("IMPORTED  EXIT"), done.stdout + done.stderr
    if argv in (["--help"], ["-h"]):
        assert all(name in done.stdout for name in ("convert", "eval", "serve"))
    elif argv == ["--version"]:
        assert f"path-hf {version('path-hf')}" in done.stdout
    else:  # no command, or an unknown one: argparse's usage error, exit 2
        assert done.stdout.strip().endswith("EXIT 2") and "usage: path-hf" in done.stderr


def test_a_command_goes_to_the_full_command_line():
    done = run_launcher("convert", "--help")
    assert "--from" in done.stdout and "--force" in done.stdout  # convert's own options, added by path_hf.cli
    assert done.stdout.strip().splitlines()[-1] == "IMPORTED path_hf,torch,transformers EXIT 0"
    # the commands' help lines are the launcher's: one table for `path-hf --help` and the full parser
    assert cli.build_parser().format_help() == path_hf_cli.command_parser()[0].format_help()
