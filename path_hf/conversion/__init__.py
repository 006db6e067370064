# Copyright 2026 The path-hf authors. Apache-2.0.
"""Checkpoint surgery for path-hf: `path-hf convert` turns a RoPE Llama / Qwen2 / Qwen3 / Mistral checkpoint into a
PaTHLlama checkpoint, shard by shard, without building the model (`conversion.convert`); `path-hf eval` measures
perplexity and passkey retrieval against context length (`path_hf.evaluation.command`)."""

from ..errors import ConversionError
from .options import ConvertOptions

__all__ = ["ConversionError", "ConvertOptions"]
