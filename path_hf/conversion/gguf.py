# Copyright 2026 The path-hf authors. Apache-2.0.
"""GGUF sources: a llama.cpp GGUF file read with transformers' own GGUF support, as an ordinary checkpoint.

transformers reads the file (through the `gguf` package): it builds the config and the tokenizer from the metadata,
maps llama.cpp's tensor names to its own, undoes llama.cpp's Q/K row permutation and dequantises every tensor.
Nothing here dequantises or renames. `path-hf convert` materialises the result as a safetensors checkpoint
(`config.json`, `model.safetensors`, the tokenizer files, `generation_config.json`) in a temporary directory beside
the destination and converts from it like from any checkpoint, so `--verify` compares against it unchanged;
`load_causal_lm`, `load_tokenizer` and `load_config` (`conversion.loading`) build the same model in memory for
`path-hf eval` and the recipes.

A GGUF is dequantised whole: the whole model is held in memory at the target dtype while it is materialised or
loaded (float32 by default: a quantised type has no torch dtype).
"""

from __future__ import annotations

import copy
import importlib.metadata
import math
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import gguf
import numpy as np
import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

from ..errors import ConversionError
from .architectures import ARCHITECTURES
from .io import SafetensorsWriter, SourceTensor, SourceWeights, TensorMeta
from .options import ConvertOptions
from .sources import GGUFCheckpoint, Source, follow_links, links_outside
from .staging import check_destination, check_disk_space, destination_lock, staging_directory

GGUF_SUFFIX = ".gguf"
# GGUF architectures transformers reads (config and tensor names) whose models path-hf converts. llama.cpp stores
# Mistral models as "llama"; gguf-py knows no "mistral" architecture, so transformers cannot map one's tensors.
SUPPORTED_ARCHITECTURES = tuple(
    arch.model_type
    for arch in ARCHITECTURES.values()
    if arch.model_type in GGUF_SUPPORTED_ARCHITECTURES and arch.model_type in gguf.MODEL_ARCH_NAMES.values()
)
# GGUF tensors that transformers' reader leaves out on purpose: Llama 3's RoPE frequency factors.
_DROPPED_TENSORS = {"rope_freqs.weight": "Llama 3 RoPE scaling factors, which transformers' GGUF reader ignores"}
DEFAULT_DTYPE = torch.float32


def find_gguf(source: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file that `--from SRC [--gguf-file NAME]` names (resolved), or None when SRC is a checkpoint directory
    or a hub id. SRC is a `.gguf` file, or a directory holding `NAME` (or, without `config.json`, holding one GGUF
    file)."""
    found = _named_gguf(source, gguf_file)
    return None if found is None else found.resolve()


def _named_gguf(source: str, gguf_file: str | None) -> Path | None:
    """`find_gguf`, as named in SRC: a link in the directory SRC is not followed."""
    path = Path(source).expanduser()
    require_local_or_hub_id(source)
    if gguf_file is not None:
        if not path.is_dir():
            raise ConversionError(
                f"--gguf-file names a file in the directory SRC, but {source} is not a directory; pass a single GGUF "
                "file itself as SRC."
            )
        if not (path / gguf_file).is_file():
            found = _gguf_files(path)
            holds = f"it holds {', '.join(found)}" if found else "it holds no GGUF file"
            raise ConversionError(f"--gguf-file {gguf_file}: no such file in {path} ({holds}).")
        return path / gguf_file
    if path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return path
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        found = _gguf_files(path)
        if len(found) > 1:
            raise ConversionError(
                f"{path} holds {len(found)} GGUF files ({', '.join(found)}); choose one with --gguf-file NAME (or "
                "pass the file's own path)."
            )
        if found:
            return path / found[0]
    return None


def require_local_or_hub_id(source: str) -> None:
    """Refuse a source that is neither an existing path nor shaped like a hub id (`name` or `org/name`): such a
    string is a mistyped or missing path, which `from_pretrained` would report as a malformed repo id. A missing
    `name.gguf` is a missing file too."""
    if Path(source).expanduser().exists():
        return
    try:
        validate_repo_id(source)
    except HFValidationError:
        shaped_like_hub_id = False
    else:
        shaped_like_hub_id = Path(source).suffix.lower() not in {GGUF_SUFFIX, ".safetensors", ".bin"}
    if not shaped_like_hub_id:
        raise ConversionError(
            f"{source}: no such file or directory (a local path that does not exist; a hub id has the form 'name' or "
            "'org/name')."
        )


def _gguf_files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.suffix.lower() == GGUF_SUFFIX and path.is_file())


@cache
def _dequantisable(kind: gguf.GGMLQuantizationType) -> bool:
    """Whether gguf-py (which transformers dequantises with) can dequantise `kind`: tried on one block of zeros."""
    _, type_size = gguf.GGML_QUANT_SIZES[kind]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file whose header has been read and checked: a model path-hf converts, every tensor in a type gguf-py
    dequantises, none cut short."""

    path: Path
    architecture: str
    # GGUF name, ggml type and torch shape of every tensor, in file order
    tensors: tuple[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...]], ...]
    file_type: str | None  # general.file_type, e.g. MOSTLY_Q4_1
    has_tokenizer: bool

    @classmethod
    def read(cls, path: Path) -> GGUFFile:
        """Read the header (metadata and tensor table, no tensor data); `ConversionError` for a truncated or corrupt
        file, an architecture path-hf does not convert, or a tensor type gguf-py cannot dequantise. Remembered while
        the file is unchanged (gguf-py takes seconds to parse a vocabulary)."""
        stat = path.stat()
        return cls._read(path.resolve(), stat.st_mtime_ns, stat.st_size)

    @classmethod
    @lru_cache(maxsize=4)
    def _read(cls, path: Path, mtime_ns: int, size: int) -> GGUFFile:
        try:
            reader = gguf.GGUFReader(path)  # checks that every tensor's bytes lie inside the file
        except Exception as error:  # a damaged file raises anything from numpy, struct or the enums
            raise ConversionError(
                f"{path} is not a readable GGUF file: it is truncated or corrupt ({error}); download or export it "
                "again."
            ) from error
        architecture = _field(reader, "general.architecture")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ConversionError(
                f"{path.name} is a GGUF of architecture {architecture!r}, which path-hf cannot convert; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (llama.cpp stores Mistral models as llama)."
            )
        if _field(reader, f"{architecture}.expert_count"):
            raise ConversionError(f"{path.name} is a mixture-of-experts model, which path-hf cannot convert.")
        tensors = []
        for tensor in reader.tensors:
            if not _dequantisable(tensor.tensor_type):
                version = importlib.metadata.version("gguf")
                raise ConversionError(
                    f"{path.name}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which gguf {version} "
                    "cannot dequantise; quantise the model to another type (F16, Q8_0, Q4_K, ...) with llama.cpp."
                )
            tensors.append((tensor.name, tensor.tensor_type, tuple(int(n) for n in reversed(tensor.shape))))
        file_type = _field(reader, "general.file_type")
        return cls(
            path=path,
            architecture=architecture,
            tensors=tuple(tensors),
            file_type=next((kind.name for kind in gguf.LlamaFileType if kind.value == file_type), None),
            has_tokenizer=_field(reader, "tokenizer.ggml.model") is not None,
        )

    @property
    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each ggml type, most common first: `{"Q4_1": 210, "F32": 61, "Q8_0": 1}`."""
        return dict(Counter(kind.name for _, kind, _ in self.tensors).most_common())

    def describe(self) -> str:
        types = ", ".join(f"{count} {kind}" for kind, count in self.tensor_types.items())
        return f"GGUF {self.architecture}, tensors {types}"

    def record(self) -> dict:
        """What `path_conversion` records of the file (besides its path)."""
        return {"file_type": self.file_type, "tensor_types": self.tensor_types}


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _transformers_error(path: Path, error: Exception) -> ConversionError:
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ConversionError(f"transformers cannot read {path.name}: {first_line}")


def gguf_config(file: GGUFFile) -> PretrainedConfig:
    """The model's config as transformers builds it from the metadata (no `quantization_config`): a new object at
    each call, read once while the file is unchanged."""
    stat = file.path.stat()
    return copy.deepcopy(_config(file.path, stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=4)
def _config(path: Path, mtime_ns: int, size: int) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise _transformers_error(path, error) from error


def gguf_tokenizer(file: GGUFFile):
    """The tokenizer (and chat template) as transformers builds it from the metadata."""
    if not file.has_tokenizer:
        raise ConversionError(f"{file.path.name} holds no tokenizer (no tokenizer.ggml.model in its metadata).")
    try:
        return AutoTokenizer.from_pretrained(file.path.parent, gguf_file=file.path.name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise _transformers_error(file.path, error) from error


class _ParameterNames(nn.Module):
    """What transformers' GGUF name mapping reads of the model it maps names for: its config and the names in its
    state dict. The model itself (on the meta device) would do as well, but the mapping rebuilds gguf-py's name
    table for each of the model's submodules (~30 s of CPU for SmolLM2's ~400), while the top level maps every
    name already."""

    def __init__(self, config: PretrainedConfig, names: list[str]):
        super().__init__()
        self.config = config
        self.names = names

    def state_dict(self, *args, **kwargs) -> dict:
        return dict.fromkeys(self.names)


def _model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    with torch.device("meta"):
        return type(AutoModelForCausalLM.from_config(config))


def _parameter_names(config: PretrainedConfig) -> list[str]:
    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(config).state_dict())


def weight_metas(file: GGUFFile, config: PretrainedConfig, dtype: torch.dtype) -> list[TensorMeta]:
    """The tensors transformers will read from `file`, named as in the model, at `dtype`, in file order: known from
    the header alone. Refuses a tensor the model has no place for (it would be dropped silently)."""
    model_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == file.architecture)
    to_gguf = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    from_gguf = {}
    for name in _parameter_names(config):
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


def gguf_state_dict(file: GGUFFile, config: PretrainedConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the model, dequantised by transformers to `dtype`: the whole model in memory."""
    names = _ParameterNames(config, _parameter_names(config))
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"reading {file.path.name} ({file.describe()}): dequantising to {dtype_name}", flush=True)
    try:
        return load_gguf_checkpoint(str(file.path), return_tensors=True, model_to_load=names, torch_dtype=dtype)[
            "tensors"
        ]
    except (ValueError, KeyError, NotImplementedError) as error:
        raise _transformers_error(file.path, error) from error


def load_gguf_model(file: GGUFFile, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of `file` in memory, as transformers reads it, as a plain (unquantised) model at `dtype`."""
    config = gguf_config(file)
    state_dict = gguf_state_dict(file, config, dtype)
    return _model_class(config).from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)


def materialise(file: GGUFFile, directory: Path, dtype: torch.dtype, *, weights: bool = True) -> GGUFCheckpoint:
    """Write `file` into the empty `directory` as a transformers checkpoint: `config.json`, `generation_config.json`,
    the tokenizer files and, if `weights`, `model.safetensors` at `dtype` (the whole model dequantised in memory)."""
    config = gguf_config(file)
    config.dtype = dtype
    config.architectures = [_model_class(config).__name__]
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
    named = _named_gguf(options.source, options.gguf_file)
    if named is None:
        yield None
        return
    path = named.resolve()
    if options.revision is not None:
        raise ConversionError(f"--revision applies to hub ids, but {path} is a local GGUF file.")
    output = Path(options.output).expanduser().resolve()
    check_destination(output, options.force, path)
    if (directory := Path(options.source).expanduser()).is_dir():  # a file SRC itself is followed: the user named it
        directory = directory.resolve()
        links = links_outside(directory, [directory / named.relative_to(Path(options.source).expanduser())])
        follow_links(directory, links, options.follow_symlinks)
    file = GGUFFile.read(path)
    dtype = getattr(torch, options.dtype) if options.dtype else DEFAULT_DTYPE
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
    "DEFAULT_DTYPE",
    "GGUFFile",
    "SUPPORTED_ARCHITECTURES",
    "find_gguf",
    "require_local_or_hub_id",
    "gguf_config",
    "gguf_source",
    "gguf_state_dict",
    "gguf_tokenizer",
    "load_gguf_model",
    "materialise",
    "weight_metas",
]
