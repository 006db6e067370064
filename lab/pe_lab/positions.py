# Copyright 2026 The path-hf authors. Apache-2.0.
"""The lab's position encodings, one small module each, all behind one interface.

An encoding is the attention core of a layer: it receives the projected heads `q, k, v` `[B, T, H, D]` and the layer's
normalised input `hidden` `[B, T, C]` (which data-dependent encodings read), and returns the causal attention output
`[B, T, H, D]`. Every encoding but PaTH computes explicit logits (`logits`), so that the probabilities the model uses
are exactly those the far-mass measurement reads (`attend` returns both); PaTH attends through `path_hf.ops` and
computes its probabilities apart, as decoding would. Absolute encodings (sinusoidal, learned) add a table to the
token embeddings instead (`Encoding.absolute`) and leave the attention as NoPE.

    logits_ij = scale * q_i . k_j + bias_ij             bias: T5 buckets, ALiBi's -m (i - j), or 0
    RoPE:        q_i . R((j - i) theta) k_j                   (q_i turned by i theta, k_j by j theta)
    SO(2) route: q_i . R(Phi_i - Phi_j) k_j,   Phi_t = phi_1 + ... + phi_t   (the tokens' own angles, accumulated)
    PaTH:        q_i . H_i H_{i-1} ... H_{j+1} k_j,   H_t = I - beta_t w_t w_t^T         (path_hf.ops)

Rotations turn the plane of dims (p, p + D/2) of each head, transformers' `rotate_half` convention.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half
from transformers.models.t5.modeling_t5 import T5Attention

from path_hf.ops import path_attention, path_decode_update


@dataclass(frozen=True)
class Shape:
    """What an encoding needs to know about the model it sits in."""

    hidden_size: int
    num_heads: int
    head_dim: int
    train_length: int  # the context the model is trained at (RoPE rescalings, T5 buckets, SO(2) mixing windows)
    max_length: int  # the longest context it is evaluated at (the learned table's size)
    rope_theta: float = 10000.0


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Turn each plane (p, p + D/2) of `x` `[..., D]` by `angles` `[..., D/2]` (broadcast)."""
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x * cos + rotate_half(x) * sin


def causal_mask(length: int, device: torch.device | None = None) -> torch.Tensor:
    """`[T, T]` True where query i may read key j (j <= i)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


class NoPE(nn.Module):
    """No position encoding: causal softmax attention and nothing else (Kazemnejad et al., 2023, "The Impact of
    Positional Encoding on Length Generalization in Transformers"; the causal mask alone leaks order). The base class
    of the others: they change `transform` (q, k), `bias` (additive logits) or the whole `forward`."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape
        self.scale = shape.head_dim**-0.5

    def transform(self, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k `[B, T, H, D]` as the scores see them."""
        return q, k

    def bias(self, length: int, device: torch.device) -> torch.Tensor | None:
        """Additive logits `[H, T, T]` (after the scale), or None."""
        return None

    def logits(self, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attention logits `[B, H, T, T]`, -inf above the diagonal."""
        q, k = self.transform(q, k, hidden)
        logits = self.scale * torch.einsum("bihd,bjhd->bhij", q, k)
        bias = self.bias(q.shape[1], q.device)
        if bias is not None:
            logits = logits + bias
        return logits.masked_fill(~causal_mask(q.shape[1], q.device), float("-inf"))

    def probabilities(self, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attention probabilities `[B, H, T, T]` (rows sum to 1 over j <= i)."""
        return self.logits(q, k, hidden).softmax(-1)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output `[B, T, H, D]` and the probabilities it was computed with `[B, H, T, T]`."""
        probabilities = self.probabilities(q, k, hidden)
        return torch.einsum("bhij,bjhd->bihd", probabilities, v), probabilities

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attend(q, k, v, hidden)[0]


# Absolute encodings: added to the token embeddings once, at the input (`ABSOLUTE`); the layers attend as NoPE.


class Sinusoidal(nn.Module):
    """Fixed sinusoids added to the token embeddings (Vaswani et al., 2017, §3.5; seeds 002 and 004 §"Absolute
    sinusoidal"): PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)). As in the paper
    (§3.4) the embeddings are multiplied by sqrt(d) first; without it the O(1) sinusoids drown the 0.02-scale token
    embeddings."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        d = shape.hidden_size
        position = torch.arange(shape.max_length, dtype=torch.float32)[:, None]
        angle = position / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        table = torch.stack([angle.sin(), angle.cos()], -1).flatten(-2)  # interleaved: dims 2i, 2i+1
        self.register_buffer("table", table, persistent=False)
        self.embedding_scale = math.sqrt(d)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The input of the first layer, from the token embeddings `[B, T, C]` of positions 0..T-1."""
        return embeddings * self.embedding_scale + self.table[: embeddings.shape[1]]


class LearnedAbsolute(nn.Module):
    """A trained vector per position added to the token embeddings (BERT, GPT-2; seed 002 §"Learned PE"). The table
    has a row for every evaluated position, but training only moves the first `train_length`: longer contexts read
    rows at their initial values (weight decay aside), which is what "no encoding was learned there" means."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.table = nn.Embedding(shape.max_length, shape.hidden_size)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return embeddings + self.table.weight[: embeddings.shape[1]]


# Additive biases on the logits.


class T5Bias(NoPE):
    """A learned scalar per head and distance bucket (Raffel et al., 2020, T5 §2.1; seed 002 §"Relative PE"): exact
    buckets for short distances, logarithmic ones up to `max_distance`, one bucket for everything further. The causal
    bucketing is transformers' own (`T5Attention._relative_position_bucket`, `bidirectional=False`), with
    `max_distance` the training length, so that every bucket is trained (T5's 32 buckets, fewer for contexts under 64:
    half of them are exact, and the logarithmic half must span more than one distance)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__(shape)
        self.num_buckets = min(32, shape.train_length // 2)
        self.relative_attention_bias = nn.Embedding(self.num_buckets, shape.num_heads)

    def buckets(self, length: int, device: torch.device) -> torch.Tensor:
        position = torch.arange(length, device=device)
        return T5Attention._relative_position_bucket(
            position[None, :] - position[:, None],  # key - query: <= 0 where causal
            bidirectional=False,
            num_buckets=self.num_buckets,
            max_distance=self.shape.train_length,
        )

    def bias(self, length: int, device: torch.device) -> torch.Tensor:
        return self.relative_attention_bias(self.buckets(length, device)).permute(2, 0, 1)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's head slopes m_h = 2^(-8h/H), h = 1..H (Press et al., 2022, §3; for H a power of two)."""
    return 2.0 ** (-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32) / num_heads)


class ALiBi(NoPE):
    """A fixed linear distance penalty per head on the logits, logits_ij += -m_h (i - j) (Press et al., 2022, "Train
    Short, Test Long"; seeds 002 and 004 §"ALiBi"). No parameters; the explicit far-mass control of seed 003."""

    def __init__(self, shape: Shape) -> None:
        super().__init__(shape)
        self.register_buffer("slopes", alibi_slopes(shape.num_heads), persistent=False)

    def bias(self, length: int, device: torch.device) -> torch.Tensor:
        position = torch.arange(length, device=device, dtype=torch.float32)
        distance = (position[:, None] - position[None, :]).clamp_min(0)  # i - j; above the diagonal is masked
        return -self.slopes.to(device)[:, None, None] * distance


# Rotations of q and k.

RESCALINGS = ("pi", "ntk", "yarn", "longrope")


def rope_frequencies(shape: Shape, rescaling: str | None = None, factor: float = 1.0) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies `[D/2]` and the attention factor that scales cos and sin, from transformers' own
    functions: the default, or a test-time rescaling by `factor` (the evaluated length over the training length).

    - "pi": position interpolation (Chen et al., 2023): every frequency divided by `factor` (transformers "linear").
    - "ntk": NTK-aware scaling (bloc97, 2023; seed 004): base -> base * factor^(D/(D-2)). transformers' "dynamic"
      computes exactly this at seq_len = factor * train_length with its own factor set to 1.
    - "yarn": YaRN (Peng et al., 2023): NTK-by-parts interpolation and the attention temperature 0.1 ln(factor) + 1.
    - "longrope": LongRoPE-style (Ding et al., 2024): a rescale factor per frequency, through transformers'
      "longrope". LongRoPE finds the factors by evolutionary search; in its place we take a geometric ramp from 1
      (the fastest frequency, which training saw turn many times) to `factor` (the slowest), which is the monotone
      shape its searched factors have, and its attention factor sqrt(1 + ln(factor) / ln(train_length)).
    """
    parameters: dict = {"rope_type": "default", "rope_theta": shape.rope_theta}
    seq_len = None
    if rescaling is not None and factor > 1:
        if rescaling not in RESCALINGS:
            raise ValueError(f"unknown RoPE rescaling {rescaling!r}: use one of {', '.join(RESCALINGS)}")
        if rescaling == "pi":
            parameters |= {"rope_type": "linear", "factor": factor}
        elif rescaling == "ntk":
            parameters |= {"rope_type": "dynamic", "factor": 1.0}
            seq_len = round(factor * shape.train_length)
        elif rescaling == "yarn":
            parameters |= {
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": shape.train_length,
            }
        else:
            ramp = (factor ** torch.linspace(0, 1, shape.head_dim // 2)).tolist()
            parameters |= {"rope_type": "longrope", "factor": factor, "short_factor": ramp, "long_factor": ramp,
                           "original_max_position_embeddings": shape.train_length}  # fmt: skip
            seq_len = round(factor * shape.train_length)
    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.train_length,
        rope_parameters=parameters,
    )
    if parameters["rope_type"] == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, seq_len=seq_len)


class RoPE(NoPE):
    """Rotary position embedding (Su et al., 2021, RoFormer; seed 000 §RoPE, seed 004 §RoPE): q_i and k_j turned by
    i theta and j theta in every plane, theta_p = base^(-2p/D), so q_i . k_j depends on i - j only. Test-time
    rescalings (`rescaled`) swap the frequencies for those of `rope_frequencies(rescaling, T / train_length)` at
    evaluated lengths T beyond the training length; the weights do not change."""

    def __init__(self, shape: Shape) -> None:
        super().__init__(shape)
        self.rescaling: str | None = None

    @contextlib.contextmanager
    def rescaled(self, rescaling: str | None) -> Iterator[None]:
        """Within the block, contexts longer than the training length use `rescaling` (None: plain RoPE)."""
        previous, self.rescaling = self.rescaling, rescaling
        try:
            yield
        finally:
            self.rescaling = previous

    def transform(self, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = q.shape[1]
        inv_freq, attention_factor = rope_frequencies(self.shape, self.rescaling, length / self.shape.train_length)
        angles = torch.arange(length, dtype=torch.float32, device=q.device)[:, None] * inv_freq.to(q.device)
        angles = angles[:, None, :]  # [T, 1, D/2]: every head alike
        # transformers multiplies cos and sin by the attention factor, i.e. q and k each by it
        return rotate(q, angles) * attention_factor, rotate(k, angles) * attention_factor


class AccumulatedSO2(NoPE):
    """Accumulated token-dependent SO(2) rotations (seed 003, "Why Do Accumulated Transformations Extrapolate?"): each
    token t turns every plane p by an angle phi_tp, and the route from key j to query i carries the product of the
    steps between them, P_{j->i} = M_i ... M_{j+1} = R(Phi_i - Phi_j) with Phi the running sum of the angles (SO(2)
    blocks commute, so the product is a sum of angles). Scores read q_i . P_{j->i} k_j.

    - `learned=False`: the steps are random, drawn afresh for every sequence, phi_tp ~ N(0, sigma_p^2): the spectral-gap
      assumption of 003 (E[M_t] has norm < 1), with per-plane mixing windows 2 / sigma_p^2 spread geometrically from 1
      token to the training length. They carry no content: only the route's length shows, as decoherence.
    - `learned=True`: phi_t = W_phi x_t (+ b) per head and plane, read from the layer's input: data-dependent.
    - `values=True` transports the values along the same route, o_i = sum_j a_ij P_{j->i} v_j (003 §"value-side
      protection"): far values then add with scattered phases instead of coherently.
    """

    def __init__(self, shape: Shape, learned: bool, values: bool) -> None:
        super().__init__(shape)
        self.learned, self.values = learned, values
        planes = shape.head_dim // 2
        if learned:
            self.angle_proj = nn.Linear(shape.hidden_size, shape.num_heads * planes)
        else:
            window = torch.logspace(0, math.log10(shape.train_length), planes)
            self.register_buffer("sigma", (2 / window).sqrt(), persistent=False)

    def step_angles(self, hidden: torch.Tensor) -> torch.Tensor:
        """phi `[B, T, H, D/2]`: each token's own step."""
        B, T, _ = hidden.shape
        H, planes = self.shape.num_heads, self.shape.head_dim // 2
        if self.learned:
            return self.angle_proj(hidden).view(B, T, H, planes).float()
        return torch.randn(B, T, H, planes, device=hidden.device) * self.sigma

    def route_angles(self, hidden: torch.Tensor) -> torch.Tensor:
        """Phi `[B, T, H, D/2]`: the running sum of the steps; the route j -> i turns by Phi_i - Phi_j."""
        return self.step_angles(hidden).cumsum(1)

    def logits_along(self, q: torch.Tensor, k: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
        # q_i . R(Phi_i - Phi_j) k_j = (R(-Phi_i) q_i) . (R(-Phi_j) k_j): the route moves both to a common frame
        return super().logits(rotate(q, -phi), rotate(k, -phi), phi)

    def logits(self, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_along(q, k, self.route_angles(hidden))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        phi = self.route_angles(hidden)  # one draw for the scores and the values alike
        probabilities = self.logits_along(q, k, phi).softmax(-1)
        if not self.values:
            return torch.einsum("bhij,bjhd->bihd", probabilities, v), probabilities
        # P_{j->i} v_j = R(Phi_i) R(-Phi_j) v_j: move the values to the common frame, and the output back to i's
        return rotate(torch.einsum("bhij,bjhd->bihd", probabilities, rotate(v, -phi)), phi), probabilities


# PaTH.


class PaTH(NoPE):
    """PaTH attention (Yang et al., 2025, "PaTH Attention: Position Encoding via Accumulating Householder
    Transformations"; seed 000 §"PaTH"): scores q_i . H_i ... H_{j+1} k_j with data-dependent Householder steps
    H_t = I - beta_t w_t w_t^T, run by `path_hf.ops.path_attention`. As FLA's layer: w_t = L2norm(SiLU(causal
    depthwise conv_3(W_w x_t))), beta_t = 2 sigmoid(W_beta x_t) in (0, 2). `forget_gate=True` is PaTH-FoX: the logits
    gain sum_{s=j+1..i} log sigmoid(W_f x_s) (Forgetting Transformer, Lin et al., 2025), a learned far-mass control."""

    conv_size = 3
    chunk_size = 64  # the torch backend's block: one block at the training length

    def __init__(self, shape: Shape, forget_gate: bool) -> None:
        super().__init__(shape)
        width = shape.num_heads * shape.head_dim
        self.w_proj = nn.Linear(shape.hidden_size, width, bias=False)
        self.w_conv1d = nn.Conv1d(width, width, self.conv_size, groups=width, padding=self.conv_size - 1, bias=False)
        self.bt_proj = nn.Linear(shape.hidden_size, shape.num_heads)
        self.g_proj = nn.Linear(shape.hidden_size, shape.num_heads) if forget_gate else None

    def householder(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """w `[B, T, H, D]` (unit), beta `[B, T, H]` in (0, 2) and the log forget gate g `[B, T, H]` (or None), fp32."""
        B, T, _ = hidden.shape
        w = self.w_conv1d(self.w_proj(hidden).transpose(1, 2))[..., :T].transpose(1, 2)  # causal: keep the first T
        w = F.normalize(F.silu(w).float().view(B, T, self.shape.num_heads, self.shape.head_dim), dim=-1)
        beta = self.bt_proj(hidden).float().sigmoid() * 2
        g = None if self.g_proj is None else F.logsigmoid(self.g_proj(hidden).float())
        return w, beta, g

    def logits(self, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The logits, token by token as decoding computes them: the cached keys are kept transformed, and token t's
        H_t is applied to all of them (`path_decode_update`) before t's query reads them. O(T^2 D); diagnostics."""
        w, beta, g = self.householder(hidden)
        B, T, H, D = k.shape
        keys = k.new_zeros(B, H, 0, D)
        rows = []
        for t in range(T):
            keys = torch.cat([path_decode_update(keys, w[:, t], beta[:, t]), k[:, t, :, None]], dim=2)
            rows.append(F.pad(torch.einsum("bhd,bhjd->bhj", q[:, t], keys), (0, T - t - 1), value=float("-inf")))
        logits = torch.stack(rows, dim=2)
        if g is not None:
            gate = g.cumsum(1).transpose(1, 2)  # [B, H, T]: G_i - G_j = sum of g over j+1..i
            logits = logits + gate[..., :, None] - gate[..., None, :]
        return self.scale * logits  # FLA's order: the gate is added before the scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        w, beta, g = self.householder(hidden)
        o, _ = path_attention(q, k, v, w, beta, g, backend="torch", chunk_size=self.chunk_size)
        return o

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self(q, k, v, hidden), self.probabilities(q, k, hidden)


@dataclass(frozen=True)
class Encoding:
    """A named encoding of the lab: the label in tables and plots, how a layer attends, and whether an absolute
    table is added to the embeddings."""

    label: str
    attention: type[NoPE]
    options: tuple[tuple[str, bool], ...] = ()
    absolute: type[nn.Module] | None = None

    def build(self, shape: Shape) -> NoPE:
        return self.attention(shape, **dict(self.options))


ENCODINGS: dict[str, Encoding] = {
    "nope": Encoding("NoPE", NoPE),
    "sinusoidal": Encoding("sinusoidal", NoPE, absolute=Sinusoidal),
    "learned": Encoding("learned absolute", NoPE, absolute=LearnedAbsolute),
    "t5": Encoding("T5 bias", T5Bias),
    "alibi": Encoding("ALiBi", ALiBi),
    "rope": Encoding("RoPE", RoPE),
    "so2-random-qk": Encoding("SO(2) random, QK", AccumulatedSO2, (("learned", False), ("values", False))),
    "so2-random-qkv": Encoding("SO(2) random, QKV", AccumulatedSO2, (("learned", False), ("values", True))),
    "so2-learned-qk": Encoding("SO(2) learned, QK", AccumulatedSO2, (("learned", True), ("values", False))),
    "so2-learned-qkv": Encoding("SO(2) learned, QKV", AccumulatedSO2, (("learned", True), ("values", True))),
    "path": Encoding("PaTH", PaTH, (("forget_gate", False),)),
    "path-fox": Encoding("PaTH-FoX", PaTH, (("forget_gate", True),)),
}
# Evaluated on the trained RoPE model: the frequencies change at test time only.
RESCALED_ROPE = {f"rope+{rescaling}": f"RoPE + {label}" for rescaling, label in zip(
    RESCALINGS, ("PI", "NTK-aware", "YaRN", "LongRoPE-style"), strict=True
)}  # fmt: skip
