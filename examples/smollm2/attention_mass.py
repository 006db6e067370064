# Copyright 2026 The path-hf authors. Apache-2.0.
"""Where attention goes at long range: the mass on the first token and on far keys, per model and layer.

```
OMP_NUM_THREADS=1 python examples/smollm2/attention_mass.py \\
    --model source=runs/smollm2/download/SmolLM2-135M-Instruct.Q4_1.gguf --model PaTH=runs/smollm2/train/final \\
    --data examples/default_model/data/eval.jsonl.xz --length 32768 --far 8192 --queries 16 \\
    --output runs/smollm2/attention_mass.json
```

Each `--model [LABEL=]PATH` (a checkpoint directory, a hub id or a .gguf file, loaded as `path-hf eval` loads it:
`path_hf.loading`) reads the first `--length` T tokens of `--data` in its own tokenizer (`read_texts`,
`tokenize_stream`, as `path-hf eval` reads them). `path_hf.evaluation.attention_mass` then measures, at each of the
last `--queries` Q positions i of that window and for every layer, the attention probability on the first token
(`sink_mass`) and on the keys more than `--far` F positions back, `0 < j < i - F` (`far_mass`), exactly: the first
T - Q tokens are prefilled into a cache and each of the last Q is a decode step that returns its row of probabilities
(PaTH layers from their decode step, RoPE layers with eager attention). Means over the heads and the Q positions per
layer, the per-head values beside them, and the mean over the layers per model.

Writes the JSON (`--output`: the models, their layers, the protocol; paths relative to the repository when inside
it) and prints a Markdown table, one row a model: the mean masses, and the layer and the head that put the most
mass on far keys.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

import torch

import path_hf  # noqa: F401  (registers PaTHLlama with the Auto classes)
from path_hf.arguments import DTYPES
from path_hf.atomic import atomic_file
from path_hf.errors import CommandError
from path_hf.evaluation import ModelSpec, attention_mass, model_train_length, read_texts, rope_scaling, tokenize_stream
from path_hf.loading import load_causal_lm, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def shown(path: str | Path) -> str:
    """`path` relative to the repository when it is inside it, absolute when it is outside; a hub id as it is."""
    local = Path(path).expanduser()
    if not local.exists():
        return str(path)
    local = local.resolve()
    return str(local.relative_to(ROOT)) if local.is_relative_to(ROOT) else str(local)


def parse_model(spec: str) -> ModelSpec:
    """`[LABEL=]PATH[@ROPE[:FACTOR]]`, as `path-hf eval --model` takes it."""
    return ModelSpec.parse(spec)


def scaled(model, spec: ModelSpec, length: int):
    """The RoPE scaling of `spec` swapped in, as `path-hf eval` does it: without a FACTOR, YaRN and linear use
    length / training length, dynamic NTK 1; a plain spec changes nothing."""
    if spec.rope_scaling is None:
        return contextlib.nullcontext(model)
    return rope_scaling(model, spec.rope_scaling, spec.factor_at(length, model_train_length(model.config)))


def measure(spec: ModelSpec, texts: list[str], args: argparse.Namespace) -> dict:
    """`attention_mass` of one model on the first `args.length` tokens of `texts` in its tokenizer."""
    tokenizer = load_tokenizer(args.tokenizer or spec.path, trust_remote_code=args.trust_remote_code)
    stream = tokenize_stream(texts, tokenizer, max_tokens=args.length)
    if len(stream) < args.length:
        raise ValueError(
            f"--data holds {len(stream)} tokens for {spec.label}'s tokenizer, fewer than --length {args.length}"
        )
    model = load_causal_lm(spec.path, getattr(torch, args.dtype), trust_remote_code=args.trust_remote_code)
    model = model.to(args.device)
    try:
        with scaled(model, spec, args.length):
            result = attention_mass(model, torch.tensor([stream]), far=args.far, queries=args.queries)
    finally:
        del model
        gc.collect()
    return {
        "label": spec.label,
        "path": shown(spec.path),
        "rope_scaling": spec.rope_scaling,
        "sink_mass": result["sink_mass"],
        "far_mass": result["far_mass"],
        "layers": result["layers"],
    }


def table(results: list[dict]) -> str:
    """A Markdown table, one row a model: the masses averaged over its layers, and where the far mass is largest."""
    rows = [
        "| model | layers | sink mass | far mass | most far: layer (mass) | most far: head layer.head (mass) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        layers = result["layers"]
        top_layer = max(layers, key=lambda layer: layer["far_mass"])
        layer, head, mass = max(
            ((entry["layer"], head, mass) for entry in layers for head, mass in enumerate(entry["far_mass_per_head"])),
            key=lambda item: item[2],
        )
        rows.append(
            f"| {result['label']} | {len(layers)} | {result['sink_mass']:.3g} | {result['far_mass']:.3g} | "
            f"{top_layer['layer']} ({top_layer['far_mass']:.3g}) | {layer}.{head} ({mass:.3g}) |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Measure every `--model`, print the table, write the JSON if asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", action="append", required=True, metavar="[LABEL=]PATH", help="a model to measure (repeatable)"
    )
    parser.add_argument("--data", nargs="+", required=True, metavar="FILE", help="text files, as path-hf eval reads")
    parser.add_argument("--text-field", default="text", help="the text column of JSON / parquet records")
    parser.add_argument("--length", type=int, required=True, metavar="T", help="the window: its first T tokens")
    parser.add_argument("--far", type=int, default=8192, metavar="F", help="far: more than F back (default: 8192)")
    parser.add_argument("--queries", type=int, default=16, metavar="Q", help="last positions measured (default: 16)")
    parser.add_argument("--tokenizer", help="the tokenizer of every model (default: each model's own)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the models (default: float32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow code shipped with a checkpoint")
    parser.add_argument("--output", type=Path, metavar="JSON", help="write every number here")
    args = parser.parse_args(argv)
    try:
        if args.length < 2 or not 1 <= args.queries < args.length or args.far < 0:
            raise ValueError(
                f"--length {args.length}, --queries {args.queries}, --far {args.far}: need T >= 2, 1 <= Q < T "
                "and F >= 0"
            )
        if args.output is not None and not args.output.resolve().parent.is_dir():
            raise ValueError(f"--output {args.output}: its directory does not exist")
        specs = [parse_model(spec) for spec in args.model]
        texts = read_texts(args.data, args.text_field)
        results = []
        for spec in specs:
            results.append(measure(spec, texts, args))
            print(f"{spec.label}: sink {results[-1]['sink_mass']:.4g}, far {results[-1]['far_mass']:.4g}", flush=True)
    except (OSError, ValueError, CommandError) as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)  # one line
        return 1
    print(table(results))
    if args.output is not None:
        report = {
            "data": [shown(path) for path in args.data],
            "length": args.length,
            "far": args.far,
            "queries": args.queries,
            "dtype": args.dtype,
            "models": results,
        }
        with atomic_file(args.output) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
