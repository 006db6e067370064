import pytest
import torch

from path_hf.ops import path_attention, path_decode_update
from tests.ops.path_reference import assert_close, householder_matrices, make_inputs


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gate: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Plain softmax attention of one query over cached (already transformed) keys.

    q: [B, HQ, D]; keys: [B, H, S, D]; values: [B, H, S, DV]; gate: [B, HQ, S] = G_t - G_j or None -> [B, HQ, DV].
    """
    group = q.shape[1] // keys.shape[1]
    logits = torch.einsum("bhd,bhsd->bhs", q, keys.repeat_interleave(group, dim=1))
    if gate is not None:
        logits = logits + gate
    probs = (scale * logits).softmax(-1)
    return torch.einsum("bhs,bhsd->bhd", probs, values.repeat_interleave(group, dim=1))


def decode(
    inputs: dict[str, torch.Tensor | None], keys: torch.Tensor, values: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode positions start.. one token at a time from a cache holding the transformed keys of 0..start-1.

    Returns the outputs [B, T - start, HQ, DV] and the final key cache [B, H, T, D].
    """
    q, k, v, w, beta, g = (inputs[name] for name in ("q", "k", "v", "w", "beta", "g"))
    scale = q.shape[-1] ** -0.5
    gate_cumsum = None if g is None else g.cumsum(1).transpose(1, 2)  # [B, HQ, T]
    outputs = []
    for t in range(start, q.shape[1]):
        # H_t acts on every earlier key before k_t joins the cache
        keys = path_decode_update(keys, w[:, t], beta[:, t])
        keys = torch.cat([keys, k[:, t, :, None]], dim=2)
        values = torch.cat([values, v[:, t, :, None]], dim=2)
        gate = None if g is None else gate_cumsum[..., t, None] - gate_cumsum[..., : t + 1]
        outputs.append(attend(q[:, t], keys, values, gate, scale))
    return torch.stack(outputs, dim=1), keys


@pytest.mark.parametrize(
    ("B", "T", "HQ", "H", "D", "gate"),
    [
        pytest.param(*case, id="B{}-T{}-HQ{}-H{}-D{}-{}".format(*case[:5], "gate" if case[5] else "nogate"))
        for case in [(2, 40, 4, 2, 16, False), (2, 40, 4, 2, 16, True), (1, 70, 8, 2, 32, True), (1, 1, 2, 2, 16, True)]
    ],
)
def test_decode_from_empty_cache(B, T, HQ, H, D, gate):
    x = make_inputs(B, T, HQ, H, D, gate=gate, seed=T)
    with torch.no_grad():
        full, k_cache = path_attention(**x, backend="torch", chunk_size=16, return_k_cache=True)
        empty = x["k"].new_zeros(B, H, 0, D)
        out, keys = decode(x, empty, x["v"].new_zeros(B, H, 0, D), start=0)
    # the output for the last token at every step equals the full computation
    for t in range(T):
        assert_close(f"o[{t}]", full[:, t], out[:, t], 1e-10)
    assert_close("keys", k_cache.transpose(1, 2), keys, 1e-10)


@pytest.mark.parametrize(
    ("prefill", "gate", "chunk_size"),
    [
        pytest.param(*case, id="P{}-{}-C{}".format(case[0], "gate" if case[1] else "nogate", case[2]))
        for case in [(1, True, 16), (30, False, 16), (33, True, 32), (64, True, 64)]
    ],
)
def test_decode_after_prefill(prefill, gate, chunk_size):
    # prefill with return_k_cache, then decode: as run by a model's generate()
    B, T, HQ, H, D = 2, 72, 4, 2, 32
    x = make_inputs(B, T, HQ, H, D, gate=gate, seed=prefill)
    with torch.no_grad():
        full = path_attention(**x, backend="torch", chunk_size=chunk_size)[0]
        head = {name: None if t is None else t[:, :prefill] for name, t in x.items()}
        prefill_out, k_cache = path_attention(**head, backend="torch", chunk_size=chunk_size, return_k_cache=True)
        out, _ = decode(x, k_cache.transpose(1, 2), x["v"][:, :prefill].transpose(1, 2), start=prefill)
    assert_close("prefill", full[:, :prefill], prefill_out, 1e-10)
    assert_close("decode", full[:, prefill:], out, 1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_decode_update_is_householder_product(dtype):
    B, H, S, D = 2, 3, 5, 16
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(B, H, S, D, generator=generator, dtype=torch.float64)
    w = torch.nn.functional.normalize(torch.randn(B, H, D, generator=generator, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(B, H, generator=generator, dtype=torch.float64)
    expected = (householder_matrices(w, beta)[:, :, None] @ keys[..., None]).squeeze(-1)

    out = path_decode_update(keys.to(dtype), w.float(), beta.float())
    assert out.dtype == dtype and out.shape == keys.shape
    assert_close("keys", expected, out, {torch.float64: 1e-6, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype])

    # written into a given tensor instead: the keys themselves (in place, a static cache's slots), or the first S
    # positions of a larger buffer (a dynamic cache grown by the new token): the same values, bit for bit
    in_place = keys.to(dtype).clone()
    assert path_decode_update(in_place, w.float(), beta.float(), out=in_place) is in_place
    torch.testing.assert_close(in_place, out, rtol=0, atol=0)
    grown = torch.full((B, H, S + 1, D), 7.0, dtype=dtype)
    path_decode_update(keys.to(dtype), w.float(), beta.float(), out=grown[:, :, :S])
    torch.testing.assert_close(grown[:, :, :S], out, rtol=0, atol=0)
    assert (grown[:, :, S:] == 7).all()
