"""Benchmark of `path-hf convert` on a synthetic multi-GB checkpoint: wall time against `cp -r`, peak RSS against
the largest source shard.

    python bench/convert_bench.py                       # 4 layers of Llama-3-8B shapes, bf16: ~3.9 GB, a few minutes
    python bench/convert_bench.py --layers 2 --source-shard-size 1GB

The source has Llama-3-8B's layer shapes (hidden 4096, intermediate 14336, 32 heads, 8 kv heads, vocab 128256,
untied, bf16) with fewer layers and random weights, written shard by shard. Each repetition copies it with
`cp -r` and converts it with `python -m path_hf convert` in a fresh process: its total time includes starting
Python and importing torch, transformers and path_hf, a cost that does not grow with the model, so the time of a
`--dry-run` (startup and plan) and the converter's own write time are reported too. Peak RSS is the converter
process's high-water mark (`wait4`). Times are medians over --reps; the files are in the page cache for both.
Writes a Markdown table to stdout and JSON to bench/out/. Everything is written under a temporary directory in
--workdir and deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def write_synthetic_checkpoint(directory: Path, num_layers: int, shard_size: str) -> None:
    """A Llama-3-8B-shaped checkpoint with `num_layers` layers and random bf16 weights, written shard by shard.

    Runs in its own process (`--write-source`): a child's peak RSS counts the memory of the process it was
    forked from, so the process that launches and measures the converter must stay small.
    """
    import torch
    from transformers import LlamaConfig

    from path_hf.conversion.architectures import ARCHITECTURES, converted_layout, path_config_from
    from path_hf.conversion.io import SafetensorsWriter, TensorMeta, shard_file_names, split_into_shards, write_index
    from path_hf.conversion.options import parse_size

    config = LlamaConfig(**LLAMA3_8B, num_hidden_layers=num_layers, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    layout = converted_layout(path_config_from(config, ARCHITECTURES["LlamaForCausalLM"]))
    tensors = [TensorMeta(name, torch.bfloat16, shape) for name, shape in layout.source.items()]
    shards = split_into_shards(tensors, parse_size(shard_size))
    names = shard_file_names(len(shards))
    generator = torch.Generator().manual_seed(0)
    for shard, name in zip(shards, names, strict=True):
        with SafetensorsWriter(directory / name, shard) as writer:
            for tensor in shard:
                writer.write_tensor(tensor, torch.randn(tensor.shape, generator=generator, dtype=torch.bfloat16) * 0.02)
    if len(shards) > 1:
        write_index(directory, shards, names)


def directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def run_timed(command: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS in bytes, and stdout of `command` run in a child process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{stdout}")
    return seconds, usage.ru_maxrss * 1024, stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    parser.add_argument("--source-shard-size", default="2GB", help="source shard size (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default: %(default)s)")
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where to write (default: %(default)s)")
    parser.add_argument("--write-source", type=Path, help=argparse.SUPPRESS)  # the child writing the checkpoint
    args = parser.parse_args()
    if args.write_source:
        write_synthetic_checkpoint(args.write_source, args.layers, args.source_shard_size)
        return

    workdir = Path(tempfile.mkdtemp(prefix="path-hf-convert-bench-", dir=args.workdir))
    try:
        source = workdir / "source"
        source.mkdir()
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, __file__, "--write-source", str(source), "--layers", str(args.layers)]
            + ["--source-shard-size", args.source_shard_size],
            check=True,
        )
        shard_sizes = [path.stat().st_size for path in source.glob("*.safetensors")]
        source_bytes = directory_bytes(source)
        print(
            f"synthetic checkpoint: {source_bytes / 1e9:.2f} GB in {len(shard_sizes)} shard(s), written in "
            f"{time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
        # Both the copy and the conversion coexist with the source for a moment.
        free = shutil.disk_usage(workdir).free
        if free < 2.2 * source_bytes:
            raise SystemExit(f"not enough free disk space in {workdir}: {free / 1e9:.1f} GB")

        copy_seconds, convert_seconds, write_seconds, plan_seconds, peak_rss = [], [], [], [], []
        convert = [sys.executable, "-m", "path_hf", "convert", "--from", str(source)]
        for _ in range(args.reps):
            seconds, _, _ = run_timed(["cp", "-r", str(source), str(workdir / "copy")])
            copy_seconds.append(seconds)
            shutil.rmtree(workdir / "copy")
            # Starting Python, importing torch / transformers / path_hf and planning: a cost independent of size.
            plan_seconds.append(run_timed([*convert, "--to", str(workdir / "converted"), "--dry-run"])[0])
            seconds, rss, stdout = run_timed([*convert, "--to", str(workdir / "converted")])
            convert_seconds.append(seconds)
            peak_rss.append(rss)
            write_seconds.append(float(re.search(r"in ([\d.]+) s\)", stdout)[1]))
            output_bytes = directory_bytes(workdir / "converted")
            shutil.rmtree(workdir / "converted")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "layers": args.layers,
        "source_bytes": source_bytes,
        "output_bytes": output_bytes,
        "largest_shard_bytes": max(shard_sizes),
        "cp_seconds": statistics.median(copy_seconds),
        "convert_seconds": statistics.median(convert_seconds),
        "convert_write_seconds": statistics.median(write_seconds),
        "convert_dry_run_seconds": statistics.median(plan_seconds),
        "peak_rss_bytes": max(peak_rss),
        "reps": args.reps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
    }
    gib = 2**30
    speed = result["cp_seconds"] / result["convert_seconds"]
    write_speed = result["cp_seconds"] / result["convert_write_seconds"]
    print(
        "| source | `cp -r` | `path-hf convert`: total (`--dry-run`; write phase) | convert / cp speed: total "
        "(write phase) | peak RSS | largest shard |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {source_bytes / 1e9:.2f} GB, {args.layers} layers | {result['cp_seconds']:.1f} s | "
        f"{result['convert_seconds']:.1f} s ({result['convert_dry_run_seconds']:.1f} s; "
        f"{result['convert_write_seconds']:.1f} s) | {speed:.2f}x ({write_speed:.2f}x) | "
        f"{result['peak_rss_bytes'] / gib:.2f} GiB | {result['largest_shard_bytes'] / gib:.2f} GiB |"
    )
    out_dir = REPO_ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "convert_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
