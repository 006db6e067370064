"""Brute-force PaTH attention written from the definition, and input helpers for the ops tests.

    logits_ij = scale * (q_i^T P_ij k_j + G_i - G_j),   P_ij = H_i H_{i-1} ... H_{j+1},   j <= i
    H_t = I - beta_t w_t w_t^T,   G = cumsum(g)

Every H_t is built as an explicit D x D matrix. `householder_product` forms P_ij explicitly; the reference
attention applies the same matrices to the keys one at a time, P_ij k_j = H_i (H_{i-1} (... (H_{j+1} k_j))),
which is the same product by associativity at O(T^2 D^2) instead of O(T^2 D^3) cost. Neither uses a chunked
or UT/WY formulation.
"""

import torch
import torch.nn.functional as F


def householder_matrices(w: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """H_t = I - beta_t w_t w_t^T. w: [B, T, H, D], beta: [B, T, H] -> [B, T, H, D, D]."""
    eye = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)
    return eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]


def householder_product(householder: torch.Tensor, i: int, j: int) -> torch.Tensor:
    """P_ij = H_i H_{i-1} ... H_{j+1} as a matrix product ([B, T, H, D, D] -> [B, H, D, D]); I when i == j."""
    B, _, H, D, _ = householder.shape
    product = torch.eye(D, dtype=householder.dtype, device=householder.device).expand(B, H, D, D)
    for t in range(j + 1, i + 1):
        product = householder[:, t] @ product
    return product


def path_scores_reference(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores q_i^T P_ij k_j [B, HQ, T, T] (-inf above the diagonal) and k_cache_j = P_{T-1, j} k_j [B, T, H, D]."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    householder = householder_matrices(w, beta)

    transported = k[:, :0]  # transported[:, j] = P_ij k_j for the current query position i
    rows = []
    for i in range(T):
        # P_ij k_j = H_i (P_{i-1, j} k_j) for j < i, and P_ii k_i = k_i
        transported = torch.einsum("bhde,bjhe->bjhd", householder[:, i], transported)
        transported = torch.cat([transported, k[:, i, None]], dim=1)
        # query head h reads key head h // (HQ // H), as FLA's GQA does
        scores = torch.einsum("bhd,bjhd->bhj", q[:, i], transported.repeat_interleave(HQ // H, dim=2))
        rows.append(F.pad(scores, (0, T - i - 1), value=float("-inf")))
    return torch.stack(rows, dim=2), transported


def path_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PaTH attention over unpacked sequences, computed in the dtype of the inputs.

    Args:
        q: [B, T, HQ, D]; k, w: [B, T, H, D]; v: [B, T, H, DV]; beta: [B, T, H]; g: [B, T, HQ] or None.

    Returns:
        o: [B, T, HQ, DV]
        k_cache: [B, T, H, D], k_cache_j = P_{T-1, j} k_j (the keys as seen from the last position).
    """
    HQ, D, H = q.shape[2], q.shape[3], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    logits, k_cache = path_scores_reference(q, k, w, beta)
    if g is not None:
        gate = g.cumsum(1).transpose(1, 2)  # [B, HQ, T]
        logits = logits + gate[..., :, None] - gate[..., None, :]
    probs = (scale * logits).softmax(-1)
    o = probs @ v.repeat_interleave(HQ // H, dim=2).transpose(1, 2)
    return o.transpose(1, 2), k_cache


def make_inputs(
    B: int,
    T: int,
    HQ: int,
    H: int,
    D: int,
    DV: int | None = None,
    *,
    gate: bool = False,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> dict[str, torch.Tensor | None]:
    """Random PaTH inputs with FLA's shapes, as leaf tensors requiring grad (g is None without gate)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype)

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=generator, dtype=dtype)

    inputs = {
        "q": randn(B, T, HQ, D),
        "k": randn(B, T, H, D),
        "v": randn(B, T, H, DV or D),
        "w": F.normalize(randn(B, T, H, D), dim=-1),
        # beta in (0, 2) covers reflections with negative eigenvalue 1 - beta
        "beta": uniform(0.05, 1.95, B, T, H),
        # log forget gate <= 0; strong enough that a sign or offset error in G shows
        "g": uniform(0.5, 1.0, B, T, HQ).log() if gate else None,
    }
    return {name: None if x is None else x.requires_grad_() for name, x in inputs.items()}


def relative_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64. An exactly zero reference is compared absolutely, ||out||: the gradients of
    q, k, w and beta for a one-token sequence (a softmax of one entry) are zero, which the torch backend's written-out
    backward meets to rounding (1e-16), not exactly."""
    ref, out = ref.detach().double(), out.detach().double()
    scale = ref.norm()
    return ((out - ref).norm() / (scale if scale > 0 else 1.0)).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, rtol: float) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    error = relative_error(ref, out)
    assert error <= rtol, f"{name}: relative error {error:.3e} > {rtol:.1e}"
