"""The torch backend on a real model's attention inputs: time and error of its PaTH layers' attention on real text.

    python bench/attention_real.py --model runs/smollm2/long/final \
        --data examples/data/copyright_does_not_exist/eval.jsonl.xz --length 4096 --layers 3 --ops-before 6b4410e

Runs the model once on the first `--length` tokens of `--data` (float32), records what each of its first `--layers`
PaTH layers hands `path_attention` (q, k, v, w, beta, g: real gates, real logit ranges, real GQA), then times
`path_attention(backend="torch")` on them in inference: the working tree's in float32, in float32 without superblocks
(`ops_superblock.superblock_attention`), with q, k and v in bfloat16 (where the CPU multiplies bfloat16 natively
its walk multiplies in bfloat16: `ops_chunk.walk_product_dtype`) and, with --ops-before, path_hf.ops as it was at
that commit, the rows alternating. The errors are relative (Frobenius) against the float64 torch backend without
superblocks on the same inputs; beside them, PyTorch's SDPA in bfloat16 on the same q, k, v (plain causal
attention) against its own float64 output, the error that bfloat16 inputs cost attention anyway.
Writes a Markdown table to stdout and JSON to bench/out/attention_real.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from attention_cpu import machine_info
from ops_versions import load_ops_at

import path_hf.modeling_path_llama as modeling
from path_hf import ops, ops_chunk
from path_hf.evaluation.texts import load_texts
from path_hf.loading import load_causal_lm, load_tokenizer

NAMES = ("q", "k", "v", "w", "beta", "g")


def capture(model_path: str, data: Path, length: int, layers: int) -> tuple[list[dict[str, torch.Tensor]], float]:
    """The inputs of the first `layers` PaTH attentions on `length` tokens of `data`, and their softmax scale."""
    model = load_causal_lm(model_path, torch.float32).eval()
    tokenizer = load_tokenizer(model_path)
    ids = tokenizer("\n\n".join(load_texts([data])["text"]), return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        sys.exit(f"error: {data} has {ids.shape[1]} tokens, fewer than --length {length}")
    captured, scales = [], []
    original = modeling.path_attention

    def record(q, k, v, w, beta, g=None, **kwargs):
        if len(captured) < layers:
            captured.append({n: t for n, t in zip(NAMES, (q, k, v, w, beta, g), strict=True) if t is not None})
            scales.append(kwargs["scale"])
        return original(q, k, v, w, beta, g, **kwargs)

    modeling.path_attention = record
    try:
        with torch.no_grad():
            model(ids)
    finally:
        modeling.path_attention = original
    if not captured:
        sys.exit(f"error: {model_path} has no PaTH layer")
    return captured, scales[0]


def bf16_inputs(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a bfloat16 model hands the op: q, k, v in bfloat16; w, beta and g stay float32."""
    return {n: t.bfloat16() if n in ("q", "k", "v") else t for n, t in x.items()}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def walk_only(*args, backend: str = "torch", **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch backend with its walk over the whole sequence: no superblocks (`superblock_attention`)."""
    return ops_chunk.chunk_path_attention(*args, **kwargs, superblock_tokens=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a PaTHLlama checkpoint")
    parser.add_argument("--data", type=Path, required=True, help="held-out text (.txt, .jsonl, may be compressed)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3, help="PaTH layers timed, the first ones")
    parser.add_argument("--ops-before", metavar="COMMIT", help="also time path_hf.ops as it was at COMMIT")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "attention_real.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inputs, scale = capture(args.model, args.data, args.length, args.layers)

    variants = {
        "float32": (ops.path_attention, False),
        "float32, no superblocks": (walk_only, False),
        "bfloat16 q, k, v": (ops.path_attention, True),
    }
    if args.ops_before:
        variants[f"float32 @{args.ops_before}"] = (load_ops_at(args.ops_before).path_attention, False)

    def run(fn, bf16: bool) -> None:
        with torch.no_grad():
            for x in inputs:
                fn(**(bf16_inputs(x) if bf16 else x), scale=scale, backend="torch")

    times = {name: [] for name in variants}
    for fn, bf16 in variants.values():  # warm-up
        run(fn, bf16)
    for _ in range(args.reps):
        for name, (fn, bf16) in variants.items():
            start = time.perf_counter()
            run(fn, bf16)
            times[name].append(time.perf_counter() - start)

    errors = []
    with torch.no_grad():
        for x in inputs:
            ref = walk_only(**{n: t.double() for n, t in x.items()}, scale=scale)[0]
            row = {name: relative_error(fn(**(bf16_inputs(x) if b else x), scale=scale, backend="torch")[0], ref)
                   for name, (fn, b) in variants.items()}  # fmt: skip
            groups = x["q"].shape[2] // x["k"].shape[2]
            q, k, v = (x[n].transpose(1, 2).double() for n in ("q", "k", "v"))
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            low = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, scale=scale)
            errors.append(row | {"SDPA bfloat16 (no PaTH)": relative_error(low, exact)})

    info = machine_info(args.threads)
    print(f"# {args.model}, {len(inputs)} PaTH layers, {args.length} tokens of {args.data}; {info['cpu']},")
    print(f"# torch.set_num_threads({args.threads}), commit {info['commit']}; median of {args.reps} after a warm-up;")
    print(f"# load average at start {info['loadavg_start']}.\n")
    base = statistics.median(times["float32"])
    print("| attention inputs | s (all layers) | vs float32 | relative error vs float64, per layer |")
    print("|---|---|---|---|")
    for name in variants:
        median = statistics.median(times[name])
        layer_errors = ", ".join(f"{e[name]:.1e}" for e in errors)
        print(f"| {name} | {median:.2f} | {median / base:.2f}x | {layer_errors} |")
    sdpa = ", ".join(f"{e['SDPA bfloat16 (no PaTH)']:.1e}" for e in errors)
    print(f"| SDPA in bfloat16, same q, k, v (no PaTH) | - | - | {sdpa} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "times_s": times, "errors": errors}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"# JSON: {args.out}")


if __name__ == "__main__":
    main()
