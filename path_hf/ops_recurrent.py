# Copyright 2026 The path-hf authors. Apache-2.0.
"""PaTH attention in its recurrent form: the decode-step key update and the token-by-token reference built from it.

Decoding keeps every key fully transformed, `k_j <- H_t k_j` at each new token t, so that a query needs one dot
product per key. `naive_path_attention` runs that recursion over a whole sequence: the reference beside the kernels
(`ops_chunk.py` and its stages), as FLA keeps `naive.py` beside its kernels, with `path_attention`'s signature.

A flat file, as `ops.py` explains: a checkpoint's remote code copies it beside the weights.
"""

from __future__ import annotations

import torch


def path_decode_update(
    keys: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply the new token's Householder transform to every cached key: `k <- k - beta (w . k) w`.

    Args:
        keys: cached, already transformed keys `[B, H, S, D]` (transformers' cache layout).
        w: the new token's direction `[B, H, D]`, L2-normalised.
        beta: the new token's strength `[B, H]`.
        out: where to write the updated keys (`[B, H, S, D]`, keys' dtype; may be `keys` itself, or a slice of a
            larger buffer), instead of a new tensor.

    Returns:
        The updated keys `[B, H, S, D]` in keys' dtype (the algebra runs in at least fp32): `out` when given.
    """
    dtype = torch.promote_types(keys.dtype, torch.float32)
    k = keys if keys.dtype == dtype else keys.to(dtype)
    w = w.to(dtype).unsqueeze(2)  # [B, H, 1, D]
    # Two passes over the cache: the products beta (w . k), then k - (beta w . k) w in one op. The first is a
    # matrix-vector product with the vector as a transposed row: on CPU 2-4x faster than `(k * w).sum(-1)`, which
    # writes and reads a temporary as large as the cache, and than a contiguous `[B, H, D, 1]` (a slower bmm).
    scaled = k @ (w * beta.to(dtype).view(*beta.shape, 1, 1)).mT
    if (
        out is not None
        and out.dtype == dtype
        and not (torch.is_grad_enabled() and (k.requires_grad or scaled.requires_grad))
    ):  # elementwise: `out` may alias `keys`
        return torch.addcmul(k, scaled, w, value=-1, out=out)
    updated = torch.addcmul(k, scaled, w, value=-1).to(keys.dtype)
    return updated if out is None else out.copy_(updated)


def naive_path_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Token-by-token reference: the decode recursion run over the whole sequence. O(T^2 D), for testing.

    Same arguments and output as `path_attention` (no packing).
    """
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    gate = torch.zeros(B, HQ, T, dtype=dtype, device=q.device) if g is None else g.to(dtype).transpose(1, 2)
    gate = gate.cumsum(-1)
    keys = k[:, :, :0]
    out = []
    for t in range(T):
        keys = torch.cat([path_decode_update(keys, w[:, t], beta[:, t]), k[:, :, t : t + 1]], dim=2)
        keys_q, v_q = keys.repeat_interleave(G, 1), v[:, :, : t + 1].repeat_interleave(G, 1)
        logits = (q[:, :, t : t + 1] @ keys_q.transpose(-1, -2)).squeeze(2)
        logits = scale * (logits + gate[..., t : t + 1] - gate[..., : t + 1])
        out.append((logits.softmax(-1).unsqueeze(2) @ v_q).squeeze(2))
    return torch.stack(out, dim=1).to(q.dtype)


__all__ = ["naive_path_attention", "path_decode_update"]
