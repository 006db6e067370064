import pytest
import torch
import torch.nn.functional as F

from path_hf import ops_chunk, ops_superblock, ops_transform, ops_walk
from path_hf.ops import naive_path_attention, path_attention, resolve_backend
from tests.ops.path_reference import (
    assert_close,
    householder_matrices,
    householder_product,
    make_inputs,
    path_attention_reference,
    path_scores_reference,
    relative_error,
)
from tests.ops.ranges import counted_ranges


def forward_backward(
    fn, inputs: dict[str, torch.Tensor | None], do: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output of fn(**inputs, **kwargs)[0] and the gradients of <o, do> for every input that is not None."""
    o = fn(**inputs, **kwargs)[0]
    leaves = {name: x for name, x in inputs.items() if x is not None}
    grads = torch.autograd.grad(o, list(leaves.values()), do)
    return o, dict(zip(leaves, grads, strict=True))


def case_id(B: int, T: int, HQ: int, H: int, D: int, DV: int, gate: bool, chunk_size: int | None = None) -> str:
    chunk = "" if chunk_size is None else f"-C{chunk_size}"
    return f"B{B}-T{T}-HQ{HQ}-H{H}-D{D}-DV{DV}{chunk}-{'gate' if gate else 'nogate'}"


# (B, T, HQ, H, D, DV, gate, chunk_size)
REFERENCE_CASES = [
    (1, 1, 2, 2, 32, 32, False, 64),
    (1, 1, 4, 2, 16, 16, True, 16),
    (2, 130, 4, 2, 48, 48, True, 64),
    (1, 130, 8, 2, 32, 32, False, 64),
    (2, 77, 4, 4, 32, 16, True, 16),
    (1, 64, 2, 1, 16, 24, True, 32),
    (2, 100, 2, 2, 64, 64, False, 32),
    (1, 33, 4, 2, 48, 64, True, 16),
]


def test_reference_scores_are_explicit_householder_products():
    # The reference applies H_t to the keys one at a time; check it against P_ij formed as a matrix product.
    x = make_inputs(2, 7, 4, 2, 5)
    scores, k_cache = path_scores_reference(x["q"], x["k"], x["w"], x["beta"])
    householder = householder_matrices(x["w"], x["beta"])
    assert torch.isneginf(scores.masked_select(torch.ones(7, 7, dtype=torch.bool).triu(1))).all()
    for i in range(7):
        for j in range(i + 1):
            transported_k = (householder_product(householder, i, j) @ x["k"][:, j, :, :, None]).squeeze(-1)
            expected = (x["q"][:, i] * transported_k.repeat_interleave(2, dim=1)).sum(-1)
            torch.testing.assert_close(scores[:, :, i, j], expected, rtol=1e-12, atol=1e-12)
            if i == 6:
                torch.testing.assert_close(k_cache[:, j], transported_k, rtol=1e-12, atol=1e-12)


def test_reference_without_householder_is_causal_attention():
    # beta = 0 makes every H_t the identity: PaTH reduces to plain causal softmax attention.
    x = make_inputs(2, 20, 4, 2, 8)
    with torch.no_grad():
        o, _ = path_attention_reference(**{**x, "beta": torch.zeros_like(x["beta"])})
        expected = F.scaled_dot_product_attention(
            *(x[name].transpose(1, 2) for name in ("q", "k", "v")), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("B", "T", "HQ", "H", "D", "DV", "gate", "chunk_size"),
    [pytest.param(*case, id=case_id(*case)) for case in REFERENCE_CASES],
)
def test_torch_backend_vs_reference(B, T, HQ, H, D, DV, gate, chunk_size):
    x = make_inputs(B, T, HQ, H, D, DV, gate=gate, seed=T + D)
    do = torch.randn(B, T, HQ, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    ref, ref_grads = forward_backward(path_attention_reference, x, do)
    out, grads = forward_backward(path_attention, x, do, backend="torch", chunk_size=chunk_size)

    assert out.dtype == torch.float64
    assert_close("o", ref, out, 1e-10)
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], 1e-10)


@pytest.mark.parametrize(
    ("long_walk", "recompute", "checkpointed"),
    [(True, None, True), (False, None, False), (True, False, False), (False, True, True)],
    ids=["long-walk-recomputed", "short-walk-kept", "kept-as-asked", "recomputed-as-asked"],
)
def test_torch_backend_gradients_with_and_without_recomputation(long_walk, recompute, checkpointed):
    """By default long walks keep only each segment's first running keys for backward and recompute the others, and
    short ones keep every step's; `recompute` overrides. All give the reference's gradients, over several segments
    (19 chunks, 8 steps a segment: steps 1-8, 9-16, 17-18, whose backward recomputes 7 + 7 + 1 steps' keys)."""
    knobs = {
        "checkpoint_above_bytes": 0 if long_walk else 2**62,  # long: every walk is over it; short: none is
        "walk_merges": 0,  # the walk over the 19 chunks
    }
    x = make_inputs(1, 300, 4, 2, 16, 16, gate=True, seed=5)
    do = torch.randn(1, 300, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = forward_backward(path_attention_reference, x, do)
    with counted_ranges() as forward:
        out = path_attention(**x, backend="torch", chunk_size=16, recompute=recompute, chunk_options=knobs)[0]
    assert forward["path_attention.next_keys"] == 17  # the forward walk: steps 1 to 17 move the keys on
    leaves = {name: t for name, t in x.items() if t is not None}
    with counted_ranges() as backward:
        grads = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), do), strict=True))
    assert backward["path_attention.walk_backward"] == 1
    assert backward["path_attention.next_keys"] == (15 if checkpointed else 0)
    assert_close("o", ref, out, 1e-10)
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], 1e-10)


@pytest.mark.parametrize(
    ("B", "T", "HQ", "H", "D", "DV", "gate"),
    [pytest.param(*case, id=case_id(*case)) for case in [(2, 37, 4, 2, 16, 24, True), (1, 20, 2, 2, 48, 48, False)]],
)
def test_naive_path_attention_vs_reference(B, T, HQ, H, D, DV, gate):
    x = make_inputs(B, T, HQ, H, D, DV, gate=gate, seed=T)
    do = torch.randn(B, T, HQ, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = forward_backward(path_attention_reference, x, do)
    out, grads = forward_backward(lambda **inputs: (naive_path_attention(**inputs),), x, do)
    assert_close("o", ref, out, 1e-10)
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], 1e-10)


@pytest.mark.parametrize("scale", [0.3, 1.0])
def test_torch_backend_scale(scale):
    x = make_inputs(1, 40, 2, 1, 16, gate=True)
    do = torch.randn(1, 40, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = forward_backward(path_attention_reference, x, do, scale=scale)
    out, grads = forward_backward(path_attention, x, do, scale=scale, backend="torch", chunk_size=16)
    assert_close("o", ref, out, 1e-10)
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], 1e-10)


@pytest.mark.parametrize(
    ("B", "T", "HQ", "H", "D", "DV", "gate", "chunk_size"),
    [
        pytest.param(*case, id=case_id(*case))
        for case in [
            (2, 130, 8, 2, 64, 64, True, 64),
            (1, 100, 4, 4, 32, 48, False, 32),
            (3, 17, 2, 1, 16, 16, True, 16),
        ]
    ],
)
@pytest.mark.filterwarnings("ignore::ImportWarning", "ignore::DeprecationWarning", "ignore:Triton is not supported")
def test_torch_backend_vs_fla_naive(B, T, HQ, H, D, DV, gate, chunk_size):
    from fla.ops.path_attn.naive import naive_path_attn

    x = make_inputs(B, T, HQ, H, D, DV, gate=gate, dtype=torch.float32, seed=T)
    do = torch.randn(B, T, HQ, DV, generator=torch.Generator().manual_seed(1))
    scale = D**-0.5

    def naive(q, k, v, w, beta, g):
        # FLA's naive reference needs an explicit scale and a gate tensor
        return (naive_path_attn(q, k, v, w, beta, torch.zeros(B, T, HQ) if g is None else g, scale),)

    ref, ref_grads = forward_backward(naive, x, do)
    out, grads = forward_backward(path_attention, x, do, backend="torch", chunk_size=chunk_size)

    assert out.dtype == torch.float32
    assert_close("o", ref, out, 1e-4)
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], 1e-4)


@pytest.mark.parametrize(
    ("B", "T", "HQ", "H", "D", "DV", "gate", "chunk_size"),
    [
        pytest.param(*case, id=case_id(*case))
        for case in [(2, 70, 4, 2, 32, 32, True, 32), (1, 5, 2, 2, 16, 16, False, 64)]
    ],
)
def test_torch_backend_low_precision(B, T, HQ, H, D, DV, gate, chunk_size):
    # What a bf16 model passes: q, k, v in bf16, while w, beta and g stay in float32
    x = make_inputs(B, T, HQ, H, D, DV, gate=gate, seed=T)
    with torch.no_grad():
        ref, ref_k_cache = path_attention_reference(**x)
        low = {
            name: None if t is None else t.to(torch.bfloat16 if name in ("q", "k", "v") else torch.float32)
            for name, t in x.items()
        }
        out, k_cache = path_attention(**low, backend="torch", chunk_size=chunk_size, return_k_cache=True)
    assert out.dtype == k_cache.dtype == torch.bfloat16
    assert_close("o", ref, out, 2e-2)
    assert_close("k_cache", ref_k_cache, k_cache, 2e-2)


# Under bf16 autocast, with q, k, v rounded to bf16: the output's and gradients' own rounding to bf16 (relative
# 2^-9 at most, ~1.6e-3 to 2.4e-3 measured at T=1024) when they are bf16; fp32 arithmetic when they are fp32.
# Matmuls run in bf16 by autocast measured 5.6e-3 to 2.7e-2 at T=1024 (the error grows with T, and with the gate).
AUTOCAST_RTOL = {torch.bfloat16: 3e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("gate", [False, True], ids=["nogate", "gate"])
@pytest.mark.parametrize("qkv_dtype", [torch.bfloat16, torch.float32], ids=["qkv-bf16", "qkv-fp32"])
def test_torch_backend_under_autocast(qkv_dtype, gate):
    """Every shipped accelerate config trains under bf16 autocast: the torch backend still accumulates in fp32, and
    returns q's dtype (as FLA's kernels do)."""
    T = 1024
    x = make_inputs(1, T, 4, 2, 32, gate=gate, dtype=torch.float32, seed=3)
    # What a layer under autocast passes: q, k, v from bf16 projections; w, beta and g computed in fp32.
    for name in ("q", "k", "v"):
        x[name] = x[name].detach().bfloat16().to(qkv_dtype).requires_grad_()
    do = torch.randn(1, T, 4, 32, generator=torch.Generator().manual_seed(1))
    # Reference: the same (rounded) values in fp64 (the fp64 torch backend matches the brute force to 1e-10, above).
    exact = {name: None if t is None else t.detach().double().requires_grad_() for name, t in x.items()}
    ref, ref_grads = forward_backward(path_attention, exact, do.double(), backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the forward; backward runs outside, as in training
        out = path_attention(**x, backend="torch")[0]
    assert out.dtype == qkv_dtype
    leaves = {name: t for name, t in x.items() if t is not None}
    grads = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), do.to(qkv_dtype)), strict=True))
    assert_close("o", ref, out, AUTOCAST_RTOL[qkv_dtype])
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], AUTOCAST_RTOL[qkv_dtype])


@pytest.mark.parametrize(
    ("B", "T", "HQ", "H", "D", "DV", "gate", "chunk_size"),
    [
        pytest.param(*case, id=case_id(*case))
        for case in [
            (1, 1, 2, 2, 16, 16, False, 16),
            (2, 130, 4, 2, 48, 32, True, 64),
            (1, 96, 8, 2, 32, 32, False, 32),
            (2, 40, 2, 2, 16, 16, True, 16),
        ]
    ],
)
def test_k_cache_vs_reference(B, T, HQ, H, D, DV, gate, chunk_size):
    x = make_inputs(B, T, HQ, H, D, DV, gate=gate, seed=T)
    with torch.no_grad():
        ref, ref_k_cache = path_attention_reference(**x)
        out, k_cache = path_attention(**x, backend="torch", chunk_size=chunk_size, return_k_cache=True)
        out_without_cache, no_cache = path_attention(**x, backend="torch", chunk_size=chunk_size)
    assert no_cache is None
    assert k_cache.shape == x["k"].shape and k_cache.dtype == x["k"].dtype
    assert_close("k_cache", ref_k_cache, k_cache, 1e-10)
    assert_close("o", ref, out, 1e-10)
    torch.testing.assert_close(out_without_cache, out, rtol=0, atol=0)


# (cu_seqlens, HQ, H, D, gate, chunk_size): short sequences, sequences shorter than a chunk, boundaries inside a chunk
VARLEN_CASES = [
    ([0, 5, 70, 100], 4, 2, 32, True, 32),
    ([0, 1, 64, 130], 2, 2, 16, False, 64),
    ([0, 3, 4, 20, 21], 4, 1, 16, True, 16),
    ([0, 50], 2, 2, 48, True, 16),
    ([0, 10, 40, 64], 4, 2, 16, True, 32),
]


@pytest.mark.parametrize(
    ("cu_seqlens", "HQ", "H", "D", "gate", "chunk_size"),
    [
        pytest.param(
            *case,
            id=f"cu{'-'.join(map(str, case[0]))}-HQ{case[1]}-H{case[2]}-D{case[3]}-C{case[5]}-"
            f"{'gate' if case[4] else 'nogate'}",
        )
        for case in VARLEN_CASES
    ],
)
def test_varlen_vs_per_sequence(cu_seqlens, HQ, H, D, gate, chunk_size):
    T = cu_seqlens[-1]
    x = make_inputs(1, T, HQ, H, D, gate=gate, seed=T)
    do = torch.randn(1, T, HQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def per_sequence(**inputs):
        outputs = [
            path_attention(
                **{name: None if t is None else t[:, bos:eos] for name, t in inputs.items()},
                backend="torch",
                chunk_size=chunk_size,
                return_k_cache=True,
            )
            for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)
        ]
        return tuple(torch.cat(parts, dim=1) for parts in zip(*outputs, strict=True))

    def packed(**inputs):
        return path_attention(
            **inputs,
            cu_seqlens=torch.tensor(cu_seqlens),
            backend="torch",
            chunk_size=chunk_size,
            return_k_cache=True,
        )

    ref, ref_grads = forward_backward(per_sequence, x, do)
    out, grads = forward_backward(packed, x, do)
    assert_close("o", ref, out, 1e-10)
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], 1e-10)
    with torch.no_grad():
        ref_k_cache, k_cache = per_sequence(**x)[1], packed(**x)[1]
    assert_close("k_cache", ref_k_cache, k_cache, 1e-10)

    # and each sequence against the brute force
    with torch.no_grad():
        for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            seq_ref, seq_k_cache = path_attention_reference(
                **{name: None if t is None else t[:, bos:eos] for name, t in x.items()}
            )
            assert_close(f"o[{bos}:{eos}]", seq_ref, out[:, bos:eos], 1e-10)
            assert_close(f"k_cache[{bos}:{eos}]", seq_k_cache, k_cache[:, bos:eos], 1e-10)


def test_resolve_backend_on_cpu():
    q = torch.randn(1, 4, 2, 16)
    assert resolve_backend("auto", q) == "torch"
    assert resolve_backend("torch", q) == "torch"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("flash", q)


def error_inputs(B: int = 1, T: int = 8, HQ: int = 4, H: int = 2, D: int = 16, DV: int = 16) -> dict[str, torch.Tensor]:
    x = make_inputs(B, T, HQ, H, D, DV, dtype=torch.float32)
    return {name: t.detach() for name, t in x.items() if t is not None}


def test_error_k_w_shapes_differ():
    x = error_inputs()
    x["w"] = F.normalize(torch.randn(1, 8, 2, 32), dim=-1)
    with pytest.raises(ValueError) as error:
        path_attention(**x, backend="torch")
    message = str(error.value)
    assert "w" in message and "k" in message and "(1, 8, 2, 32)" in message and "(1, 8, 2, 16)" in message


def test_error_heads_not_divisible():
    x = error_inputs(HQ=3, H=2)
    with pytest.raises(ValueError) as error:
        path_attention(**x, backend="torch")
    message = str(error.value)
    assert "(3)" in message and "(2)" in message and "multiple" in message


def test_error_cu_seqlens_with_batch():
    x = error_inputs(B=2)
    with pytest.raises(ValueError) as error:
        path_attention(**x, cu_seqlens=torch.tensor([0, 3, 8]), backend="torch")
    message = str(error.value)
    assert "cu_seqlens" in message and "2" in message and "flatten" in message


def test_error_cu_seqlens_not_covering_sequence():
    x = error_inputs()
    with pytest.raises(ValueError) as error:
        path_attention(**x, cu_seqlens=torch.tensor([0, 3, 6]), backend="torch")
    message = str(error.value)
    assert "cu_seqlens" in message and "T=8" in message and "[0, 3, 6]" in message


@pytest.mark.parametrize(("D", "DV"), [(48, 48), (32, 24)], ids=["D48", "D32-DV24"])
def test_error_fla_head_dim(D, DV):
    x = error_inputs(D=D, DV=DV)
    with pytest.raises(ValueError) as error:
        path_attention(**x, backend="fla")
    message = str(error.value)
    assert str(DV if D in (16, 32, 64, 128) else D) in message and "backend='torch'" in message


def test_error_cu_seqlens_not_a_tensor():
    x = error_inputs()
    with pytest.raises(ValueError, match="cu_seqlens must be an integer tensor, got list"):
        path_attention(**x, cu_seqlens=[0, 3, 8], backend="torch")


def test_error_chunk_size():
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        path_attention(**error_inputs(), backend="torch", chunk_size=0)


def test_error_chunk_options_on_fla():
    """The torch backend's knobs are not FLA's: `backend="fla"` refuses them rather than run without them."""
    with pytest.raises(ValueError, match=r"backend='fla' has no chunk_options \(got \['walk_merges'\]\)"):
        path_attention(**error_inputs(), backend="fla", chunk_options={"walk_merges": 0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_exp_floor(dtype):
    """`floored_exp_` is exp wherever exp is a normal number above e * tiny, and that floor's exp below: never
    subnormal (PyTorch's CPU exp is 8-40x slower on arguments whose exp underflows)."""
    floor = ops_walk.EXP_FLOOR[dtype]
    x = torch.tensor([float("-inf"), -1e4, floor - 1, floor, floor + 1, -50.0, 0.0, 3.0], dtype=dtype)
    out = ops_walk.floored_exp_(x.clone())
    expected = torch.where(x > floor, x.exp(), torch.tensor(floor, dtype=dtype).exp())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert (out >= torch.finfo(dtype).tiny).all()
    assert out[2] <= torch.finfo(dtype).tiny * 3  # what a masked or far-gated key adds: nothing a softmax can see


@pytest.mark.parametrize(
    ("HQ", "H", "gate", "cu_seqlens", "superblock_tokens"),
    [
        (4, 2, True, None, 0),
        (2, 2, False, None, 0),
        (4, 2, True, [0, 300, 1024], 0),
        (4, 2, True, None, 256),
        (2, 2, False, None, 256),
    ],
    ids=["gqa-gate", "mha", "gqa-gate-packed", "gqa-gate-superblocks", "mha-superblocks"],
)
def test_bf16_walk_products_bounded_by_sdpa_in_bf16(HQ, H, gate, cu_seqlens, superblock_tokens):
    """The inference walk with its score and value products in bfloat16 (`product_dtype`) is no further from the
    exact output than PyTorch's SDPA in bfloat16 is from its own, on the same bfloat16-rounded q, k and v; over
    superblocks too, whose far part runs in bfloat16 where there is no gate."""
    T, D = 1024, 32
    x = {n: None if t is None else t.detach() for n, t in make_inputs(1, T, HQ, H, D, gate=gate, seed=5).items()}
    for name in ("q", "k", "v"):
        x[name] = x[name].to(torch.bfloat16).double()
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    options = {"scale": D**-0.5, "cu_seqlens": cu, "superblock_tokens": superblock_tokens}
    with torch.no_grad():
        exact = ops_chunk.chunk_path_attention(**x, **options, product_dtype=None)[0]
        x32 = {n: None if t is None else t.float() for n, t in x.items()}
        low = ops_chunk.chunk_path_attention(**x32, **options, product_dtype=torch.bfloat16)[0]
        fp32 = ops_chunk.chunk_path_attention(**x32, **options, product_dtype=None)[0]
        q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
        k, v = (t.repeat_interleave(HQ // H, 1) for t in (k, v))
        sdpa_exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        sdpa_bf16 = F.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True)
    assert low.dtype == torch.float32
    bound = relative_error(sdpa_exact, sdpa_bf16)
    assert relative_error(exact, low) <= bound
    assert relative_error(exact, fp32) < bound / 100  # the bfloat16 walk did run, and it is what costs the error


def test_walk_product_dtype_policy(monkeypatch):
    """bfloat16 products only for bfloat16 queries on a CPU that multiplies bfloat16 natively, and only in inference;
    `path_attention` follows the policy."""
    x = {n: None if t is None else t.detach() for n, t in make_inputs(1, 200, 2, 2, 16, gate=True, seed=2).items()}
    low = {
        n: None if t is None else t.to(torch.bfloat16 if n in ("q", "k", "v") else torch.float32) for n, t in x.items()
    }
    with torch.no_grad():
        outputs = {
            dtype: ops_chunk.chunk_path_attention(**low, scale=0.25, chunk_size=32, product_dtype=dtype)[0]
            for dtype in (None, torch.bfloat16)
        }
    assert not torch.equal(outputs[None], outputs[torch.bfloat16])
    for native in (False, True):
        monkeypatch.setattr(ops_chunk, "cpu_multiplies_bf16", lambda native=native: native)
        expected = torch.bfloat16 if native else None
        assert ops_chunk.walk_product_dtype(low["q"], requires_grad=False) == expected
        assert ops_chunk.walk_product_dtype(low["q"], requires_grad=True) is None
        assert ops_chunk.walk_product_dtype(low["q"].float(), requires_grad=False) is None
        with torch.no_grad():
            out = path_attention(**low, scale=0.25, chunk_size=32, backend="torch")[0]
        assert torch.equal(out, outputs[expected])


@pytest.mark.parametrize("merges", [0, 1, 2])
@pytest.mark.parametrize("cu_seqlens", [None, [0, 50, 200, 333]], ids=["unpacked", "packed"])
def test_walk_over_merged_chunks_vs_reference(merges, cu_seqlens):
    """The walk over blocks of 2^merges chunks (`merge_chunks`) gives the brute force's output, gradients and key
    cache, GQA and gated, packed too; the chunks are padded to a multiple of 2^merges."""
    T, HQ, H, D, C = 333, 4, 2, 16, 16
    x = make_inputs(1, T, HQ, H, D, gate=True, seed=7)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    do = torch.randn(1, T, HQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    bounds = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
    parts = [path_attention_reference(**{n: t[:, a:b] for n, t in x.items() if t is not None}) for a, b in bounds]
    ref, ref_k_cache = (torch.cat(outputs, dim=1) for outputs in zip(*parts, strict=True))
    names = [n for n, t in x.items() if t is not None]
    ref_grads = dict(zip(names, torch.autograd.grad(ref, [x[n] for n in names], do), strict=True))
    out, k_cache = ops_chunk.chunk_path_attention(
        **x, scale=D**-0.5, cu_seqlens=cu, chunk_size=C, walk_merges=merges, return_k_cache=True
    )
    grads = dict(zip(ref_grads, torch.autograd.grad(out, [x[n] for n in ref_grads], do), strict=True))
    assert_close("o", ref, out, 1e-10)
    assert_close("k_cache", ref_k_cache, k_cache, 1e-10)
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], 1e-10)


@pytest.mark.parametrize(
    ("C", "block"),
    [(64, 16), (64, 64), (32, 8), (12, 16), (24, 16), (1, 16)],
    ids=["64-blocks16", "64-one-block", "32-blocks8", "12-one-block", "24-fallback", "1"],
)
def test_unit_lower_solve_matches_solve_triangular(C: int, block: int):
    """The UT transform's blocked solve against torch's triangular solve, forward and both gradients (float64), with
    garbage on and above the diagonal, which it must not read."""
    torch.manual_seed(C)
    strict = (0.4 * torch.randn(2, 3, C, C, dtype=torch.float64)).tril(-1)
    lower = (strict + torch.randn(C, C, dtype=torch.float64).triu()).requires_grad_()
    rhs = torch.randn(2, 3, C, 5, dtype=torch.float64, requires_grad=True)
    expected = torch.linalg.solve_triangular(torch.eye(C, dtype=torch.float64) + lower.tril(-1), rhs, upper=False)
    solved = ops_transform.unit_lower_solve(lower, rhs, block=block)
    assert_close("x", expected, solved, 1e-12)
    dx = torch.randn_like(solved)
    expected_grads = torch.autograd.grad(expected, (lower, rhs), dx)
    grads = torch.autograd.grad(solved, (lower, rhs), dx)
    assert_close("d_lower", expected_grads[0], grads[0], 1e-12)
    assert_close("d_rhs", expected_grads[1], grads[1], 1e-12)
    assert not grads[0].triu().any()


def test_walk_merges_rule():
    above = ops_transform.MERGE_ABOVE * 64
    merges = ops_transform.default_walk_merges
    assert merges(64, 64) == merges(above, 64) == 0
    assert merges(above + 1, 64) == merges(32768, 64) == 1


def windowed_reference(x: dict, bounds: list[tuple[int, int]], chunk_size: int, steps: int, sink: bool) -> torch.Tensor:
    """The brute force's attention over the packed sequences `bounds` of one row, where the query at position i sees
    the key at j only if j's chunk is at most `steps` chunks before i's (of the row's chunks of `chunk_size`), or,
    with `sink`, is the row's first chunk."""
    q, k, v, w, beta, g = (x[n] for n in ("q", "k", "v", "w", "beta", "g"))
    B, T, HQ, D = q.shape
    logits = torch.full((B, HQ, T, T), float("-inf"), dtype=q.dtype)
    for a, b in bounds:
        scores, _ = path_scores_reference(q[:, a:b], k[:, a:b], w[:, a:b], beta[:, a:b])
        gate = g[:, a:b].cumsum(1).transpose(1, 2)
        logits[:, :, a:b, a:b] = scores + gate[..., :, None] - gate[..., None, :]
    chunk = torch.arange(T) // chunk_size
    visible = chunk[None, :] >= chunk[:, None] - steps
    if sink:
        visible |= chunk[None, :] == 0
    probs = (D**-0.5 * logits.masked_fill(~visible, float("-inf"))).softmax(-1)
    return (probs @ v.repeat_interleave(HQ // k.shape[2], dim=2).transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("sink", [False, True], ids=["window", "window-sink"])
@pytest.mark.parametrize("cu_seqlens", [None, [0, 70, 200]], ids=["unpacked", "packed"])
def test_window_vs_reference(sink, cu_seqlens):
    """`window` (lab/smollm2/passkey_probe.py's `path_window`): a query sees the keys of its own chunk and of the
    ceil(W / C) chunks before it, and with `window_sink` also those of the first chunk, as the brute force does with
    its scores masked so; output and gradients, GQA and gated, packed too. Without them, the walk is not the same."""
    T, HQ, H, D, C, W = 200, 4, 2, 16, 16, 40  # 3 chunks back
    x = make_inputs(1, T, HQ, H, D, gate=True, seed=11)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    bounds = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
    do = torch.randn(1, T, HQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref, ref_grads = forward_backward(lambda **a: (windowed_reference(a, bounds, C, 3, sink),), x, do)
    options = {"scale": D**-0.5, "cu_seqlens": cu, "chunk_size": C, "walk_merges": 0}
    out, grads = forward_backward(ops_chunk.chunk_path_attention, x, do, **options, window=W, window_sink=sink)
    assert_close("o", ref, out, 1e-10)
    for name in ref_grads:
        assert_close(f"d{name}", ref_grads[name], grads[name], 1e-10)
    with torch.no_grad():
        inference = ops_chunk.chunk_path_attention(**x, **options, window=W, window_sink=sink)[0]
        whole = ops_chunk.chunk_path_attention(**x, **options)[0]
    assert_close("o (inference)", ref, inference, 1e-10)
    assert relative_error(ref, whole) > 1e-3


def test_window_errors():
    x = make_inputs(1, 20, 2, 2, 16)
    with pytest.raises(ValueError, match="window must be None or at least 0, got -1"):
        ops_chunk.chunk_path_attention(**x, scale=0.25, window=-1)
    with pytest.raises(ValueError, match="window_sink needs a window"):
        ops_chunk.chunk_path_attention(**x, scale=0.25, window_sink=True)


@pytest.mark.parametrize(
    ("B", "T", "HQ", "H", "D", "DV", "gate", "merges"),
    [
        (1, 333, 4, 2, 16, 16, True, None),
        (1, 333, 2, 2, 16, 24, False, None),
        (1, 300, 4, 1, 16, 8, True, 0),
        (1, 256, 2, 2, 16, 16, False, 0),
        (3, 200, 4, 2, 16, 16, True, None),
    ],
    ids=["gqa-gate-padded", "mha-wide-v", "gqa-gate-narrow-v", "exact-multiple", "batch-3"],
)
def test_superblocks_vs_reference(B, T, HQ, H, D, DV, gate, merges):
    """Inference over superblocks (`superblock_attention`: the walk within each, the fused SDPA kernel on the earlier
    keys) gives the brute force's output and key cache, GQA, gated, with v wider and narrower than k, the chunks
    padded to whole superblocks, a batch of several sequences; the far part does run."""
    C, tokens = 16, 64
    x = {n: None if t is None else t.detach() for n, t in make_inputs(B, T, HQ, H, D, DV=DV, gate=gate, seed=3).items()}
    ref, ref_k_cache = path_attention_reference(**x)
    with torch.no_grad(), counted_ranges() as ran:
        out, k_cache = ops_chunk.chunk_path_attention(
            **x, scale=D**-0.5, chunk_size=C, walk_merges=merges, superblock_tokens=tokens, return_k_cache=True
        )
    assert ran["path_attention.far_attention"] == 1  # one call, over every superblock: the fused kernel on each
    assert ran["aten::_scaled_dot_product_flash_attention_for_cpu"] == -(-T // tokens) - 1  # but the first
    assert_close("o", ref, out, 1e-10)
    assert_close("k_cache", ref_k_cache, k_cache, 1e-10)


def test_superblock_rule():
    """Superblocks only in inference, on CPU, unpacked, past two of them, over unmerged chunks (they replace the
    walk's merged blocks, and a walk asked to merge runs without them)."""
    blocks = ops_superblock.superblock_blocks
    assert blocks(1024, 64, 512) == 0  # two superblocks: the walk alone
    assert blocks(1025, 64, 512) == blocks(32768, 64, 512) == 8
    assert blocks(32768, 64, 64) == blocks(32768, 64, 0) == 0
    x = make_inputs(1, 200, 2, 2, 16, gate=True, seed=1)
    kwargs = {"scale": 0.25, "chunk_size": 4, "superblock_tokens": 32}

    def stages(**more) -> tuple[int, int, int]:
        """How often the chunks were merged and superblocks ran, and how many times the walk moved its keys on."""
        with counted_ranges() as ran:
            ops_chunk.chunk_path_attention(**x, **kwargs, **more)
        return tuple(ran[f"path_attention.{stage}"] for stage in ("merge_chunks", "superblocks", "next_keys"))

    assert stages()[:2] == (1, 0)  # gradients wanted: the walk, merged (200 > 16 chunks of 4)
    with torch.no_grad():
        assert stages(cu_seqlens=torch.tensor([0, 100, 200]))[:2] == (1, 0)  # packed: the same
        assert stages(walk_merges=1)[:2] == (1, 0)
        # superblocks of 8 unmerged chunks: the walk runs within them, 7 steps, so it moves its keys on 6 times
        assert stages() == (0, 1, 6)
