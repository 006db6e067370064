# Copyright 2026 The path-hf authors. Apache-2.0.
"""Load a causal LM, its tokenizer or its config from any source path-hf reads: a checkpoint directory or hub id
(`from_pretrained`), or a llama.cpp GGUF file, or a directory holding one.

A GGUF is read with transformers' own GGUF support (through the `gguf` package): transformers builds the config and
the tokenizer from the metadata, maps llama.cpp's tensor names to its own, undoes llama.cpp's Q/K row permutation and
dequantises every tensor; nothing here dequantises or renames. The whole model is held in memory at the dtype asked
for (float32 by default: a quantised type has no torch dtype).

The lowest layer of the commands: `path-hf convert` (`conversion.gguf` materialises a GGUF as a checkpoint from what
is read here), `path-hf eval` and the recipes load through it, and it imports none of them. What cannot be found or
read raises `SourceError`; each command re-raises it as its own error type.
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections import Counter
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import gguf
import numpy as np
import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.utils import CONFIG_NAME

from .errors import SourceError, first_line

# A saved tokenizer leaves at least one of these in its directory. Without any, transformers builds an empty tokenizer
# of the config's model type, which turns text into unknown tokens (BERT) or into almost nothing (GPT-2).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
GGUF_SUFFIX = ".gguf"
_NAMED_KEYS = 3  # missing weights named in a refusal
DEFAULT_GGUF_DTYPE = torch.float32


def load_config(source: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of `source`. Raises `OSError` / `ValueError` as `from_pretrained` does, `SourceError` for a
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
    converts from. A checkpoint that lacks weights of its model raises `SourceError` naming them."""
    if (gguf_path := find_gguf(source)) is not None:
        return load_gguf_model(GGUFFile.read(gguf_path), dtype)
    model, info = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
    )
    if missing := sorted(info["missing_keys"]):  # transformers would start them from random values, with a warning
        more = f" and {len(missing) - _NAMED_KEYS} more" if len(missing) > _NAMED_KEYS else ""
        named = ", ".join(missing[:_NAMED_KEYS]) + more
        raise SourceError(
            f"{len(missing)} weight(s) of the model are missing from the checkpoint ({named}): it is "
            "incomplete or of another architecture: convert or download it again"
        )
    return model


def find_gguf(source: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file that `--from SRC [--gguf-file NAME]` names (resolved), or None when SRC is a checkpoint directory
    or a hub id. SRC is a `.gguf` file, or a directory holding `NAME` (or, without `config.json`, holding one GGUF
    file)."""
    found = named_gguf(source, gguf_file)
    return None if found is None else found.resolve()


def named_gguf(source: str, gguf_file: str | None) -> Path | None:
    """`find_gguf`, as named in SRC: a link in the directory SRC is not followed."""
    path = Path(source).expanduser()
    require_local_or_hub_id(source)
    if gguf_file is not None:
        if not path.is_dir():
            raise SourceError(
                f"--gguf-file names a file in the directory SRC, but {source} is not a directory; pass a single GGUF "
                "file itself as SRC."
            )
        if Path(gguf_file).name != gguf_file:  # a path: absolute, or with folders (`../x.gguf`)
            raise SourceError(
                f"--gguf-file takes the name of a file in {source} (such as model.Q4_K_M.gguf), got the path "
                f"{gguf_file}; to convert a GGUF file elsewhere, pass its path as SRC instead."
            )
        if not (path / gguf_file).is_file():
            found = _gguf_files(path)
            holds = f"it holds {', '.join(found)}" if found else "it holds no GGUF file"
            raise SourceError(f"--gguf-file {gguf_file}: no such file in {path} ({holds}).")
        return path / gguf_file
    if path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return path
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        found = _gguf_files(path)
        if len(found) > 1:
            raise SourceError(
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
        raise SourceError(
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
    """A GGUF file whose header has been read and checked: every tensor in a type gguf-py dequantises, none cut
    short. Whether path-hf converts its architecture is the converter's question (`conversion.gguf`)."""

    path: Path
    architecture: str
    # GGUF name, ggml type and torch shape of every tensor, in file order
    tensors: tuple[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...]], ...]
    file_type: str | None  # general.file_type, e.g. MOSTLY_Q4_1
    has_tokenizer: bool
    experts: int  # {architecture}.expert_count: 0 for a dense model

    @classmethod
    def read(cls, path: Path) -> GGUFFile:
        """Read the header (metadata and tensor table, no tensor data); `SourceError` for a truncated or corrupt
        file or a tensor type gguf-py cannot dequantise. Remembered while
        the file is unchanged (gguf-py takes seconds to parse a vocabulary)."""
        stat = path.stat()
        return cls._read(path.resolve(), stat.st_mtime_ns, stat.st_size)

    @classmethod
    @lru_cache(maxsize=4)
    def _read(cls, path: Path, mtime_ns: int, size: int) -> GGUFFile:
        try:
            reader = gguf.GGUFReader(path)  # checks that every tensor's bytes lie inside the file
        except Exception as error:  # a damaged file raises anything from numpy, struct or the enums
            raise SourceError(
                f"{path} is not a readable GGUF file: it is truncated or corrupt ({error}); download or export it "
                "again."
            ) from error
        architecture = _field(reader, "general.architecture")
        tensors = []
        for tensor in reader.tensors:
            if not _dequantisable(tensor.tensor_type):
                version = importlib.metadata.version("gguf")
                raise SourceError(
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
            experts=_field(reader, f"{architecture}.expert_count") or 0,
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


def _transformers_error(path: Path, error: Exception) -> SourceError:
    return SourceError(f"transformers cannot read {path.name}: {first_line(error)}")


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
        raise SourceError(f"{file.path.name} holds no tokenizer (no tokenizer.ggml.model in its metadata).")
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


def model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    with torch.device("meta"):
        return type(AutoModelForCausalLM.from_config(config))


def parameter_names(config: PretrainedConfig) -> list[str]:
    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(config).state_dict())


def gguf_state_dict(file: GGUFFile, config: PretrainedConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the model, dequantised by transformers to `dtype`: the whole model in memory."""
    names = _ParameterNames(config, parameter_names(config))
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
    return model_class(config).from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)


__all__ = [
    "DEFAULT_GGUF_DTYPE",
    "GGUF_SUFFIX",
    "GGUFFile",
    "find_gguf",
    "named_gguf",
    "gguf_config",
    "gguf_state_dict",
    "gguf_tokenizer",
    "TOKENIZER_FILES",
    "load_causal_lm",
    "load_config",
    "load_gguf_model",
    "load_tokenizer",
    "model_class",
    "parameter_names",
    "require_local_or_hub_id",
]
