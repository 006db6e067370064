# Copyright 2026 The path-hf authors. Apache-2.0.
"""Checkpoint files: read source shards one at a time, write output shards cut by bytes, and their index.

Nothing here holds a model: a source shard is known by its header (names, dtypes, shapes, byte offsets) and its
tensors are copied one at a time. A `.safetensors` tensor whose dtype does not change is copied file to file as
raw bytes (`os.copy_file_range`), so it is bit-identical by construction and memory stays at a few MB whatever
the shard size.

Every tensor written can be checked for NaN and infinite values on the way (`count_nonfinite`): before a raw copy,
the tensor is read through a memory map of its file, 16 MiB at a time (`SourceReader.chunks`), which leaves it in the
page cache for the copy that follows.

Why the shard reader and writer are ours and not safetensors' (measured with safetensors 0.8): bounded memory and the
conversion's own order are the point, and safetensors' API gives neither.
- safetensors checks every source header, and that the data covers the file, before anything is read
  (`safe_open` in `read_safetensors_header`). It does not expose the tensors' byte offsets, which a raw copy needs, so
  the header is then read here.
- `safe_open` maps the whole file, and the pages of what `get_tensor` and `get_slice` return stay in the process's
  RSS while it is open: reading the four 64 MiB tensors of one file one at a time takes 260 MiB above the start
  with `get_tensor`, 68 MiB with `SourceReader.tensor` (a plain read); 256 MiB in 16 MiB `get_slice` pieces takes
  261 MiB, and `SourceReader.chunks` unmaps each piece once the next is asked for.
- `save_file` and `serialize_file` take every tensor of a file at once (in memory, or in 0.8 by pointer) and order
  them by dtype alignment, then name. `SafetensorsWriter` takes them one at a time in the conversion's
  order (a layer's new parameters after its source tensors, each source shard read once, in data order), copies an
  unchanged tensor file to file without passing through Python memory, and, given tensors in `save_file`'s order,
  writes the bytes it writes (`tests/conversion/test_convert_io.py`).
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.constants import SAFETENSORS_WEIGHTS_FILE_PATTERN
from safetensors import SafetensorError, safe_open
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from ..errors import ConversionError

# dtype names of the safetensors format.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_COPY_CHUNK = 64 * 2**20
# Pieces in which tensors are checked for NaN and Inf: what a raw copy's check adds to the peak RSS.
_CHECK_CHUNK = 16 * 2**20


@dataclass(frozen=True)
class TensorMeta:
    """What a tensor is, without its data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class NonFiniteValues:
    """The NaN and infinite values of tensor `name`, which holds `numel` values."""

    name: str
    nan: int
    inf: int
    numel: int

    def describe(self) -> str:
        """`"3 NaN and 1 Inf of its 6,144 values"`."""
        counts = " and ".join(f"{count:,} {kind}" for count, kind in ((self.nan, "NaN"), (self.inf, "Inf")) if count)
        return f"{counts} of its {self.numel:,} values"


def value_chunks(data: torch.Tensor, chunk_bytes: int = _CHECK_CHUNK) -> Iterator[torch.Tensor]:
    """The values of `data`, flattened, in views of at most `chunk_bytes`."""
    flat = data.reshape(-1)
    step = max(1, chunk_bytes // data.element_size())
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


def count_nonfinite(name: str, chunks: Iterable[torch.Tensor]) -> NonFiniteValues | None:
    """The NaN and infinite values among the `chunks` of tensor `name`, or None when they are all finite (or not
    floating point). One min/max reduction a chunk, which propagates NaN and holds any Inf, costs a few percent of
    reading the chunk; the values are counted only in a chunk that has some."""
    nan = inf = numel = 0
    for chunk in chunks:
        numel += chunk.numel()
        if not chunk.dtype.is_floating_point or not chunk.numel():
            continue
        if chunk.dtype.itemsize == 1:  # float8: no min/max on CPU; float16 holds every value, NaN and Inf included
            chunk = chunk.to(torch.float16)
        low, high = torch.aminmax(chunk)
        if bool(low.isfinite() & high.isfinite()):
            continue
        nan += int(chunk.isnan().sum())
        inf += int(chunk.isinf().sum())
    return NonFiniteValues(name, nan, inf, numel) if nan or inf else None


@dataclass(frozen=True)
class SourceTensor(TensorMeta):
    """A tensor of a source checkpoint and where its data lies."""

    file: Path
    # Byte offset of the data in a `.safetensors` file; None in a `.bin` file.
    offset: int | None


@dataclass(frozen=True)
class SourceWeights:
    """The weight files of a checkpoint directory and every tensor in them, in file order then data order."""

    format: str  # "safetensors" or "pytorch"
    files: tuple[Path, ...]
    tensors: tuple[SourceTensor, ...]

    def tensor(self, name: str) -> SourceTensor:
        return next(tensor for tensor in self.tensors if tensor.name == name)

    @classmethod
    def from_directory(cls, directory: Path) -> SourceWeights:
        """Find the weights (sharded or single-file, safetensors preferred over `.bin`) and read every header.

        Raises `ConversionError` for missing shards, unreadable files, and an index that disagrees with them.
        """
        files, weight_map = find_weight_files(directory)
        if not files:
            raise ConversionError(
                f"no weights in {directory}: expected {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, {WEIGHTS_NAME} "
                f"or {WEIGHTS_INDEX_NAME}."
            )
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise ConversionError(f"shard file(s) listed in the index are missing from {directory}: {missing}.")

        fmt = "safetensors" if files[0].suffix == ".safetensors" else "pytorch"
        read_header = read_safetensors_header if fmt == "safetensors" else read_pytorch_header
        tensors: list[SourceTensor] = []
        for file in files:
            in_file = read_header(file)
            if weight_map is not None:
                listed = {name for name, shard in weight_map.items() if shard == file.name}
                found = {tensor.name for tensor in in_file}
                if listed != found:
                    differ = sorted(listed ^ found)
                    raise ConversionError(
                        f"{file.name} and the index disagree about {len(differ)} tensor(s), e.g. {differ[0]!r}: "
                        "the checkpoint is corrupt or incomplete."
                    )
            tensors.extend(in_file)
        names = [tensor.name for tensor in tensors]
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise ConversionError(f"tensor {duplicate!r} is stored in more than one shard.")
        return cls(fmt, files, tuple(tensors))


def find_weight_files(directory: Path) -> tuple[tuple[Path, ...], dict[str, str] | None]:
    """The weight files of a checkpoint directory, sharded or single-file, safetensors preferred over `.bin` (none if
    it has none), and the weight map of their index (None for a single file)."""
    for index_name, single_name in ((SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME), (WEIGHTS_INDEX_NAME, WEIGHTS_NAME)):
        if (directory / index_name).is_file():
            shard_names, weight_map = read_index(directory / index_name)
            return tuple(directory / name for name in shard_names), weight_map
        if (directory / single_name).is_file():
            return (directory / single_name,), None
    return (), None


def read_index(path: Path) -> tuple[list[str], dict[str, str]]:
    """The shard files a shard index lists (sorted) and its weight map, tensor name -> file name.

    transformers' `get_checkpoint_shard_files` reads an index too, but requires its `metadata`, which the shards do
    not need; this one asks for the weight map only, and says in one line what is wrong with a broken index."""
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ConversionError(f"{path.name} is not a valid shard index ({error}).") from error
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{path.name} lists no tensors.")
    return sorted(set(weight_map.values())), weight_map


def read_safetensors_header(path: Path) -> list[SourceTensor]:
    """The tensors of a `.safetensors` file in data order, without reading their data."""
    try:
        # safetensors validates the header and that the data covers the file (catches truncated downloads).
        with safe_open(path, framework="pt"):
            pass
    except SafetensorError as error:
        raise ConversionError(f"{path.name} is not a valid safetensors file ({error}).") from error
    with open(path, "rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_size))
    header.pop("__metadata__", None)
    data_start = 8 + header_size
    tensors = []
    for name, entry in header.items():
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{path.name}: tensor {name!r} has dtype {entry['dtype']}, which torch cannot hold.")
        start, _ = entry["data_offsets"]
        tensors.append(
            SourceTensor(name, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), path, data_start + start)
        )
    return sorted(tensors, key=lambda tensor: tensor.offset)


def load_pytorch_file(path: Path) -> dict[str, torch.Tensor]:
    """A `.bin` state dict, memory-mapped when its format allows (`weights_only`: no code is run)."""
    try:
        try:
            state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            state_dict = torch.load(path, map_location="cpu", weights_only=True)  # legacy (pre-zip) format
    except Exception as error:  # a damaged file raises anything from zipfile, pickle or torch
        raise ConversionError(f"{path.name} is not a readable PyTorch checkpoint ({error}).") from error
    if not isinstance(state_dict, dict) or not all(isinstance(t, torch.Tensor) for t in state_dict.values()):
        raise ConversionError(f"{path.name} does not hold a state dict of tensors.")
    return state_dict


def read_pytorch_header(path: Path) -> list[SourceTensor]:
    """The tensors of a `.bin` file in stored order (memory-mapped: their data is not read)."""
    return [
        SourceTensor(name, tensor.dtype, tuple(tensor.shape), path, None)
        for name, tensor in load_pytorch_file(path).items()
    ]


class SourceReader:
    """Reads the tensors of one source file at a time, in the order a conversion walks them."""

    def __init__(self):
        self._path: Path | None = None
        self._file = None
        self._state_dict: dict[str, torch.Tensor] | None = None
        self._map: mmap.mmap | None = None  # of `_file`, made by `chunks`

    def _open(self, path: Path) -> None:
        if path == self._path:
            return
        self.close()
        self._path = path
        if path.suffix == ".safetensors":
            self._file = open(path, "rb", buffering=0)
        else:
            self._state_dict = load_pytorch_file(path)

    def tensor(self, source: SourceTensor) -> torch.Tensor:
        """The tensor's data, in its stored dtype."""
        self._open(source.file)
        if self._state_dict is not None:
            return self._state_dict[source.name]
        data = bytearray(source.nbytes)
        view = memoryview(data)
        self._file.seek(source.offset)
        while view:  # one read returns at most ~2 GB on Linux
            read = self._file.readinto(view)
            if not read:
                raise ConversionError(f"{source.file.name} ends inside tensor {source.name!r}.")
            view = view[read:]
        return torch.frombuffer(data, dtype=torch.uint8).view(source.dtype).reshape(source.shape)

    def chunks(self, source: SourceTensor, chunk_bytes: int = _CHECK_CHUNK) -> Iterator[torch.Tensor]:
        """The tensor's values, flattened, in pieces of at most `chunk_bytes`: views of a `.safetensors` file mapped
        read-only (or of a `.bin` file's tensor), whose pages are unmapped again once the next piece is asked for."""
        self._open(source.file)
        if self._state_dict is not None:
            yield from value_chunks(self._state_dict[source.name], chunk_bytes)
            return
        if self._map is None:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        if source.offset + source.nbytes > len(self._map):
            raise ConversionError(f"{source.file.name} ends inside tensor {source.name!r}.")
        chunk_bytes -= chunk_bytes % source.dtype.itemsize
        for start in range(source.offset, source.offset + source.nbytes, chunk_bytes):
            count = min(chunk_bytes, source.offset + source.nbytes - start)
            with warnings.catch_warnings():  # torch warns that the map is read-only, which the pieces are too
                warnings.simplefilter("ignore", UserWarning)
                chunk = torch.frombuffer(self._map, dtype=torch.uint8, count=count, offset=start)
            yield chunk.view(source.dtype)
            # Unmap the pages read, which the process's RSS would otherwise count; they stay in the page cache, and
            # a piece still held reads them from there again.
            page = start - start % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, page, start + count - page)

    def raw_file(self, source: SourceTensor):
        """The open `.safetensors` file holding `source`, for a raw byte copy."""
        self._open(source.file)
        return self._file

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a piece is still held: the map closes when it is freed
                pass
        if self._file is not None:
            self._file.close()
        self._path, self._file, self._state_dict, self._map = None, None, None, None

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def split_into_shards(tensors: Sequence[TensorMeta], max_shard_bytes: int) -> list[list[TensorMeta]]:
    """Cut a stream of tensors, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets its own).

    `huggingface_hub.split_state_dict_into_shards_factory` cuts the same way but for a tensor bigger than the limit:
    it puts that tensor in a shard of its own ahead of the shard being filled, which then takes the tensors after it.
    The shards would no longer hold the stream in order, and the writer relies on that order (a layer's new
    parameters right after its last source tensor, each source shard read once, in data order)."""
    shards: list[list[TensorMeta]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """The hub's names, as `save_pretrained` and the hub's splitter give them: `model.safetensors` alone, else
    `model-00001-of-0000N.safetensors`."""
    if num_shards == 1:
        return [SAFETENSORS_WEIGHTS_FILE_PATTERN.format(suffix="")]
    return [
        SAFETENSORS_WEIGHTS_FILE_PATTERN.format(suffix=f"-{i:05d}-of-{num_shards:05d}")
        for i in range(1, num_shards + 1)
    ]


def write_index(directory: Path, shards: Sequence[Sequence[TensorMeta]], file_names: Sequence[str]) -> None:
    """`model.safetensors.index.json`, as `save_pretrained` writes it (only for more than one shard)."""
    weight_map = {tensor.name: name for shard, name in zip(shards, file_names, strict=True) for tensor in shard}
    index = {
        "metadata": {"total_size": sum(tensor.nbytes for shard in shards for tensor in shard)},
        "weight_map": weight_map,
    }
    (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


class SafetensorsWriter:
    """Writes one `.safetensors` file whose tensors are known up front: the header first, then each tensor's
    bytes in the header's order, so no more than one tensor is ever in memory; a tensor copied (`copy_tensor`) goes
    file to file, bit-identical by construction. Why not safetensors' `save_file`: the module's docstring."""

    def __init__(self, path: Path, tensors: Sequence[TensorMeta], metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for tensor in tensors:
            header[tensor.name] = {
                "dtype": _SAFETENSORS_NAMES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + tensor.nbytes],
            }
            offset += tensor.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
        self._pending: Iterator[TensorMeta] = iter(tensors)
        self._remaining = len(tensors)
        self._file = open(path, "xb", buffering=0)
        self._write(struct.pack("<Q", len(encoded)) + encoded)

    def _next(self, tensor: TensorMeta) -> None:
        expected = next(self._pending, None)
        if expected is not tensor:
            raise RuntimeError(f"writing {tensor} where the header has {expected}")
        self._remaining -= 1

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self._file.fileno(), view) :]

    def write_tensor(self, tensor: TensorMeta, data: torch.Tensor) -> None:
        """Write `data`, which must have the dtype and shape `tensor` announced."""
        self._next(tensor)
        if (data.dtype, tuple(data.shape)) != (tensor.dtype, tensor.shape):
            raise RuntimeError(f"{tensor.name}: got {data.dtype} {tuple(data.shape)} for {tensor}")
        if tensor.nbytes:
            self._write(data.detach().contiguous().reshape(-1).view(torch.uint8).numpy())

    def copy_tensor(self, tensor: TensorMeta, source_file, offset: int) -> None:
        """Copy `tensor.nbytes` raw bytes from `source_file` at `offset`."""
        self._next(tensor)
        source_fd, target_fd, remaining = source_file.fileno(), self._file.fileno(), tensor.nbytes
        try:
            while remaining:
                copied = os.copy_file_range(source_fd, target_fd, remaining, offset)
                if copied == 0:
                    raise ConversionError(f"{Path(source_file.name).name} ends inside tensor {tensor.name!r}.")
                offset, remaining = offset + copied, remaining - copied
        except OSError as error:
            # Not every file system (or kernel) can copy between these two files: read and write instead.
            if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            while remaining:
                chunk = os.pread(source_fd, min(remaining, _COPY_CHUNK), offset)
                if not chunk:
                    raise ConversionError(
                        f"{Path(source_file.name).name} ends inside tensor {tensor.name!r}."
                    ) from None
                self._write(chunk)
                offset, remaining = offset + len(chunk), remaining - len(chunk)

    def close(self) -> None:
        """Close the file, checking that every announced tensor was written."""
        self._file.close()
        if self._remaining:
            raise RuntimeError(f"{self._file.name}: {self._remaining} tensor(s) announced but not written")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # the file is incomplete anyway: do not hide the error
            self._file.close()


__all__ = [
    "SAFETENSORS_DTYPES",
    "NonFiniteValues",
    "SafetensorsWriter",
    "SourceReader",
    "SourceTensor",
    "SourceWeights",
    "TensorMeta",
    "count_nonfinite",
    "find_weight_files",
    "load_pytorch_file",
    "read_index",
    "read_pytorch_header",
    "read_safetensors_header",
    "shard_file_names",
    "split_into_shards",
    "value_chunks",
    "write_index",
]
