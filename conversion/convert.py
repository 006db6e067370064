# Copyright 2026 The path-hf authors. Apache-2.0.
"""What `path-hf convert` does, as a script over the library, as recipes/train.py is to the recipes: the same flags
(`ConvertOptions`), the same conversion (`path_hf.conversion.convert.convert`), the same messages and exit codes.

python conversion/convert.py --from SRC --to DST [options]   # every option: conversion/README.md, or --help
"""

import argparse
import sys

from path_hf.arguments import add_arguments, from_arguments
from path_hf.cli import run_command
from path_hf.conversion.convert import convert
from path_hf.conversion.options import ConvertOptions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert a RoPE Llama, Qwen2, Qwen3 or Mistral checkpoint into a PaTHLlama checkpoint that loads "
        "with from_pretrained, streaming it shard by shard. The output appears atomically at DST."
    )
    add_arguments(parser, ConvertOptions)
    args = parser.parse_args(argv)
    # one-line errors and exit codes as `path-hf` gives them; Ctrl-C or SIGTERM removes the staging directories
    return run_command(lambda: convert(from_arguments(args, ConvertOptions)), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
