# Copyright 2026 The path-hf authors. Apache-2.0.
"""The `path-hf` launcher. Importing the `path_hf` package registers its models with transformers' Auto classes, which
imports torch and transformers (seconds of CPU); this module imports neither, so that `path-hf`, `path-hf --help` and
`path-hf --version` answer at once. Every command goes to `path_hf.cli`, which builds its full parser."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import version

PROGRAM = "path-hf"
DESCRIPTION = "PaTH attention for Hugging Face Transformers."
# Each command's one-line help (in `path-hf --help`) and description (in `path-hf COMMAND --help`).
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": (
        "convert a RoPE Llama / Qwen2 / Qwen3 / Mistral checkpoint into a PaTH checkpoint",
        "Convert a RoPE Llama, Qwen2, Qwen3 or Mistral checkpoint into a PaTHLlama checkpoint that loads with "
        "from_pretrained, streaming it shard by shard. The output appears atomically at DST.",
    ),
    "eval": (
        "perplexity, passkey and copy retrieval at several context lengths, for one or more causal LMs",
        "Evaluate causal LMs (Llama, Qwen, PaTHLlama, ...; optionally with YaRN / dynamic NTK RoPE scaling) at "
        "several context lengths: perplexity on held-out text and passkey and copy retrieval. Prints a table; writes "
        "JSON and a plot on request.",
    ),
    "serve": (
        "an OpenAI-compatible server (chat completions, completions) for a PaTH model",
        "Serve a PaTH checkpoint with transformers' own server (`transformers serve`): /v1/models, "
        "/v1/chat/completions and /v1/completions, streaming or not, the model loaded with path_hf's classes.",
    ),
}


def command_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser (`--version` and a sub-parser per command, without the commands' options) and the
    sub-parsers by command, to which `path_hf.cli` adds each command's options."""
    parser = argparse.ArgumentParser(prog=PROGRAM, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('path-hf')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, {
        name: commands.add_parser(name, help=help, description=description)
        for name, (help, description) in COMMANDS.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    """`path-hf`: without a command (`--help`, `--version`, nothing, or an unknown one) argparse answers here; a
    command runs in `path_hf.cli` (whose `main` returns the exit code)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        command_parser()[0].parse_args(argv)  # prints the help, the version or the error, and exits
        return 2
    from path_hf.cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
