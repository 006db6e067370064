# Copyright 2026 The path-hf authors. Apache-2.0.
"""The source as a hybrid, without training: some layers local (a sliding window, RoPE unscaled), the others global.

```
OMP_NUM_THREADS=1 python -m lab.smollm2.local_layers \\
    --model runs/smollm2/download/SmolLM2-135M-Instruct.Q4_1.gguf --data examples/data/austen/train.jsonl.xz \\
    --length 16384 --window 8192 --global-every 4 --yarn 2 --output runs/smollm2/local-every4.json
```

The hybrid-layers idea keeps RoPE, in distribution, in local layers that never look further back than
the source's context, and leaves long range to a few global layers. This measures its local half on the source model
itself, before any PaTH layer or training is involved: every layer outside the global ones attends to the last
`--window` W keys only, itself included (Mistral's `sliding_window`: key j is seen from query i when 0 <= i - j < W),
plus the first `--sinks` N keys (StreamingLLM's attention sinks): at their own positions, or with `--renumber-sinks`
renumbered as StreamingLLM's cache does, as if they stood just before the window (a query i sees sink s at distance
`min(i, W - 1 + N) - s`, never further than the window reaches, so no distance is out of distribution). The
global layers (every `--global-every`-th layer, counting from the last of each group, or `--global-layers`) attend to
every earlier key with YaRN of factor `--yarn` on their RoPE (transformers' YaRN, as `path-hf eval` applies it), or
plain RoPE without `--yarn`. With no global layer every layer is local; with every layer global and `--yarn` it is
the source with YaRN, as `path-hf eval --model PATH@yarn:FACTOR` measures it.

The first `--length` tokens of `--data` (read and tokenized as `path-hf eval` reads them) are one window, and every
token after the first is scored. Prints the perplexity of the window and of its halves (the first half is the plain
source whenever W >= length / 2) and writes them, with the CPU minutes, to `--output`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import path_hf  # noqa: F401  (registers PaTHLlama with the Auto classes)
from examples.smollm2.attention_mass import shown  # paths relative to the repository
from path_hf.atomic import atomic_file
from path_hf.errors import CommandError
from path_hf.evaluation import read_texts, rope_parameters_for, tokenize_stream
from path_hf.loading import load_causal_lm, load_tokenizer
from path_hf.local_attention import local_attention


def local_mask(length: int, window: int, sinks: int = 0) -> torch.Tensor:
    """`[1, 1, T, T]` bool, True where query i sees key j: causal, and `i - j < window` or j among the first
    `sinks` keys."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None]
    return ((j <= i) & ((i - j < window) | (j < sinks)))[None, None]


# The attention of this script's hybrids: SDPA, except in local layers with renumbered sinks (`renumbered_sinks`).
ATTENTION = "local_layers_sdpa"
BLOCK = 1024  # queries at a time in renumbered_sink_attention


def renumbered_sink_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    window: int | None = None,
    sinks: int = 0,
    inv_freq: torch.Tensor | None = None,
    block: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: SDPA, or, given a `window`, the window of the last `window` keys plus the
    first `sinks` keys renumbered as in StreamingLLM's cache: `path_hf.local_attention`, what a PaTHLlama's local
    layers (`local_window`, `local_sinks`) compute, on one unpadded sequence a row.

    q, k `[B, H, S, D]` come rotated by RoPE at their own positions (`inv_freq`: the layer's unscaled frequencies).
    A sink s outside the window of query i is seen at distance `min(i, window - 1 + sinks) - s`. Queries in blocks of
    `block` (default `BLOCK`), so nothing of size S x S is formed."""
    if window is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    positions = torch.arange(query.shape[2], device=query.device).expand(query.shape[0], -1)
    output = local_attention(
        query, key, value, positions, positions, window=window, sinks=sinks, inv_freq=inv_freq, scaling=scaling,
        block=block or BLOCK,
    )  # fmt: skip
    return output.contiguous(), None


AttentionInterface.register(ATTENTION, renumbered_sink_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def global_layers(num_layers: int, every: int | None, listed: list[int] | None) -> list[int]:
    """The global layers: `listed`, or the last of each group of `every` (every 4 of 30: 3, 7, ..., 27); none if
    neither is given."""
    if listed is not None:
        outside = [layer for layer in listed if not 0 <= layer < num_layers]
        if outside:
            raise ValueError(f"--global-layers {outside}: the model has layers 0 to {num_layers - 1}")
        return sorted(set(listed))
    if every is None:
        return []
    return [layer for layer in range(num_layers) if layer % every == every - 1]


def hybrid(
    model: nn.Module,
    length: int,
    window: int,
    sinks: int,
    globals_: list[int],
    yarn: float | None,
    renumber_sinks: bool = False,
):
    """Forward pre-hooks on `model`'s decoder layers: local layers get the sliding-window mask (or, with
    `renumber_sinks`, `renumbered_sink_attention`), global ones full causal attention (no mask: SDPA's causal path)
    and, with `yarn`, YaRN's cos / sin. Returns the hook handles."""
    layers = model.model.layers
    rotary = model.model.rotary_emb
    global_rope = None
    if yarn is not None:
        config = type(model.config).from_dict(model.config.to_dict())
        config.rope_parameters = rope_parameters_for(config, "yarn", yarn)
        positions = torch.arange(length)[None]
        global_rope = type(rotary)(config)(torch.zeros(1, dtype=next(model.parameters()).dtype), positions)
    if renumber_sinks:
        model.set_attn_implementation(ATTENTION)
        local = {"attention_mask": None, "window": window, "sinks": sinks, "inv_freq": rotary.inv_freq}
    else:
        local = {"attention_mask": local_mask(length, window, sinks)}

    def local_hook(module, args, kwargs):
        return args, {**kwargs, **local}

    def global_hook(module, args, kwargs):
        kwargs = {**kwargs, "attention_mask": None}
        if global_rope is not None:
            kwargs["position_embeddings"] = global_rope
        return args, kwargs

    return [
        layer.register_forward_pre_hook(global_hook if index in globals_ else local_hook, with_kwargs=True)
        for index, layer in enumerate(layers)
    ]


@torch.no_grad()
def token_nll(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """`[T - 1]` negative log-likelihood of every token after the first."""
    logits = model(input_ids).logits[0, :-1].float()
    return nn.functional.cross_entropy(logits, input_ids[0, 1:], reduction="none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the source: a checkpoint directory, a hub id or a .gguf file")
    parser.add_argument("--data", nargs="+", required=True, metavar="FILE", help="text files, as path-hf eval reads")
    parser.add_argument("--text-field", default="text", help="the text column of JSON / parquet records")
    parser.add_argument("--length", type=int, required=True, metavar="T", help="the window: the first T tokens")
    parser.add_argument(
        "--window", type=int, required=True, metavar="W", help="keys a local layer sees, itself included"
    )
    parser.add_argument("--sinks", type=int, default=0, metavar="N", help="first keys every local layer also sees")
    parser.add_argument(
        "--renumber-sinks", action="store_true", help="sinks renumbered into the window, as in StreamingLLM's cache"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--global-every", type=int, metavar="K", help="every K-th layer is global (K = 1: all)")
    group.add_argument("--global-layers", type=int, nargs="+", metavar="I", help="the global layers' indices")
    parser.add_argument("--yarn", type=float, metavar="FACTOR", help="YaRN of this factor on the global layers")
    parser.add_argument("--output", type=Path, metavar="JSON", help="write the numbers here")
    args = parser.parse_args(argv)
    try:
        if args.length < 4 or args.window < 1 or args.sinks < 0 or (args.global_every or 1) < 1:
            raise ValueError(
                f"--length {args.length}, --window {args.window}, --sinks {args.sinks}, --global-every "
                f"{args.global_every}: need T >= 4, W >= 1, N >= 0 and K >= 1"
            )
        if args.output is not None and not args.output.resolve().parent.is_dir():
            raise ValueError(f"--output {args.output}: its directory does not exist")
        tokenizer = load_tokenizer(args.model)
        stream = tokenize_stream(read_texts(args.data, args.text_field), tokenizer, max_tokens=args.length)
        if len(stream) < args.length:
            raise ValueError(f"--data holds {len(stream)} tokens, fewer than --length {args.length}")
        model = load_causal_lm(args.model, torch.float32)
        model.set_attn_implementation("sdpa")
        globals_ = global_layers(len(model.model.layers), args.global_every, args.global_layers)
        hybrid(model, args.length, args.window, args.sinks, globals_, args.yarn, args.renumber_sinks)
        started = time.process_time()
        nll = token_nll(model, torch.tensor([stream]))
        cpu_minutes = (time.process_time() - started) / 60
    except (OSError, ValueError, CommandError) as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)  # one line
        return 1
    half = args.length // 2 - 1  # scored tokens 1 .. T/2 - 1 are the first half
    report = {
        "model": shown(args.model),
        "data": [shown(path) for path in args.data],
        "length": args.length,
        "window": args.window,
        "sinks": args.sinks,
        "renumber_sinks": args.renumber_sinks,
        "global_layers": globals_,
        "yarn": args.yarn,
        "ppl": math.exp(nll.mean()),
        "ppl_first_half": math.exp(nll[:half].mean()),
        "ppl_second_half": math.exp(nll[half:].mean()),
        "cpu_minutes": round(cpu_minutes, 2),
    }
    print(
        f"global layers {globals_ or 'none'}, window {args.window}, sinks {args.sinks}"
        f"{' renumbered' if args.renumber_sinks else ''}, YaRN {args.yarn}: "
        f"ppl {report['ppl']:.3f} (halves {report['ppl_first_half']:.3f} / {report['ppl_second_half']:.3f}), "
        f"{cpu_minutes:.1f} CPU min"
    )
    if args.output is not None:
        with atomic_file(args.output) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
