# Copyright 2026 The path-hf authors. Apache-2.0.
"""Which of the source's layers retrieve from far back: the passkey's likelihood when only some layers are global.

```
OMP_NUM_THREADS=1 python -m lab.smollm2.retrieval_layers \\
    --model runs/smollm2/download/SmolLM2-135M-Instruct.Q4_1.gguf --length 8192 --window 2048 --depths 0.1 \\
    --rows all none every4 only:0-29 --output runs/retrieval-layers/only.json
```

A hybrid leaves every dependency further back than its local window to its global layers. This asks, of the source
itself and without training, which layers those must be for retrieval: every layer outside a row's global ones sees
only the last `--window` keys and the first `--sinks` (`local_layers.py`'s `hybrid`: Mistral's sliding window, RoPE
unscaled), and each passkey prompt of `path-hf eval` (`passkey_windows`, seed 0, trial 0, the key at `--depths`)
gets the key's mean negative log-likelihood per token (`answer_scores`) and its verdict. A row is `all` (the source),
`none` (every layer local), `every4` (layers 3, 7, ..., 27: the shipped hybrid's PaTH layers), `only:I` (layer I
alone global), `only:I-J` (one row per layer of the range), `without:I` / `without:I-J` (every layer but I global),
or `layers:I+J+...` (those layers global). Rows already in `--output` are kept (a rerun resumes).

With `--heads`, instead of rows: where each head of the source (every layer global) looks when it writes the key,
prompt by prompt (`--trials` keys at each depth): `path_hf.evaluation.needle_mass`, the attention probability on the
needle's tokens at each position that predicts one of the answer's tokens (one decode step a position, exact),
averaged over those positions, per layer and head. Retrieval heads are those with most mass. `path-hf convert
--retrieval-layers N` measures the same, averaged over its prompts, and keeps the N layers with the strongest heads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import path_hf  # noqa: F401  (registers PaTHLlama with the Auto classes)
from lab.smollm2.local_layers import hybrid
from path_hf.atomic import atomic_file
from path_hf.evaluation import answer_scores, needle_mass, needle_span, passkey_windows
from path_hf.loading import load_causal_lm, load_tokenizer


def expand(rows: list[str], num_layers: int) -> dict[str, list[int]]:
    """Row name -> its global layers."""
    every = list(range(num_layers))
    out: dict[str, list[int]] = {}
    for row in rows:
        kind, _, value = row.partition(":")
        if kind in ("all", "none", "every4") and not value:
            out[row] = {"all": every, "none": [], "every4": [i for i in every if i % 4 == 3]}[kind]
        elif kind in ("only", "without") and value:
            first, _, last = value.partition("-")
            for layer in range(int(first), int(last or first) + 1):
                if not 0 <= layer < num_layers:
                    raise SystemExit(f"error: row {row!r}: the model has layers 0 to {num_layers - 1}")
                out[f"{kind}:{layer}"] = [layer] if kind == "only" else [i for i in every if i != layer]
        elif kind == "layers" and value:
            out[row] = sorted({int(layer) for layer in value.split("+")})
        else:
            raise SystemExit(
                f"error: unknown row {row!r}: use all, none, every4, only:I[-J], without:I[-J], layers:I+J"
            )
    return out


def heads(model, tokenizer, windows: dict, output: Path, protocol: dict) -> None:
    report = {**protocol, "prompts": {}}
    for name, window in windows.items():
        started = time.process_time()
        mass = needle_mass(model, window, needle_span(tokenizer, window)).tolist()
        report["prompts"][name] = {
            "needle_mass": [[round(x, 4) for x in layer] for layer in mass],
            "cpu_minutes": round((time.process_time() - started) / 60, 2),
        }
        top = sorted(((max(layer), index) for index, layer in enumerate(mass)), reverse=True)[:8]
        print(name, " ".join(f"{index}:{value:.2f}" for value, index in top), flush=True)
        with atomic_file(output) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--window", type=int, help="keys a local layer sees (--rows)")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--depths", default="0.1,0.5")
    parser.add_argument("--rows", nargs="+")
    parser.add_argument("--heads", action="store_true", help="the needle's attention mass per head, not rows")
    parser.add_argument("--trials", type=int, default=1, help="keys a depth")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if bool(args.rows) == args.heads or (args.rows and args.window is None):
        raise SystemExit("error: give --rows and --window, or --heads")
    model = load_causal_lm(args.model, torch.float32).eval()
    model.set_attn_implementation("sdpa")
    tokenizer = load_tokenizer(args.model)
    depths = [float(depth) for depth in args.depths.split(",")]
    windows = passkey_windows(tokenizer, args.length, args.trials, 0, depths)
    names = [f"trial{i // len(depths)}@{depths[i % len(depths)]}" for i in range(len(windows))]
    if args.heads:
        protocol = {"model": args.model, "length": args.length, "depths": depths, "trials": args.trials}
        heads(model, tokenizer, dict(zip(names, windows, strict=True)), args.output, protocol)
        return
    rows = expand(args.rows, len(model.model.layers))
    protocol = {"model": args.model, "length": args.length, "window": args.window, "sinks": args.sinks}
    protocol |= {"depths": depths, "trials": args.trials}
    report = {**protocol, "rows": {}}
    if args.output.is_file():
        report = json.loads(args.output.read_text())
        if {key: report.get(key) for key in protocol} != protocol:
            raise SystemExit(f"error: {args.output} holds another protocol: give another --output")
    lengths = {len(window.input_ids) for window in windows}
    if len(lengths) != 1:
        raise SystemExit("error: the prompts differ in length; the local mask needs one")
    length = lengths.pop()
    for name, globals_ in rows.items():
        if name in report["rows"]:
            continue
        handles = hybrid(model, length, args.window, args.sinks, globals_, None)
        started = time.process_time()
        try:
            scores = answer_scores(model, windows, batch_size=1)
        finally:
            for handle in handles:
                handle.remove()
        report["rows"][name] = {
            "global_layers": globals_,
            "nll": {key: round(scores.nll_sum[i] / scores.tokens[i], 4) for i, key in enumerate(names)},
            "found": {key: scores.all_correct[i] for i, key in enumerate(names)},
            "cpu_minutes": round((time.process_time() - started) / 60, 2),
        }
        print(name, json.dumps(report["rows"][name]["nll"]), flush=True)
        with atomic_file(args.output) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
