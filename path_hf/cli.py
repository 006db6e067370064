# Copyright 2026 The path-hf authors. Apache-2.0.
"""`path-hf`: the command line of path-hf, one subcommand per task (`path-hf convert ...`)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import version

from .arguments import add_arguments, from_arguments
from .commands.eval import run_eval
from .commands.serve import ServeOptions, run_serve
from .conversion.convert import convert
from .conversion.options import ConvertOptions
from .errors import CommandError, first_line
from .evaluation.options import EvalOptions

INTERRUPTED = "interrupted; nothing was written"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="path-hf", description="PaTH attention for Hugging Face Transformers.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('path-hf')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    convert_parser = commands.add_parser(
        "convert",
        help="convert a RoPE Llama / Qwen2 / Qwen3 / Mistral checkpoint into a PaTH checkpoint",
        description="Convert a RoPE Llama, Qwen2, Qwen3 or Mistral checkpoint into a PaTHLlama checkpoint that "
        "loads with from_pretrained, streaming it shard by shard. The output appears atomically at DST.",
    )
    add_arguments(convert_parser, ConvertOptions)
    eval_parser = commands.add_parser(
        "eval",
        help="perplexity, passkey and copy retrieval at several context lengths, for one or more causal LMs",
        description="Evaluate causal LMs (Llama, Qwen, PaTHLlama, ...; optionally with YaRN / dynamic NTK RoPE "
        "scaling) at several context lengths: perplexity on held-out text and passkey and copy retrieval. Prints a "
        "table; writes JSON and a plot on request.",
    )
    add_arguments(eval_parser, EvalOptions)
    serve_parser = commands.add_parser(
        "serve",
        help="an OpenAI-compatible server (chat completions, completions) for a PaTH model",
        description="Serve a PaTH checkpoint with transformers' own server (`transformers serve`): /v1/models, "
        "/v1/chat/completions and /v1/completions, streaming or not, the model loaded with path_hf's classes.",
    )
    add_arguments(serve_parser, ServeOptions)
    return parser


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM (what `kill`, `timeout` and job schedulers send) raises `KeyboardInterrupt` as
    Ctrl-C does, so that the same cleanups run; a second SIGTERM during them is ignored. The previous handler is
    restored on exit. Only the main thread receives signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


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
