# Copyright 2026 The path-hf authors. Apache-2.0.
"""Checkpoint surgery for path-hf: `path-hf convert` turns a RoPE Llama / Qwen2 / Qwen3 / Mistral checkpoint into a
PaTHLlama checkpoint, shard by shard, without building the model. `convert.convert` runs a conversion (the command
line, `path_hf.cli`, parses its flags); models are loaded through `path_hf.loading`. The guide is conversion/README.md
at the top of the repository."""

from ..errors import ConversionError
from .options import ConvertOptions

__all__ = ["ConversionError", "ConvertOptions"]
