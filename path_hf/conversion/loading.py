# Copyright 2026 The path-hf authors. Apache-2.0.
"""Load a causal LM, its tokenizer or its config from any source path-hf reads: a checkpoint directory or hub id
(`from_pretrained`), or a llama.cpp GGUF file, or a directory holding one (read by transformers, dequantised whole
to the dtype asked for: `conversion.gguf`). `path-hf eval` and the recipes load their models through here.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from .gguf import GGUFFile, find_gguf, gguf_config, gguf_tokenizer, load_gguf_model


def load_config(source: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of `source`. Raises `OSError` / `ValueError` as `from_pretrained` does, `ConversionError` for a
    GGUF that cannot be read."""
    if (gguf_path := find_gguf(source)) is not None:
        return gguf_config(GGUFFile.read(gguf_path))
    return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)


def load_tokenizer(source: str, trust_remote_code: bool = False):
    """The tokenizer of `source` (of a GGUF: built by transformers from its metadata, chat template included)."""
    if (gguf_path := find_gguf(source)) is not None:
        return gguf_tokenizer(GGUFFile.read(gguf_path))
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)


def load_causal_lm(source: str, dtype: torch.dtype | str, trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM of `source` at `dtype` (`"auto"`: a checkpoint's own dtype); a GGUF becomes a plain model of its
    architecture (the whole model dequantised in memory at `dtype`, a torch dtype), the model `path-hf convert`
    converts from."""
    if (gguf_path := find_gguf(source)) is not None:
        return load_gguf_model(GGUFFile.read(gguf_path), dtype)
    return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)


__all__ = ["load_causal_lm", "load_config", "load_tokenizer"]
