# Copyright 2026 The path-hf authors. Apache-2.0.
"""Checkpoint surgery for path-hf: `path-hf convert` turns a RoPE Llama / Qwen2 / Qwen3 / Mistral checkpoint into a
PaTHLlama checkpoint, shard by shard, without building the model. The command itself is `path_hf.commands.convert`;
models are loaded through `path_hf.loading`."""

from ..errors import ConversionError
from .options import ConvertOptions

__all__ = ["ConversionError", "ConvertOptions"]
