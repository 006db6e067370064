# Copyright 2026 The path-hf authors. Apache-2.0.
"""Where attention goes at long range: the mass on the first token and on far keys, per layer and head.

```python
from path_hf.evaluation import attention_mass

result = attention_mass(model, input_ids, far=8192, queries=16)  # input_ids [B, T]: one long window per row
for layer in result["layers"]:
    print(layer["layer"], layer["type"], layer["sink_mass"], layer["far_mass"], layer["far_mass_per_head"])
```

For each of the last Q (`queries`) positions i of the window and each attention layer, it measures the attention
probabilities of the query at i over the keys 0..i:

- `sink_mass`: the probability on key 0, the first token (the "attention sink" of softmax attention);
- `far_mass`: the total probability on the keys more than F (`far`) positions back, `0 < j < i - F` (key 0 is left
  out: it is the sink, counted on its own); 0 where the window is too short to hold one.

Both are averaged over the Q positions and the batch, per head (`sink_mass_per_head`, `far_mass_per_head`: lists, so
a reader can see the heads that reach far), then over the heads (`sink_mass`, `far_mass`), and over the layers for the
model (the top-level `sink_mass`, `far_mass`).

The probabilities are exact, and no T x T matrix is formed: the first T - Q tokens are prefilled into a cache, then
the last Q tokens are fed one at a time, and at each of these decode steps every layer returns the one row of
probabilities of its single query over all the cached keys (`output_attentions=True`, `decode_attention_rows`):

- a PaTH layer (`PaTHLlamaAttention`) reads them off its decode step: `softmax(scale * (q . k_j + G_i - G_j))` over
  the cached keys, which the step has just moved through the new token's Householder transform, with the forget gate
  where FLA adds it (`_decode_attention_weights`);
- a RoPE layer (a transformers Llama, Qwen, ..., or a PaTHLlama's layers outside `path_layers`) runs its decode steps
  with transformers' eager attention, which returns its probabilities; the prefill keeps the model's own
  implementation (SDPA by default).
- a local layer (`PaTHLlamaLocalAttention`, `local_window`) returns its probabilities over every key seen, 0 on those
  outside its window and sinks (its cache no longer holds them).

The prefill costs what a forward pass of T - Q tokens costs; each decode step one query against T keys per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported by the model, not here (as the other metrics)
    from transformers import PreTrainedModel


@contextlib.contextmanager
def _eager_attention(model: PreTrainedModel) -> Iterator[None]:
    """Transformers' eager attention for the duration of the block (the implementation that returns attention
    probabilities); the model's own implementation is restored after it."""
    implementation = model.config._attn_implementation
    if implementation == "eager":
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(implementation)


def decode_attention_rows(
    model: PreTrainedModel, input_ids: torch.LongTensor, queries: int = 16
) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """The attention probabilities of each of the last `queries` positions of `input_ids`, one decode step each.

    The first `T - queries` tokens are prefilled into a cache with the model's own attention implementation; then each
    of the last `queries` tokens is one decode step with `output_attentions=True` under eager attention (see the
    module docstring). The model runs in eval mode; its mode and attention implementation are restored when the
    iteration ends (or the generator is closed).

    Args:
        model: a causal LM (`LlamaForCausalLM`, `PaTHLlamaForCausalLM`, ...) or its decoder; only the decoder runs
            (`model.base_model`), so no logits are formed.
        input_ids: `[B, T]` token ids, one window per row, no padding.
        queries: Q, the number of last positions measured, `1 <= Q < T`.

    Yields:
        `(i, rows)` for each query position i from `T - Q` to `T - 1`: `rows[l]` `[B, heads, 1, S]` is layer l's
        probabilities over its S = i + 1 cached keys, in the model's dtype.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    if not 1 <= queries < length:
        raise ValueError(
            f"queries must be at least 1 and below the window's {length} tokens (at least one is prefilled), "
            f"got {queries}"
        )
    return _decode_steps(model, input_ids.to(model.device), length - queries)


@torch.no_grad()
def _decode_steps(
    model: PreTrainedModel, input_ids: torch.LongTensor, prefix: int
) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """`decode_attention_rows` once its arguments are checked: prefill `prefix` tokens, then decode the rest."""
    decoder, layers = model.base_model, model.config.get_text_config().num_hidden_layers
    training = model.training
    model.eval()
    try:
        cache = decoder(input_ids=input_ids[:, :prefix], use_cache=True).cache
        with _eager_attention(model):
            for position in range(prefix, input_ids.shape[1]):
                output = decoder(
                    input_ids=input_ids[:, position : position + 1],
                    cache=cache,
                    use_cache=True,
                    output_attentions=True,
                )
                cache, rows = output.cache, output.attentions or ()
                if len(rows) != layers:
                    raise ValueError(
                        f"{type(model).__name__} returned the attention weights of {len(rows)} of its {layers} "
                        "layers at a decode step: each attention layer must return them with output_attentions=True"
                    )
                yield position, rows
    finally:
        model.train(training)


def attention_mass(model: PreTrainedModel, input_ids: torch.LongTensor, far: int, queries: int = 16) -> dict:
    """The attention mass on the first token and on the keys more than `far` positions back, per layer and head, at
    the last `queries` positions of `input_ids` (see the module docstring).

    Args:
        model: a causal LM or its decoder, as `decode_attention_rows` takes it.
        input_ids: `[B, T]` token ids, one window per row, no padding.
        far: F, in tokens: a key j is far from the query at i when `i - j > F`.
        queries: Q, the number of last positions measured, `1 <= Q < T`.

    Returns:
        `{"length": T, "far": F, "queries": Q, "batch": B, "sink_mass": float, "far_mass": float, "layers": [...]}`,
        one entry a layer: `{"layer": l, "type": ..., "heads": n, "sink_mass": float, "far_mass": float,
        "sink_mass_per_head": [n floats], "far_mass_per_head": [n floats]}` (`type`: the config's layer type, such as
        `"path_attention"` or `"full_attention"`, else None). Each per-head value is a mean over the Q positions and
        the batch, each layer's over its heads, the top-level ones over the layers.
    """
    if far < 0:
        raise ValueError(f"far must be a number of tokens, at least 0, got {far}")
    sink_sums: list[torch.Tensor] = []
    far_sums: list[torch.Tensor] = []
    for position, rows in decode_attention_rows(model, input_ids, queries):
        if not sink_sums:
            sink_sums = [rows[layer].new_zeros(rows[layer].shape[1], dtype=torch.float64) for layer in range(len(rows))]
            far_sums = [sums.clone() for sums in sink_sums]
        last_far = position - far - 1  # the last far key: i - j > F
        for layer, probs in enumerate(rows):
            probs = probs[:, :, 0, : position + 1].double()  # [B, heads, keys 0..i]
            sink_sums[layer] += probs[..., 0].sum(0)
            if last_far >= 1:
                far_sums[layer] += probs[..., 1 : last_far + 1].sum(-1).sum(0)
    count = input_ids.shape[0] * queries
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    layers = []
    for layer, (sink_sum, far_sum) in enumerate(zip(sink_sums, far_sums, strict=True)):
        sink, far_ = (sink_sum / count).tolist(), (far_sum / count).tolist()
        layers.append(
            {
                "layer": layer,
                "type": layer_types[layer] if layer_types else None,
                "heads": len(sink),
                "sink_mass": sum(sink) / len(sink),
                "far_mass": sum(far_) / len(far_),
                "sink_mass_per_head": sink,
                "far_mass_per_head": far_,
            }
        )
    return {
        "length": input_ids.shape[1],
        "far": far,
        "queries": queries,
        "batch": input_ids.shape[0],
        "sink_mass": sum(entry["sink_mass"] for entry in layers) / len(layers),
        "far_mass": sum(entry["far_mass"] for entry in layers) / len(layers),
        "layers": layers,
    }


__all__ = ["attention_mass", "decode_attention_rows"]
