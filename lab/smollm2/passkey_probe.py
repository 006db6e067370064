# Copyright 2026 The path-hf authors. Apache-2.0.
"""Why a model misses a passkey: the answer's log-likelihood, not only the verdict, under variants of one model.

```
OMP_NUM_THREADS=1 python -m lab.smollm2.passkey_probe --model runs/smollm2/long/final --length 16384 \
    --depths 0.9 --variant yarn:1.5 --variant plain --variant yarn:1.5,path_window:8192 --output probe.json
```

Each prompt is one of `path-hf eval --passkey-trials`' (`passkey_windows`, the same seed), and gets its verdict, the
key's mean negative log-likelihood per token (`passkey_nll` in `path-hf eval`'s JSON), the same per token and the
greedy token at each answer position, under model variants that `path-hf eval` cannot make. A variant is a
comma-separated list of changes, applied in order, for its prompts only:

- `plain`: the model as it is;
- `yarn:F`: YaRN with factor F on the model's RoPE (`rope_scaling`, as `path-hf eval --model ...@yarn:F` applies it;
  a hybrid's local layers keep theirs);
- `path_window:W`: every PaTH layer's attention cut to the keys at most about W tokens back. The torch backend walks
  only the first ceil(W / C) block diagonals of C-token chunks, so a query sees between W and W + C - 1 keys back,
  and no sink. A diagnosis, not a model: nothing in the checkpoint or the config changes;
- `path_window_sink:W`: the same window, and every query also sees the first C tokens (the PaTH layers' sink);
- `temperature:S`: the log-length attention temperature of the PaTH layers (`path_attn_temperature_scale`), past
  the model's `max_position_embeddings`;
- `local_window:W`: a hybrid's local layers see the last W keys (and their sinks) instead of `local_window`;
- `gate_scale:S`: every PaTH layer's log forget gate multiplied by S (its decay a token, and so the attenuation of a
  key T tokens back, `exp(S * sum(log g))`): 0 removes the gate, 0.1 lets keys reach ten times as far.

Each variant runs every prompt in one forward pass; one process at one thread, as the screens run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from path_hf.evaluation import IGNORE_INDEX, Window, passkey_windows, rope_scaling
from path_hf.evaluation.scoring import position_logits
from path_hf.loading import load_causal_lm, load_tokenizer

# The torch backend's walk over its C-token chunks themselves, not over pairs of them (`walk_merges`), and over the
# whole sequence, not within superblocks (`superblock_tokens`): the windows below count whole chunks of C.
CHUNK_WALK = {"walk_merges": 0, "superblock_tokens": 0}


@contextlib.contextmanager
def chunk_options(model, **options) -> Iterator[None]:
    """`options` added to every PaTH layer's `chunk_options` for the block: keyword arguments of the torch backend's
    `chunk_path_attention`, which the layer passes to `path_attention` (and then runs the torch backend)."""
    layers = [module for module in model.modules() if hasattr(module, "chunk_options")]
    if not layers:
        raise SystemExit("error: path_window needs a model whose PaTH layers take chunk_options (path_hf's own code)")
    before = [layer.chunk_options for layer in layers]
    for layer, kept in zip(layers, before, strict=True):
        layer.chunk_options = {**kept, **options}
    try:
        yield
    finally:
        for layer, kept in zip(layers, before, strict=True):
            layer.chunk_options = kept


def path_window(model, window: int) -> contextlib.AbstractContextManager[None]:
    """The torch backend's PaTH attention cut to the last `window` tokens (rounded up to whole chunks) in the block:
    the walk stops after ceil(W / C) block diagonals (`chunk_path_attention`'s `window`)."""
    return chunk_options(model, **CHUNK_WALK, window=window)


def path_window_sink(model, window: int) -> contextlib.AbstractContextManager[None]:
    """`path_window`, and every query also sees the block's first chunk (its sink): the walk goes on to the end, but
    past ceil(W / C) block diagonals only the pair (query chunk d, key chunk 0) of step d keeps its scores
    (`chunk_path_attention`'s `window_sink`)."""
    return chunk_options(model, **CHUNK_WALK, window=window, window_sink=True)


@contextlib.contextmanager
def config_field(model, name: str, value) -> Iterator[None]:
    """`model.config.<name>` set to `value` for the block (the layers read it at every forward)."""
    before = getattr(model.config, name)
    setattr(model.config, name, value)
    try:
        yield
    finally:
        setattr(model.config, name, before)


def gate_gains(model) -> list[torch.nn.Module]:
    """The `g_gain` of every PaTH layer with a forget gate: its output is the layer's log gate."""
    return [module.g_gain for module in model.modules() if getattr(module, "g_gain", None) is not None]


@contextlib.contextmanager
def gate_scale(model, scale: float) -> Iterator[None]:
    """Every PaTH layer's log forget gate (the output of its `g_gain`) multiplied by `scale` for the block."""
    gains = gate_gains(model)
    if not gains:
        raise SystemExit("error: gate_scale needs a model with a forget gate (path_forget_gate)")
    handles = [gain.register_forward_hook(lambda module, args, output: output * scale) for gain in gains]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def applied(model, variant: str, original_length: int) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for change in variant.split(","):
        name, _, value = change.partition(":")
        if name == "plain":
            continue
        if name == "yarn":
            stack.enter_context(rope_scaling(model, "yarn", float(value), original_length))
        elif name == "path_window":
            stack.enter_context(path_window(model, int(value)))
        elif name == "path_window_sink":
            stack.enter_context(path_window_sink(model, int(value)))
        elif name == "temperature":
            stack.enter_context(config_field(model, "path_attn_temperature_scale", float(value)))
        elif name == "local_window":
            stack.enter_context(config_field(model, "local_window", int(value)))
        elif name == "gate_scale":
            stack.enter_context(gate_scale(model, float(value)))
        else:
            raise SystemExit(
                f"error: unknown variant change {change!r}: use plain, yarn:F, path_window:W, path_window_sink:W, "
                "temperature:S, local_window:W, gate_scale:S"
            )
    return stack


def key_gate(log_gates: list[torch.Tensor], input_ids: torch.Tensor, answer: torch.Tensor) -> list[list[float]] | None:
    """For each PaTH layer and head, the summed log forget gate between the key's last digit in the needle and the
    last position before the answer: what the gate adds to the logit of the question's last query for that key
    (`G_i - G_j`), 0 when nothing decays. `None` when the needle's digits are not found as the answer's tokens."""
    digits, ids = answer[1:].tolist(), input_ids.tolist()
    starts = [i for i in range(len(ids) - len(answer)) if ids[i : i + len(digits)] == digits]
    if not starts or not log_gates:
        return None
    key_end, last = starts[0] + len(digits) - 1, len(ids) - len(answer) - 1
    return [[round(x, 2) for x in g[0, key_end + 1 : last + 1].sum(0).tolist()] for g in log_gates]


@torch.no_grad()
def probe(model, tokenizer, window: Window) -> dict:
    """One prompt, one forward pass with logits at the answer's positions only (`position_logits`): the verdict, the
    key's mean negative log-likelihood per token (what `answer_scores` gives), the same per token, what greedy
    decoding would put at each answer position given the right tokens before it, and, for a model with a forget
    gate, each PaTH layer's summed log gate per head from the key to the question (`key_gate`)."""
    input_ids, labels = window.input_ids[None], window.labels[None]
    scored = labels[:, 1:] != IGNORE_INDEX  # position t predicts the label at t + 1
    positions = torch.zeros_like(labels, dtype=torch.bool)
    positions[:, :-1] = scored
    log_gates: list[torch.Tensor] = []
    gains = gate_gains(model)
    handles = [gain.register_forward_hook(lambda module, args, output: log_gates.append(output)) for gain in gains]
    try:
        logits = position_logits(model, input_ids, torch.ones_like(input_ids), positions, "cpu").float()
    finally:
        for handle in handles:
            handle.remove()
    answer = labels[:, 1:][scored]
    nll = torch.nn.functional.cross_entropy(logits, answer, reduction="none")
    predicted = logits.argmax(-1)
    report = {
        "correct": bool((predicted == answer).all()),
        "answer_nll": nll.mean().item(),
        "answer_nll_per_token": [round(x, 4) for x in nll.tolist()],
        "answer": [tokenizer.decode(token) for token in answer],
        "greedy": [tokenizer.decode(token) for token in predicted],
    }
    if (gate := key_gate(log_gates, window.input_ids, answer)) is not None:
        report["key_gate"] = gate
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--variant", action="append", required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    model = load_causal_lm(args.model, torch.float32).eval()
    tokenizer = load_tokenizer(args.model)
    depths = [float(depth) for depth in args.depths.split(",")]
    windows = passkey_windows(tokenizer, args.length, args.trials, 0, depths)
    original = model.config.max_position_embeddings
    report = {"model": args.model, "length": args.length, "variants": {}}
    if args.output.is_file():  # a rerun adds prompts and variants; the keys name each prompt's trial and depth
        report = json.loads(args.output.read_text())
        if (report["model"], report["length"]) != (args.model, args.length):
            raise SystemExit(
                f"error: {args.output} holds {report['model']} at {report['length']}: give another --output"
            )
    for variant in args.variant:
        rows = report["variants"].setdefault(variant, {})
        for index, window in enumerate(windows):
            depth = str(depths[index % len(depths)])
            key = f"trial{index // len(depths)}@{depth}"
            if key in rows:
                continue
            started = time.process_time()
            with applied(model, variant, original):
                rows[key] = probe(model, tokenizer, window)
            rows[key]["cpu_minutes"] = round((time.process_time() - started) / 60, 2)
            print(variant, key, json.dumps(rows[key]), flush=True)
            args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
