# Copyright 2026 The path-hf authors. Apache-2.0.
"""What `path-hf convert` does, as a script over the library, as recipes/train.py is to the recipes: the same flags
(`ConvertOptions`), the same conversion (`path_hf.conversion.convert.convert`), the same messages and exit codes.

python conversion/convert.py --from SRC --to DST [options]   # every option: conversion/README.md, or --help
"""

import argparse
import sys
import traceback

from path_hf.arguments import add_arguments, from_arguments
from path_hf.cli import sigterm_as_interrupt
from path_hf.conversion.convert import convert
from path_hf.conversion.options import ConvertOptions
from path_hf.errors import CommandError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert a RoPE Llama, Qwen2, Qwen3 or Mistral checkpoint into a PaTHLlama checkpoint that loads "
        "with from_pretrained, streaming it shard by shard. The output appears atomically at DST."
    )
    add_arguments(parser, ConvertOptions)
    args = parser.parse_args(argv)
    try:
        with sigterm_as_interrupt():  # Ctrl-C or SIGTERM: the staging directories are removed
            convert(from_arguments(args, ConvertOptions))
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception as error:  # one line, as `path-hf` prints it; --debug adds the traceback
        if args.debug:
            traceback.print_exc()
        lines = str(error).strip().splitlines()
        message = lines[0] if lines else ""
        if not isinstance(error, CommandError):
            message = f"{type(error).__name__}: {message}" + (
                "" if args.debug else " (rerun with --debug for the traceback)"
            )
        print(f"error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
