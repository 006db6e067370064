# Copyright 2026 The path-hf authors. Apache-2.0.
"""`path-hf`: the command line of path-hf, one subcommand per task (`path-hf convert ...`). The `path-hf` launcher
(`path_hf_cli`, which imports neither torch nor transformers) answers `--help` and `--version` itself and hands each
command here."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence

from path_hf_cli import command_parser

from .arguments import add_arguments, from_arguments
from .commands.eval import run_eval
from .commands.serve import ServeOptions, run_serve
from .conversion.convert import convert
from .conversion.options import ConvertOptions
from .errors import CommandError, first_line
from .evaluation.options import EvalOptions
from .signals import sigterm_as_interrupt

INTERRUPTED = "interrupted; nothing was written"
OPTIONS = {"convert": ConvertOptions, "eval": EvalOptions, "serve": ServeOptions}


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser (`path_hf_cli.command_parser`: the commands, their help, `--version`) with each
    command's options."""
    parser, commands = command_parser()
    for name, options in OPTIONS.items():
        add_arguments(commands[name], options)
    return parser


def run_command(command: Callable[[], object], *, debug: bool = False, interrupted: str = INTERRUPTED) -> int:
    """Run `command()` as `path-hf` runs its commands; returns the exit code. A refused or failed command prints
    `error: <message>` on one line and returns 1 (`debug`: with the traceback); Ctrl-C or SIGTERM cleans up, prints
    `interrupted` and returns 130."""
    try:
        with sigterm_as_interrupt():
            command()
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except Exception as error:
        if debug:
            traceback.print_exc()
        message = first_line(error)
        if not isinstance(error, CommandError):
            if str(error).strip():
                message = f"{type(error).__name__}: {message}"
            message += "" if debug else " (rerun with --debug for the traceback)"
        print(f"error: {message}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `path-hf` with `argv` (default: `sys.argv[1:]`); returns the exit code (`run_command`'s)."""
    args = build_parser().parse_args(argv)
    if args.command == "convert":
        return run_command(lambda: convert(from_arguments(args, ConvertOptions)), debug=args.debug)
    if args.command == "eval":
        return run_command(lambda: run_eval(from_arguments(args, EvalOptions)), debug=args.debug)
    serve = from_arguments(args, ServeOptions)
    return run_command(lambda: run_serve(serve), debug=getattr(args, "debug", False), interrupted="stopped")


if __name__ == "__main__":
    sys.exit(main())
