# Copyright 2026 The path-hf authors. Apache-2.0.
"""GGUF sources of `path-hf convert`: a llama.cpp GGUF file, read by transformers (`path_hf.loading`), materialised
as an ordinary checkpoint.

`path-hf convert` writes what transformers reads (`config.json`, `model.safetensors`, the tokenizer files,
`generation_config.json`) into a temporary directory beside the destination and converts from it like from any
checkpoint, so `--verify` compares against it unchanged. The file is first checked against what path-hf converts
(`check_convertible`): `path-hf eval` and the recipes load any GGUF transformers reads, the converter only the
architectures of `conversion.architectures`.

A GGUF is dequantised whole: the whole model is held in memory at the target dtype while it is materialised.
"""

from __future__ import annotations

import math
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import torch
from transformers import GenerationConfig, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
from transformers.utils import SAFE_WEIGHTS_NAME

from ..errors import ConversionError
from ..loading import (
    DEFAULT_GGUF_DTYPE,
    GGUFFile,
    gguf_config,
    gguf_state_dict,
    gguf_tokenizer,
    model_class,
    named_gguf,
    parameter_names,
)
from .architectures import ARCHITECTURES
from .io import SafetensorsWriter, SourceTensor, SourceWeights, TensorMeta
from .options import ConvertOptions
from .sources import GGUFCheckpoint, Source, follow_links, links_outside
from .staging import check_disk_space, check_overlap, destination_lock, staging_directory

# GGUF architectures transformers reads (config and tensor names) whose models path-hf converts. llama.cpp stores
# Mistral models as "llama"; gguf-py knows no "mistral" architecture, so transformers cannot map one's tensors.
SUPPORTED_ARCHITECTURES = tuple(
    arch.model_type
    for arch in ARCHITECTURES.values()
    if arch.model_type in GGUF_SUPPORTED_ARCHITECTURES and arch.model_type in gguf.MODEL_ARCH_NAMES.values()
)
# GGUF tensors that transformers' reader leaves out on purpose: Llama 3's RoPE frequency factors.
_DROPPED_TENSORS = {"rope_freqs.weight": "Llama 3 RoPE scaling factors, which transformers' GGUF reader ignores"}


def check_convertible(file: GGUFFile) -> None:
    """Refuse a GGUF whose model path-hf does not convert: another architecture, or a mixture of experts."""
    if file.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            f"{file.path.name} is a GGUF of architecture {file.architecture!r}, which path-hf cannot convert; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (llama.cpp stores Mistral models as llama)."
        )
    if file.experts:
        raise ConversionError(f"{file.path.name} is a mixture-of-experts model, which path-hf cannot convert.")


def weight_metas(file: GGUFFile, config: PretrainedConfig, dtype: torch.dtype) -> list[TensorMeta]:
    """The tensors transformers will read from `file`, named as in the model, at `dtype`, in file order: known from
    the header alone. Refuses a tensor the model has no place for (it would be dropped silently)."""
    model_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == file.architecture)
    to_gguf = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    from_gguf = {}
    for name in parameter_names(config):
        if (gguf_name := to_gguf.get_name(name, try_suffixes=(".weight", ".bias"))) is not None:
            from_gguf[gguf_name] = name
    metas = []
    for name, _, shape in file.tensors:
        if name in _DROPPED_TENSORS:
            print(f"warning: {file.path.name}: {name} left out ({_DROPPED_TENSORS[name]})", file=sys.stderr)
        elif name not in from_gguf:
            raise ConversionError(
                f"{file.path.name}: tensor {name!r} has no place in a transformers {config.model_type} model; "
                "path-hf cannot convert this file."
            )
        else:
            metas.append(TensorMeta(from_gguf[name], dtype, shape))
    return metas


def materialise(file: GGUFFile, directory: Path, dtype: torch.dtype, *, weights: bool = True) -> GGUFCheckpoint:
    """Write `file` into the empty `directory` as a transformers checkpoint: `config.json`, `generation_config.json`,
    the tokenizer files and, if `weights`, `model.safetensors` at `dtype` (the whole model dequantised in memory)."""
    config = gguf_config(file)
    config.dtype = dtype
    config.architectures = [model_class(config).__name__]
    metas = weight_metas(file, config, dtype)
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    if file.has_tokenizer:
        gguf_tokenizer(file).save_pretrained(directory)
    if not weights:  # what the plan reads of `model.safetensors`: names, dtypes and shapes
        weights_file = directory / SAFE_WEIGHTS_NAME
        planned = tuple(SourceTensor(meta.name, meta.dtype, meta.shape, weights_file, None) for meta in metas)
        return _checkpoint(file, directory, dtype, SourceWeights("safetensors", (weights_file,), planned))
    state_dict = gguf_state_dict(file, config, dtype)
    read = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in state_dict.items()}
    if read != {meta.name: (meta.dtype, meta.shape) for meta in metas}:
        differ = sorted(set(read.items()) ^ {(meta.name, (meta.dtype, meta.shape)) for meta in metas})
        raise ConversionError(f"transformers read {file.path.name} differently from its header, e.g. {differ[0]}.")
    with SafetensorsWriter(directory / SAFE_WEIGHTS_NAME, metas) as writer:
        for meta in metas:
            writer.write_tensor(meta, state_dict.pop(meta.name))  # freed as it is written
    return _checkpoint(file, directory, dtype, SourceWeights.from_directory(directory))


def _checkpoint(file: GGUFFile, directory: Path, dtype: torch.dtype, weights: SourceWeights) -> GGUFCheckpoint:
    return GGUFCheckpoint(file.path, file.describe(), file.record(), directory, dtype, weights)


@contextmanager
def gguf_source(options: ConvertOptions) -> Iterator[Source | None]:
    """The source of a conversion whose `--from` (and `--gguf-file`) name a GGUF: the file checked, then materialised
    in a temporary directory beside the destination (only planned with `--dry-run`), which is removed on exit
    whatever happens. None when the source is a checkpoint directory or a hub id."""
    named = named_gguf(options.source, options.gguf_file)
    if named is None:
        yield None
        return
    path = named.resolve()
    if options.revision is not None:
        raise ConversionError(f"--revision applies to hub ids, but {path} is a local GGUF file.")
    output = Path(options.output).expanduser().resolve()
    check_overlap(output, path)  # `convert` checked the destination; a link may put the file elsewhere
    if (directory := Path(options.source).expanduser()).is_dir():  # a file SRC itself is followed: the user named it
        directory = directory.resolve()
        links = links_outside(directory, [directory / named.relative_to(Path(options.source).expanduser())])
        follow_links(directory, links, options.follow_symlinks)
    file = GGUFFile.read(path)
    check_convertible(file)
    dtype = getattr(torch, options.dtype) if options.dtype else DEFAULT_GGUF_DTYPE
    weight_bytes = sum(math.prod(shape) for _, _, shape in file.tensors) * dtype.itemsize
    with destination_lock(output):  # held already when `convert` runs this
        # The materialised checkpoint, and an output of about its size (checked exactly once the conversion is planned).
        check_disk_space(output, 2 * weight_bytes)
        directory = staging_directory(output, "gguf")
        directory.mkdir()
        try:
            checkpoint = materialise(file, directory, dtype, weights=not options.dry_run)
            yield Source(directory, gguf=checkpoint)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "check_convertible",
    "gguf_source",
    "materialise",
    "weight_metas",
]
