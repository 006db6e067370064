# Copyright 2026 The path-hf authors. Apache-2.0.
"""How far a model's logits in bfloat16 are from its logits in float32, on the same token windows.

```
OMP_NUM_THREADS=1 python examples/smollm2/precision.py /work/cache/smollm2-hf runs/smollm2/recovered \
    --data examples/default_model/data/eval.jsonl.xz --length 512 --windows 4 --json precision.json
```

Each model is loaded twice with `from_pretrained(..., dtype=...)`, in float32 (the reference) and in bfloat16, and
both score the same non-overlapping windows of the text. Per position p, with `r` the reference logits and `t` the
bfloat16 logits (upcast to float32) over the vocabulary:

- spread_p = std over the vocabulary of r (the population std); `spread` is its mean over positions;
- `max_abs_diff` = max over positions and vocabulary of |t - r|, and `max_diff_over_spread` = `max_abs_diff` / `spread`;
- `mean_max_diff_over_spread` = the mean over positions of max_v |t - r| / spread_p;
- `top1_agreement` = the fraction of positions where argmax t = argmax r;
- `kl` = the mean over positions of KL(softmax r || softmax t), in nats;
- `entropy` = the mean over positions of the reference's predictive entropy (nats): near log(vocab) means near-uniform
  predictions, whose logits have a small spread.

The maxima come from one position, often the first of a window: SmolLM2 holds a ~2e4 activation in that token's hidden
state, where bfloat16's step is 128. The per-position mean, the KL and the top-1 agreement are the steadier measures.

The logits are `lm_head(decoder(...).last_hidden_state)`, what Llama's and PaTHLlama's causal-LM heads compute, formed
`positions_per_chunk` positions at a time, so memory stays O(length * hidden + chunk * vocab).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import path_hf  # noqa: F401  (registers PaTHLlama with the Auto classes)
from path_hf.arguments import DTYPES
from path_hf.errors import CommandError
from path_hf.evaluation import read_texts, tokenize_stream
from path_hf.loading import load_causal_lm, load_tokenizer


def _hidden_states(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The final hidden states `[B, T, hidden]` of a causal LM, before its `lm_head`."""
    return model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state


@torch.no_grad()
def logit_drift(
    reference: nn.Module,
    model: nn.Module,
    windows: torch.Tensor,
    positions_per_chunk: int = 256,
) -> dict:
    """Compare the logits of `model` with those of `reference` (same vocabulary) on `windows` `[N, T]` of token ids.

    Both models are run one window at a time, in eval mode, without a cache. Returns the statistics the module
    docstring defines (`max_abs_diff`, `mean_abs_diff`, `spread`, `max_diff_over_spread`, `mean_max_diff_over_spread`,
    `top1_agreement`, `kl`, `entropy`) and `positions`, the number of positions compared.
    """
    if windows.ndim != 2 or windows.numel() == 0:
        raise ValueError(f"windows must be a non-empty [N, T] tensor of token ids, got shape {tuple(windows.shape)}")
    if positions_per_chunk < 1:
        raise ValueError(f"positions_per_chunk must be a positive integer, got {positions_per_chunk}")
    reference_head, head = reference.get_output_embeddings(), model.get_output_embeddings()
    if reference_head.weight.shape != head.weight.shape:
        raise ValueError(
            f"the two models' lm_heads differ in shape ({tuple(reference_head.weight.shape)} vs "
            f"{tuple(head.weight.shape)}): compare models with the same vocabulary"
        )
    was_training = reference.training, model.training
    reference.eval(), model.eval()
    max_abs = sum_abs = spread_sum = ratio_sum = kl_sum = entropy_sum = 0.0
    agree = positions = 0
    try:
        for input_ids in windows:
            input_ids = input_ids[None].to(next(reference.parameters()).device)
            h_ref = _hidden_states(reference, input_ids)[0]
            h = _hidden_states(model, input_ids.to(next(model.parameters()).device))[0]
            for start in range(0, input_ids.shape[1], positions_per_chunk):
                r = reference_head(h_ref[start : start + positions_per_chunk]).float()
                t = head(h[start : start + positions_per_chunk]).float().to(r.device)
                diff = (t - r).abs()
                row_max = diff.amax(-1)
                spread = r.std(-1, correction=0)
                log_p, log_q = r.double().log_softmax(-1), t.double().log_softmax(-1)
                p = log_p.exp()
                max_abs = max(max_abs, row_max.max().item())
                sum_abs += diff.double().sum().item()
                spread_sum += spread.double().sum().item()
                ratio_sum += (row_max / spread).double().sum().item()
                kl_sum += (p * (log_p - log_q)).sum().item()
                entropy_sum += -(p * log_p).sum().item()
                agree += int((r.argmax(-1) == t.argmax(-1)).sum())
                positions += r.shape[0]
    finally:
        reference.train(was_training[0]), model.train(was_training[1])
    spread = spread_sum / positions
    return {
        "positions": positions,
        "max_abs_diff": max_abs,
        "mean_abs_diff": sum_abs / (positions * reference_head.weight.shape[0]),
        "spread": spread,
        "max_diff_over_spread": max_abs / spread,
        "mean_max_diff_over_spread": ratio_sum / positions,
        "top1_agreement": agree / positions,
        "kl": kl_sum / positions,
        "entropy": entropy_sum / positions,
    }


def token_windows(token_ids: Sequence[int] | torch.Tensor, length: int, windows: int) -> torch.Tensor:
    """The first `windows` non-overlapping windows of `length` tokens of one token stream, `[windows, length]`."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if length < 1 or windows < 1:
        raise ValueError(f"length and windows must be positive, got length={length}, windows={windows}")
    if len(token_ids) < length * windows:
        raise ValueError(
            f"{windows} windows of {length} tokens need {length * windows} tokens, the text has {len(token_ids)}: "
            "give more text, fewer windows or a shorter length"
        )
    return token_ids[: length * windows].view(windows, length)


def precision_drift(
    model_path: str | Path,
    token_ids: Sequence[int] | torch.Tensor,
    length: int,
    windows: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    reference_dtype: torch.dtype = torch.float32,
    positions_per_chunk: int = 256,
    weights_only: bool = False,
) -> dict:
    """How far `model_path` loaded in `dtype` is from the same model loaded in `reference_dtype`, on the first
    `windows` non-overlapping windows of `length` tokens of `token_ids` (one stream).

    Any causal LM that `path_hf.loading.load_causal_lm` loads works (a checkpoint of a Llama or a PaTHLlama, or a
    GGUF file). Returns `logit_drift`'s statistics, plus `model`, `dtype`, `reference_dtype`,
    `length`, `windows` and `weights_only`.

    `weights_only`: the compared model computes in `reference_dtype` with its weights rounded to `dtype` (and back),
    which separates what rounding the weights does from what computing in `dtype` does.
    """
    batch = token_windows(token_ids, length, windows)
    reference = load_causal_lm(str(model_path), reference_dtype)
    if weights_only:
        model = load_causal_lm(str(model_path), reference_dtype)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(dtype).to(reference_dtype))
    else:
        model = load_causal_lm(str(model_path), dtype)
    drift = logit_drift(reference, model, batch, positions_per_chunk)
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return {
        "model": str(model_path),
        "dtype": name(dtype),
        "reference_dtype": name(reference_dtype),
        "length": length,
        "windows": windows,
        "weights_only": weights_only,
        **drift,
    }


COLUMNS = (
    ("length", "{}"),
    ("max_abs_diff", "{:.3f}"),
    ("mean_abs_diff", "{:.4f}"),
    ("spread", "{:.3f}"),
    ("max_diff_over_spread", "{:.3f}"),
    ("mean_max_diff_over_spread", "{:.3f}"),
    ("top1_agreement", "{:.4f}"),
    ("kl", "{:.2e}"),
    ("entropy", "{:.2f}"),
)


def table(results: Sequence[dict]) -> str:
    """A Markdown table of `precision_drift` results, one row each."""
    header = ["model", *(name for name, _ in COLUMNS)]
    rows = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for result in results:
        cells = [result["model"], *(fmt.format(result[name]) for name, fmt in COLUMNS)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Measure the bfloat16 drift of each model on a text and print a Markdown table (and write JSON if asked)."""
    default_data = Path(__file__).resolve().parents[1] / "default_model" / "data" / "eval.jsonl.xz"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="model directories (or hub ids), each with its tokenizer")
    parser.add_argument("--data", nargs="+", default=[str(default_data)], help="text files (default: %(default)s)")
    parser.add_argument("--length", type=int, nargs="+", default=[512], help="window lengths (default: 512)")
    parser.add_argument("--windows", type=int, default=1, help="windows per length (default: 1)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype compared (default: bf16)")
    parser.add_argument(
        "--weights-only", action="store_true", help="compute in float32 with the weights rounded to --dtype"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        texts = read_texts(args.data)
        results = []
        for model in args.models:
            stream = tokenize_stream(texts, load_tokenizer(str(model)), max_tokens=max(args.length) * args.windows)
            for length in args.length:
                result = precision_drift(
                    model, stream, length, args.windows, getattr(torch, args.dtype), weights_only=args.weights_only
                )
                print(json.dumps(result), flush=True)
                results.append(result)
    except (OSError, ValueError, CommandError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # one line
        return 1
    print(table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
