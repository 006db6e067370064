# Copyright 2026 The path-hf authors. Apache-2.0.
"""`path-hf convert`: plan a conversion from headers and config alone, then stream it into a new directory.

The plan reads the source `config.json`, checks the architecture, and reads every shard's header: names, dtypes,
shapes, but no data. Writing walks the source tensors shard by shard, in data order, into output shards cut by
bytes; the new PaTH parameters of a layer are made (with PaTHLlama's own init) right after the layer's last
source tensor. Everything goes to a temporary directory beside the destination, renamed into place at the end; its
name holds the host and the process id, so that a later conversion to the same destination removes it if a killed
run left it behind. Every tensor is checked for NaN and Inf as it is written.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import snapshot_download
from transformers import AutoConfig, GenerationConfig
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM, init_path_parameters
from path_hf.atomic import atomic_directory
from path_hf.errors import ConversionError
from path_hf.modeling_path_llama import PaTHLlamaAttention, PaTHLlamaRoPEAttention

from .architectures import Architecture, check_attention, check_source_config, check_source_tensors, path_config_from
from .io import (
    NonFiniteValues,
    SafetensorsWriter,
    SourceReader,
    SourceTensor,
    SourceWeights,
    TensorMeta,
    count_nonfinite,
    shard_file_names,
    split_into_shards,
    value_chunks,
    write_index,
)
from .options import UNRECORDED_OPTIONS, ConvertOptions, format_layers

if TYPE_CHECKING:
    from .gguf import GGUFCheckpoint

# Files of a source directory that are not carried over as they are: weights, and what the converter writes.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_REPLACED_FILES = (CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME, "README.md")
# Headroom kept free on the destination's file system beyond the bytes written (file-system blocks and metadata, other
# writers meanwhile): 1/16 of the output plus 128 KiB, at most 256 MiB (reached at a 4 GiB output).
_DISK_MARGIN_MAX = 256 * 2**20
_DISK_MARGIN_FIXED = 128 * 2**10
# Directories a conversion writes beside DST: the output being written (tmp), a GGUF materialised as a checkpoint
# (gguf), a replaced DST being deleted (old). Named `.DST.KIND-HOST-PID-TOKEN` (by older versions `.DST.KIND-TOKEN`).
STAGING_KINDS = ("tmp", "gguf", "old")
_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"
# Warnings list at most this many tensors holding non-finite values.
_NAMED_TENSORS = 5
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def layer_seed(seed: int, layer_idx: int) -> int:
    """The RNG seed the new parameters of layer `layer_idx` are drawn with: a layer's init depends on `--seed` and
    its index only, not on which other layers are converted."""
    return seed * 1_000_000 + layer_idx


def package_version() -> str:
    try:
        return importlib.metadata.version("path-hf")
    except importlib.metadata.PackageNotFoundError:  # running from a source checkout
        return "unknown"


@dataclass(frozen=True)
class Source:
    """A source checkpoint on disk: a local directory, the snapshot of a hub repository in the cache, or a GGUF file
    materialised as a checkpoint in a temporary directory (`conversion.gguf`)."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None  # the snapshot's commit
    gguf: GGUFCheckpoint | None = None

    @property
    def name(self) -> str:
        return self.repo_id or str(self.gguf.file.path if self.gguf else self.path)


def _download(repo_id: str, revision: str | None, **patterns) -> Path:
    try:
        return Path(snapshot_download(repo_id, revision=revision, **patterns))
    except (OSError, ValueError) as error:  # not found, offline and not cached, invalid id, HTTP errors
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConversionError(f"cannot get {repo_id!r} from the hub: {first_line}") from error


def resolve_source(source: str, revision: str | None) -> Source:
    """A local directory as it is; a hub id downloaded without its weights (`fetch_weights` gets them after the
    config has been checked), honouring `HF_HUB_OFFLINE`, `revision` and the cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ConversionError(f"--revision applies to hub ids, but {source} is a local directory.")
        return Source(path.resolve())
    if path.exists():
        if path.suffix.lower() == ".gguf":  # `convert` materialises it first
            raise ConversionError(f"{source} is a GGUF file: plan it inside `conversion.gguf.gguf_source(options)`.")
        raise ConversionError(f"{source} is a file; SRC must be a checkpoint directory, a .gguf file or a hub id.")
    ignore = [f"*{suffix}" for suffix in _WEIGHT_SUFFIXES] + ["*/*"]  # top-level files only
    snapshot = _download(source, revision, ignore_patterns=ignore)
    return Source(snapshot, repo_id=source, revision=snapshot.name)


def fetch_weights(source: Source) -> None:
    """Download the weight files of a hub source (only those the index lists, or the single file)."""
    if source.repo_id is None:
        return
    for index_name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        index = source.path / index_name
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            _download(source.repo_id, source.revision, allow_patterns=files)
            return
    for single_name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        _download(source.repo_id, source.revision, allow_patterns=[single_name])
        if (source.path / single_name).is_file():
            return


@dataclass(frozen=True)
class OutputTensor(TensorMeta):
    """A tensor of the converted checkpoint: a copy of `source` (cast to `dtype`), or a new PaTH parameter of
    decoder layer `layer` when `source` is None."""

    source: SourceTensor | None = None
    layer: int | None = None


@dataclass(frozen=True)
class ConversionPlan:
    """Everything a conversion will do, known before any tensor data is read."""

    options: ConvertOptions
    source: Source
    architecture: Architecture
    config: PaTHLlamaConfig
    weights: SourceWeights
    shards: tuple[tuple[OutputTensor, ...], ...]
    extra_files: tuple[Path, ...]  # tokenizer, chat template, license... copied as they are
    ignored: tuple[SourceTensor, ...] = ()  # source tensors left out (RoPE buffers, a tied head)

    @property
    def tensors(self) -> Iterator[OutputTensor]:
        return (tensor for shard in self.shards for tensor in shard)

    @property
    def weight_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)

    @property
    def bytes_to_write(self) -> int:
        return self.weight_bytes + sum(path.stat().st_size for path in self.extra_files)

    def describe(self) -> str:
        """The plan in a few lines, as `--dry-run` prints it."""
        config, opts = self.config, self.options
        copied = [tensor for tensor in self.tensors if tensor.source is not None]
        added = [tensor for tensor in self.tensors if tensor.source is None]
        path_layers = config.path_layers if config.path_layers is not None else range(config.num_hidden_layers)
        added_names = sorted({re.sub(r"^model\.layers\.\d+\.self_attn\.", "", tensor.name) for tensor in added})
        revision = f" @ {self.source.revision}" if self.source.revision else ""
        gguf = f" ({self.source.gguf.describe()})" if self.source.gguf else ""
        dtype = str(config.dtype).removeprefix("torch.")
        lines = [
            f"source:       {self.source.name}{revision}{gguf}",
            f"architecture: {self.architecture.name}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads ({config.num_key_value_heads} kv), head dim {config.head_dim}, "
            f"{'tied' if config.tie_word_embeddings else 'untied'} embeddings",
            f"PaTH layers:  {format_layers(path_layers)} ({len(path_layers)} of {config.num_hidden_layers}), rope "
            f"{config.rope_mode}, forget gate {_gate(config)}, w_proj "
            f"{'full rank' if config.path_w_rank is None else f'rank {config.path_w_rank}'}, conv size "
            f"{config.path_conv_size}, init {config.path_init}, seed {opts.seed}",
            f"copy:         {len(copied)} tensors, {_size(sum(t.nbytes for t in copied))} from "
            f"{len(self.weights.files)} {self.weights.format} file(s), written as {dtype}",
            f"add:          {len(added)} tensors, {sum(math.prod(t.shape) for t in added):,} parameters, "
            f"{_size(sum(t.nbytes for t in added))} ({', '.join(added_names)})",
        ]
        if self.ignored:
            lines.append(f"leave out:    {len(self.ignored)} tensor(s): {', '.join(t.name for t in self.ignored)}")
        lines.append(
            f"write:        {_size(self.bytes_to_write)} in {len(self.shards)} shard(s) + {len(self.extra_files)} "
            f"tokenizer/other file(s) to {Path(opts.output).resolve()}"
        )
        return "\n".join(lines)


def _gate(config: PaTHLlamaConfig) -> str:
    if not config.path_forget_gate:
        return "off"
    return f"on (bias {config.path_forget_gate_bias:g})" if config.path_forget_gate_bias else "on"


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError  # unreachable


def check_destination(output: Path, source: Path, force: bool) -> None:
    """Refuse a destination that holds files (unless `force`), or that overlaps the source."""
    output = output.resolve()
    if output.exists() and not force and (not output.is_dir() or any(output.iterdir())):
        raise ConversionError(f"{output} exists and is not empty; pass --force to replace it.")
    if output.is_relative_to(source):
        raise ConversionError(f"the destination {output} is inside the source {source}.")
    if source.is_relative_to(output):
        raise ConversionError(f"the source {source} is inside the destination {output}, which would be replaced.")


def disk_margin(needed: int) -> int:
    """The free space kept beyond `needed` bytes written: 1/16 of them plus 128 KiB, at most 256 MiB."""
    return min(_DISK_MARGIN_MAX, needed // 16 + _DISK_MARGIN_FIXED)


def check_disk_space(output: Path, needed: int) -> None:
    """Refuse when the destination's file system has less free space than the output plus a margin
    (`disk_margin`). Staging directories of dead processes beside `output` count as free, since a conversion
    removes them first (`clear_stale_staging`); those of other live or unknown processes are named if space is
    short."""
    existing = output.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    staging = [directory for directory in find_staging(output) if directory.pid != os.getpid()]
    reclaimable = sum(directory.size for directory in staging if directory.state == "dead")
    margin = disk_margin(needed)
    if free + reclaimable < needed + margin:
        removable = f" (+ {_size(reclaimable)} in stale staging directories to remove)" if reclaimable else ""
        held = [directory for directory in staging if directory.state != "dead"]
        held_by = (
            f"; {_size(sum(d.size for d in held))} is held by staging directories of other conversions: "
            f"{', '.join(d.path.name for d in held)}"
            if held
            else ""
        )
        raise ConversionError(
            f"not enough free disk space in {existing}: the output needs {_size(needed)} (+ {_size(margin)} "
            f"margin), {_size(free)} is free{removable}{held_by}."
        )


def staging_directory(output: Path, kind: str) -> Path:
    """A new path beside `output` for a directory a conversion to `output` writes (`kind`, one of `STAGING_KINDS`),
    naming this host and process: `.DST.KIND-HOST-PID-TOKEN`."""
    return output.with_name(f".{output.name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


@dataclass(frozen=True)
class StagingDirectory:
    """A directory a conversion to the same destination wrote, found beside it (`find_staging`)."""

    path: Path
    host: str | None  # None: named by an older version, which recorded no process
    pid: int | None

    @property
    def state(self) -> str:
        """`dead`: its process, on this host, no longer runs. `running`: it does (or its pid was reused).
        `unknown`: another host's, or named without a process."""
        if self.pid is None or self.host != _HOST or os.name != "posix":  # Windows' os.kill would end the process
            return "unknown"
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:  # another user's process
            return "running"
        except OverflowError:  # not a process id
            return "unknown"
        return "running"

    @property
    def size(self) -> int:
        """Bytes it occupies on disk."""
        total = 0
        for root, _, files in os.walk(self.path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:  # removed meanwhile
                    pass
        return total

    def describe(self) -> str:
        owner = {
            "dead": f"left by process {self.pid}, which is no longer running",
            "running": f"of running process {self.pid} on this host (another conversion to the same destination?)",
            "unknown": f"of process {self.pid} on host {self.host}"
            if self.pid is not None
            else "left by an older path-hf, which did not record its process",
        }[self.state]
        return f"{self.path} ({_size(self.size)}), {owner}"


def find_staging(output: Path) -> list[StagingDirectory]:
    """The staging directories of conversions to `output` beside it, whoever wrote them."""
    output = output.resolve()
    pattern = re.compile(
        rf"\.{re.escape(output.name)}\.(?:{'|'.join(STAGING_KINDS)})-(?:(?P<host>.+)-(?P<pid>\d+)-)?[0-9a-f]{{8}}"
    )
    if not output.parent.is_dir():
        return []
    return [
        StagingDirectory(path, found["host"], int(found["pid"]) if found["pid"] else None)
        for path in sorted(output.parent.iterdir())
        if (found := pattern.fullmatch(path.name)) and path.is_dir() and not path.is_symlink()
    ]


def clear_stale_staging(output: Path, remove: bool = True) -> None:
    """Remove (if `remove`) the staging directories beside `output` that a killed conversion left, saying so; name
    those of a process still running, or that cannot be checked, and leave them."""
    for directory in find_staging(output):
        if directory.state != "dead":
            print(
                f"warning: left as it is: {directory.describe()}; delete it once no conversion to {output.name} runs",
                file=sys.stderr,
                flush=True,
            )
        elif not remove:
            print(f"stale staging directory {directory.describe()}: a conversion removes it", flush=True)
        else:
            description = directory.describe()
            shutil.rmtree(directory.path, ignore_errors=True)
            if directory.path.exists():
                print(f"warning: cannot remove {description}", file=sys.stderr, flush=True)
            else:
                print(f"removed stale staging directory {description}", flush=True)


def new_parameters(config: PaTHLlamaConfig) -> list[TensorMeta]:
    """Names (under `self_attn.`) and shapes of what a PaTH layer adds to the source attention, in float32: the
    parameters of `PaTHLlamaAttention` that `PaTHLlamaRoPEAttention` does not have."""
    with torch.device("meta"):
        path_attention = PaTHLlamaAttention(config, layer_idx=0)
        source_names = {name for name, _ in PaTHLlamaRoPEAttention(config, layer_idx=0).named_parameters()}
    return [
        TensorMeta(name, param.dtype, tuple(param.shape))
        for name, param in path_attention.named_parameters()
        if name not in source_names
    ]


def init_new_parameters(config: PaTHLlamaConfig, layer_idx: int, seed: int) -> dict[str, torch.Tensor]:
    """The new parameters of PaTH layer `layer_idx`, initialised by `init_path_parameters` (PaTHLlama's own init)
    after seeding torch's RNG with `layer_seed(seed, layer_idx)`; keyed by their name under `self_attn.`."""
    with torch.device("meta"):
        attention = PaTHLlamaAttention(config, layer_idx)
    names = {tensor.name for tensor in new_parameters(config)}
    # Only the new submodules get memory; q/k/v/o stay on the meta device.
    for child_name, child in attention.named_children():
        if any(name.startswith(f"{child_name}.") for name in names):
            child.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, layer_idx))
        init_path_parameters(attention, config)
    return {name: param.detach() for name, param in attention.named_parameters() if name in names}


def plan_conversion(options: ConvertOptions, source: Source | None = None) -> ConversionPlan:
    """Check the source and the options, and lay out the output; reads configs and shard headers, no tensor data.
    `source`: the source already resolved (a GGUF materialised by `conversion.gguf.gguf_source`).

    Raises `ConversionError` for anything the converter refuses.
    """
    output = Path(options.output).expanduser()
    source = source or resolve_source(options.source, options.revision)
    check_destination(output, source.path, options.force)

    config_file = source.path / CONFIG_NAME
    if not config_file.is_file():
        raise ConversionError(f"{source.name} has no {CONFIG_NAME}; is it a transformers checkpoint?")
    try:
        raw_config = json.loads(config_file.read_text())
    except ValueError as error:
        raise ConversionError(f"{config_file} is not valid JSON ({error}).") from error
    architecture = check_source_config(raw_config)
    source_config = AutoConfig.from_pretrained(source.path)
    check_attention(source_config, options.allow_torch_only_head_dim)
    if options.layers is not None and max(options.layers) >= source_config.num_hidden_layers:
        raise ConversionError(
            f"--layers names layer {max(options.layers)}, but the model has {source_config.num_hidden_layers} layers "
            f"(0-{source_config.num_hidden_layers - 1})."
        )

    fetch_weights(source)
    weights = source.gguf.weights if source.gguf else SourceWeights.from_directory(source.path)
    config = path_config_from(
        source_config,
        architecture,
        rope_mode=options.rope,
        path_layers=list(options.layers) if options.layers is not None else None,
        path_forget_gate=options.forget_gate,
        path_forget_gate_bias=options.forget_gate_bias,
        path_w_rank=options.w_rank,
        path_conv_size=options.conv_size,
        path_init=options.init,
        path_conversion={
            "source": source.name,
            "revision": source.revision,
            **({"gguf": source.gguf.record()} if source.gguf else {}),
            "options": {k: v for k, v in asdict(options).items() if k not in UNRECORDED_OPTIONS},
            "path_hf_version": package_version(),
        },
    )
    copied, ignored = check_source_tensors(weights.tensors, config)
    # The checkpoint's dtype, which the new parameters take too: --dtype, or the source's embeddings'.
    dtype = getattr(torch, options.dtype) if options.dtype else weights.tensor("model.embed_tokens.weight").dtype
    config.dtype = dtype

    def cast(tensor_dtype: torch.dtype) -> torch.dtype:
        return dtype if options.dtype and tensor_dtype.is_floating_point else tensor_dtype

    added = new_parameters(config)
    last_of_layer = {int(m[1]): tensor.name for tensor in copied if (m := _LAYER.match(tensor.name))}
    stream: list[OutputTensor] = []
    for tensor in copied:
        stream.append(OutputTensor(tensor.name, cast(tensor.dtype), tensor.shape, source=tensor))
        layer = int(m[1]) if (m := _LAYER.match(tensor.name)) else None
        if layer is not None and last_of_layer[layer] == tensor.name and config.is_path_layer(layer):
            prefix = f"model.layers.{layer}.self_attn."
            stream.extend(OutputTensor(prefix + new.name, dtype, new.shape, layer=layer) for new in added)

    extra_files = tuple(
        path
        for path in sorted(source.path.iterdir())
        if path.is_file()
        and not path.name.startswith(".")
        and path.suffix not in (*_WEIGHT_SUFFIXES, ".py")
        and path.name not in _REPLACED_FILES
    )
    shards = tuple(tuple(shard) for shard in split_into_shards(stream, options.max_shard_size))
    plan = ConversionPlan(options, source, architecture, config, weights, shards, extra_files, tuple(ignored))
    check_disk_space(output, plan.bytes_to_write)
    return plan


def write_conversion(plan: ConversionPlan, directory: Path) -> None:
    """Write the converted checkpoint `plan` describes into the existing, empty `directory`.

    Each source tensor is checked for NaN and Inf as it is written, and so is what casting it to `--dtype` gives:
    the first one that holds any raises `ConversionError`; with `--allow-nonfinite`, they are written and named in
    a warning."""
    config, options = plan.config, plan.options
    file_names = shard_file_names(len(plan.shards))
    new_tensors: dict[str, torch.Tensor] = {}
    nonfinite: list[NonFiniteValues] = []

    def finite(tensor: OutputTensor, chunks, cast: bool = False) -> bool:
        found = count_nonfinite(tensor.name, chunks)
        if found is None:
            return True
        if not options.allow_nonfinite:
            if cast:
                dtype = str(tensor.dtype).removeprefix("torch.")
                raise ConversionError(
                    f"{plan.source.name}: tensor {tensor.name!r} becomes {found.describe()} when cast to {dtype} "
                    "(values beyond its range); choose a wider --dtype, or pass --allow-nonfinite to convert it "
                    "anyway."
                )
            raise ConversionError(
                f"{plan.source.name}: tensor {tensor.name!r} holds {found.describe()}, so the model computes NaN; "
                "repair or re-export the checkpoint, or pass --allow-nonfinite to convert it as it is."
            )
        nonfinite.append(found)
        return False

    with SourceReader() as reader:
        for shard, file_name in zip(plan.shards, file_names, strict=True):
            print(f"writing {file_name} ({_size(sum(t.nbytes for t in shard))})", flush=True)
            with SafetensorsWriter(directory / file_name, shard) as writer:
                for tensor in shard:
                    if tensor.source is None:
                        if tensor.name not in new_tensors:  # the first new tensor of a layer: make them all
                            prefix = f"model.layers.{tensor.layer}.self_attn."
                            new_tensors = {
                                prefix + name: param.to(tensor.dtype)
                                for name, param in init_new_parameters(config, tensor.layer, options.seed).items()
                            }
                        writer.write_tensor(tensor, new_tensors[tensor.name])
                    elif tensor.source.offset is not None and tensor.dtype == tensor.source.dtype:
                        finite(tensor, reader.chunks(tensor.source))  # read now, copied from the page cache
                        writer.copy_tensor(tensor, reader.raw_file(tensor.source), tensor.source.offset)
                    else:
                        stored = reader.tensor(tensor.source)
                        data = stored.to(tensor.dtype)
                        if finite(tensor, value_chunks(stored)) and data.dtype != stored.dtype:
                            finite(tensor, value_chunks(data), cast=True)
                        writer.write_tensor(tensor, data)
    if nonfinite:
        named = ", ".join(f"{found.name} ({found.describe()})" for found in nonfinite[:_NAMED_TENSORS])
        more = f" and {len(nonfinite) - _NAMED_TENSORS} more" if len(nonfinite) > _NAMED_TENSORS else ""
        print(
            f"warning: {len(nonfinite)} tensor(s) hold NaN or Inf, converted as they are (--allow-nonfinite): "
            f"{named}{more}",
            file=sys.stderr,
            flush=True,
        )
    if len(plan.shards) > 1:
        write_index(directory, plan.shards, file_names)

    config.save_pretrained(directory)  # config.json, and the config's code file for trust_remote_code
    _save_model_code(directory, config)
    generation_config = plan.source.path / GENERATION_CONFIG_NAME
    if generation_config.is_file():
        shutil.copyfile(generation_config, directory / GENERATION_CONFIG_NAME)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(directory)
    for path in plan.extra_files:
        shutil.copyfile(path, directory / path.name)
    (directory / "README.md").write_text(model_card(plan))


def _save_model_code(directory: Path, config: PaTHLlamaConfig) -> None:
    """What `save_pretrained` does for a class registered with `register_for_auto_class`, without building the
    model: copy its module and the modules it imports relatively, and map the auto class in `config.json`."""
    model_class = PaTHLlamaForCausalLM
    module_file = sys.modules[model_class.__module__].__file__
    for file in [module_file, *get_relative_import_files(module_file)]:
        shutil.copyfile(file, directory / Path(file).name)
    config_file = directory / CONFIG_NAME
    saved = json.loads(config_file.read_text())
    module_name = model_class.__module__.rsplit(".", 1)[-1]
    saved.setdefault("auto_map", {})[model_class._auto_class] = f"{module_name}.{model_class.__name__}"
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def model_card(plan: ConversionPlan) -> str:
    """README.md of the converted model: what was done, and how to load and train it."""
    config, source = plan.config, plan.source
    revision = f" (revision `{source.revision}`)" if source.revision else ""
    base_model = f"base_model: {source.repo_id}\n" if source.repo_id else ""
    source_named = f"[{source.repo_id}](https://huggingface.co/{source.repo_id})" if source.repo_id else "a checkpoint"
    if source.gguf:
        source_named = f"the GGUF file `{source.gguf.file.path.name}`"
        copied = f"Every weight is copied as transformers reads it from the GGUF ({source.gguf.describe()})."
    elif plan.options.dtype is None:
        copied = "Every weight of the source is copied unchanged: same name, dtype and bytes."
    else:
        copied = f"Every weight of the source is copied under its own name, cast to {plan.options.dtype}."
    if config.rope_mode == "keep" and config.path_init == "identity":
        starting_point = (
            "RoPE is kept and every Householder transform starts at the identity (the `bt_gain` gains are 0), so "
            "this model computes exactly what the source model computes until training moves the new parameters."
        )
    elif config.rope_mode == "keep":
        starting_point = (
            "RoPE is kept and PaTH's Householder transforms act on top of it. The new parameters start from a "
            "random init, so the model differs from the source until it is trained."
        )
    else:
        starting_point = (
            "RoPE is removed from the PaTH layers, as in the paper: the model starts far from the source and must "
            "be distilled from it or trained further to recover its quality."
        )
    return f"""---
{base_model}library_name: transformers
pipeline_tag: text-generation
tags:
- path-attention
- path-hf
---

# {Path(plan.options.output).name}

This is {source_named}{revision} with its attention converted to PaTH attention (Yang et
al., 2025, [arXiv:2505.16381](https://arxiv.org/abs/2505.16381)) by `path-hf convert` (path-hf
{package_version()}).

## What was done

```
{plan.describe()}
```

{copied} Each PaTH layer gets new parameters: `w_proj` (the Householder directions),
`w_conv1d` (a short causal convolution on them, if `path_conv_size > 0`), `bt_proj` and `bt_gain` (their strengths
beta) and, with the forget gate, `g_proj` and `g_gain`. They are initialised by PaTHLlama's own init, seeded from
`--seed {plan.options.seed}`. {starting_point}

The command and its options are recorded in `config.json` under `path_conversion`.

## Load

```python
import path_hf  # registers the path_llama model type
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{Path(plan.options.output).name}", dtype="auto")
tokenizer = AutoTokenizer.from_pretrained("{Path(plan.options.output).name}")
```

Without path-hf installed, `from_pretrained(..., trust_remote_code=True)` loads the model code stored beside the
weights. PaTH attention runs with flash-linear-attention's Triton kernel on CUDA when it is installed
(`pip install 'path-hf[fla]'`) and with a PyTorch implementation everywhere else.

## Train

The new parameters are ordinary parameters: fine-tune, distill from the source model (the paper's recipe matches
each attention layer's output, then the logits) or continue pretraining with any transformers trainer; the
recipes of path-hf do this with accelerate. With PEFT, keep the new modules trainable: `modules_to_save=["w_proj",
"w_conv1d", "bt_proj", "bt_gain"{', "g_proj", "g_gain"' if config.path_forget_gate else ""}]`.
"""


def convert(options: ConvertOptions) -> ConversionPlan:
    """Run `path-hf convert`: plan, print the plan, and (unless `--dry-run`) write and optionally verify the
    converted checkpoint, atomically. A GGUF source is materialised first, beside the destination, and removed at
    the end whatever happens. Staging directories that killed conversions to the same destination left are removed
    first (`clear_stale_staging`)."""
    from .gguf import gguf_source  # reads GGUF files: imports convert

    clear_stale_staging(Path(options.output).expanduser(), remove=not options.dry_run)
    with gguf_source(options) as source:
        plan = plan_conversion(options, source)
        print(plan.describe(), flush=True)
        if options.dry_run:
            return plan
        output = Path(options.output).expanduser().resolve()
        staging, old = staging_directory(output, "tmp"), staging_directory(output, "old")
        with atomic_directory(output, staging, old):
            start = time.perf_counter()
            write_conversion(plan, staging)
            seconds = time.perf_counter() - start
            if options.verify:
                from .verify import verify_conversion  # builds models: only imported when asked for

                verify_conversion(plan, staging)
        print(f"wrote {output} ({_size(plan.bytes_to_write)} in {seconds:.1f} s)", flush=True)
    return plan


__all__ = [
    "ConversionPlan",
    "OutputTensor",
    "Source",
    "STAGING_KINDS",
    "StagingDirectory",
    "check_destination",
    "check_disk_space",
    "clear_stale_staging",
    "convert",
    "disk_margin",
    "find_staging",
    "init_new_parameters",
    "layer_seed",
    "model_card",
    "new_parameters",
    "plan_conversion",
    "resolve_source",
    "staging_directory",
    "write_conversion",
]
