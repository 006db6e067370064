# Copyright 2026 The path-hf authors. Apache-2.0.
"""The `path-hf` command line: its version, and how an unexpected error is reported (one line, its type, a hint)."""

from importlib.metadata import version

import pytest

from path_hf import cli


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
