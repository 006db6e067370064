"""The positional-encoding lab (`lab/pe_lab`): the properties each encoding is defined by, the tasks' answers,
and the whole pipeline reduced (`--quick`: the outputs exist and are well formed; no number is checked)."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from lab.pe_lab import rope_by_hand
from lab.pe_lab.positions import (
    ENCODINGS,
    RESCALED_ROPE,
    RESCALINGS,
    AccumulatedSO2,
    ALiBi,
    NoPE,
    PaTH,
    RoPE,
    Shape,
    rope_frequencies,
    rotate,
)
from lab.pe_lab.tasks import FlipFlop, KeyCopy
from path_hf.evaluation import IGNORE_INDEX
from tests import processes
from tests.ops.path_reference import assert_close, path_attention_reference, path_scores_reference

ROOT = Path(__file__).resolve().parent.parent
SHAPE = Shape(hidden_size=24, num_heads=2, head_dim=12, train_length=8, max_length=64)


def heads(length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random q, k, v `[1, T, H, D]` and hidden `[1, T, C]`."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, 1, length, SHAPE.num_heads, SHAPE.head_dim, generator=generator)
    return q, k, v, torch.randn(1, length, SHAPE.hidden_size, generator=generator)


def depends_on_offset_only(logits: torch.Tensor) -> bool:
    """Whether `[..., T, T]` logits are constant along every diagonal j - i = const (j <= i)."""
    length = logits.shape[-1]
    return all(
        torch.allclose(diagonal, diagonal[..., :1].expand_as(diagonal), atol=1e-5)
        for diagonal in (logits.diagonal(-offset, -2, -1) for offset in range(length))
    )


@pytest.mark.parametrize("rescaling", [None, *RESCALINGS])
def test_rope_scores_are_invariant_to_a_shift_of_both_positions(rescaling):
    # the same q at every query position and the same k at every key: the score of (i, j) is then a function of the
    # positions alone, and RoPE (rescaled or not) makes it a function of i - j, i.e. constant along each diagonal
    length = 4 * SHAPE.train_length  # beyond the training length, where the rescalings act
    q, k, _, hidden = heads(1)
    q, k = q.expand(1, length, -1, -1), k.expand(1, length, -1, -1)
    rope = RoPE(SHAPE)
    with rope.rescaled(rescaling):
        assert depends_on_offset_only(rope.logits(q, k, hidden))
    # the check can fail: keys turned at 1.5 times their position break the invariance
    inv_freq, _ = rope_frequencies(SHAPE)
    position = torch.arange(length, dtype=torch.float32)[:, None, None]
    broken = torch.einsum("bihd,bjhd->bhij", rotate(q, position * inv_freq), rotate(k, 1.5 * position * inv_freq))
    assert not depends_on_offset_only(broken.tril())


def test_rope_rescalings_are_those_of_their_papers():
    plain, one = rope_frequencies(SHAPE)
    assert one == 1.0
    factor, dim = 4.0, SHAPE.head_dim
    pi, _ = rope_frequencies(SHAPE, "pi", factor)
    torch.testing.assert_close(pi, plain / factor)
    ntk, _ = rope_frequencies(SHAPE, "ntk", factor)  # base -> base * factor^(d / (d - 2))
    base = SHAPE.rope_theta * factor ** (dim / (dim - 2))
    torch.testing.assert_close(ntk, base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    yarn, temperature = rope_frequencies(SHAPE, "yarn", factor)
    assert temperature == pytest.approx(0.1 * math.log(factor) + 1)
    assert yarn[0] == pytest.approx(plain[0]) and yarn[-1] == pytest.approx(plain[-1] / factor)  # by parts
    longrope, attention = rope_frequencies(SHAPE, "longrope", factor)
    assert attention == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(SHAPE.train_length)))
    ramp = plain / longrope  # 1 for the fastest frequency, `factor` for the slowest, geometric between
    torch.testing.assert_close(ramp, factor ** torch.linspace(0, 1, dim // 2))
    for rescaling in RESCALINGS:  # at the training length every rescaling is plain RoPE
        torch.testing.assert_close(rope_frequencies(SHAPE, rescaling, 1.0)[0], plain)


def explicit_transport(step_angles: torch.Tensor, j: int, i: int) -> torch.Tensor:
    """P_{j->i} = M_i ... M_{j+1} `[H, D, D]` as a product of the per-token rotation matrices."""
    eye = torch.eye(SHAPE.head_dim, dtype=torch.float64)
    product = eye.expand(SHAPE.num_heads, -1, -1)
    for t in range(j + 1, i + 1):
        # rotate() turns each row of I, so the matrix of the map is its transpose
        step = rotate(eye, step_angles[0, t, :, None, :].double()).transpose(-1, -2)
        product = step @ product
    return product


@pytest.mark.parametrize("values", [False, True], ids=["QK", "QKV"])
def test_accumulated_so2_transport_composes_and_is_what_attention_reads(values):
    torch.manual_seed(0)
    so2 = AccumulatedSO2(SHAPE, learned=True, values=values)
    torch.nn.init.normal_(so2.angle_proj.bias)  # turns of order 1 per token
    length = 9
    q, k, v, hidden = heads(length)
    with torch.no_grad():
        steps = so2.step_angles(hidden)
        probabilities = so2.probabilities(q, k, hidden)
        logits, out = so2.logits(q, k, hidden), so2(q, k, v, hidden)
    for j, k_mid, i in [(0, 4, 8), (1, 2, 3), (2, 7, 8), (0, 0, 5)]:
        torch.testing.assert_close(
            explicit_transport(steps, j, i),
            explicit_transport(steps, k_mid, i) @ explicit_transport(steps, j, k_mid),
        )
    for i in range(length):
        transports = torch.stack([explicit_transport(steps, j, i) for j in range(i + 1)], 1)  # [H, j, D, D]
        moved_keys = torch.einsum("hjde,jhe->hjd", transports, k[0, : i + 1].double())
        expected = SHAPE.head_dim**-0.5 * torch.einsum("hd,hjd->hj", q[0, i].double(), moved_keys)
        torch.testing.assert_close(logits[0, :, i, : i + 1].double(), expected, rtol=1e-4, atol=1e-5)
        moved = v[0, : i + 1].double()
        if values:
            moved = torch.einsum("hjde,jhe->jhd", transports, moved)
        expected_out = torch.einsum("hj,jhd->hd", probabilities[0, :, i, : i + 1].double(), moved)
        torch.testing.assert_close(out[0, i].double(), expected_out, rtol=1e-4, atol=1e-5)


def test_alibi_bias_is_linear_in_distance():
    alibi = ALiBi(SHAPE)
    length = 16
    bias = alibi.bias(length, torch.device("cpu"))  # [H, T, T]
    slopes = 2.0 ** (-8.0 * torch.arange(1, SHAPE.num_heads + 1) / SHAPE.num_heads)
    for h, slope in enumerate(slopes.tolist()):
        for i in range(length):
            row = bias[h, i, : i + 1]  # keys j = 0..i
            assert row[-1] == 0  # no penalty at distance 0
            torch.testing.assert_close(row[1:] - row[:-1], torch.full((i,), slope))  # one slope per step back
            torch.testing.assert_close(row, -slope * (i - torch.arange(i + 1, dtype=torch.float32)))
    # and it is what the logits get: the zero-q, zero-k logits are the bias itself
    q, k, _, hidden = heads(length)
    logits = alibi.logits(torch.zeros_like(q), torch.zeros_like(k), hidden)[0]
    torch.testing.assert_close(logits.tril(), bias.tril())


@pytest.mark.parametrize(
    ("learned", "values"), [(True, False), (True, True), (False, False), (False, True)], ids=["learned-QK",
    "learned-QKV", "random-QK", "random-QKV"]
)  # fmt: skip
def test_so2_with_all_angles_zero_is_nope(learned, values):
    torch.manual_seed(0)
    so2 = AccumulatedSO2(SHAPE, learned=learned, values=values)
    q, k, v, hidden = heads(12)
    nope = NoPE(SHAPE)(q, k, v, hidden)
    with torch.no_grad():
        if learned:
            torch.nn.init.normal_(so2.angle_proj.weight)
            assert not torch.allclose(so2(q, k, v, hidden), nope, atol=1e-3)  # turned: not NoPE
            so2.angle_proj.weight.zero_()
            so2.angle_proj.bias.zero_()
        else:
            assert not torch.allclose(so2(q, k, v, hidden), nope, atol=1e-3)
            so2.sigma.zero_()
        torch.testing.assert_close(so2(q, k, v, hidden), nope)


@pytest.mark.parametrize("forget_gate", [False, True], ids=["PaTH", "PaTH-FoX"])
def test_lab_path_equals_explicit_householder_products(forget_gate):
    torch.manual_seed(0)
    path = PaTH(SHAPE, forget_gate=forget_gate)
    path.chunk_size = 4  # several blocks: the torch backend's walk between them is exercised too
    with torch.no_grad():
        torch.nn.init.normal_(path.bt_proj.weight)  # beta spread over (0, 2)
        if forget_gate:
            torch.nn.init.normal_(path.g_proj.bias, mean=2.0)
    q, k, v, hidden = heads(11)
    with torch.no_grad():
        w, beta, g = path.householder(hidden)
        gate = None if g is None else g.double()
        expected, _ = path_attention_reference(*(x.double() for x in (q, k, v, w, beta)), g=gate)
        assert_close("o", expected, path(q, k, v, hidden), rtol=1e-5)
        scores, _ = path_scores_reference(*(x.double() for x in (q, k, w, beta)))
        if forget_gate:
            cumulative = gate.cumsum(1).transpose(1, 2)
            scores = scores + cumulative[..., :, None] - cumulative[..., None, :]
        causal = torch.ones(11, 11, dtype=torch.bool).tril()
        logits = path.logits(q, k, hidden)
        assert bool((logits[..., ~causal] == float("-inf")).all())
        assert_close("logits", SHAPE.head_dim**-0.5 * scores[..., causal], logits[..., causal], rtol=1e-5)
    assert torch.allclose(w.norm(dim=-1), torch.ones(())) and bool(((beta > 0) & (beta < 2)).all())


def test_key_copy_asks_for_the_value_of_an_earlier_pair():
    task = KeyCopy()
    tokens, targets = task.sample(64, 40, torch.Generator().manual_seed(0))
    for row, target in zip(tokens.tolist(), targets.tolist(), strict=True):
        asked = [t for t, y in enumerate(target) if y != IGNORE_INDEX]
        assert len(asked) == task.queries
        for t in asked:
            key, value = row[t], target[t]
            assert key < task.keys and task.keys <= value < task.keys + task.values and row[t + 1] == value
            pairs = [s for s in range(t - 1) if row[s] == key and row[s + 1] == value]
            assert len(pairs) == 1 and all(row[s] != key for s in range(t) if s not in (pairs[0], *asked))


def test_flip_flop_reads_give_the_latest_write():
    tokens, targets = FlipFlop().sample(64, 48, torch.Generator().manual_seed(0))
    write, read = 0, 1
    for row, target in zip(tokens.tolist(), targets.tolist(), strict=True):
        assert row[0] == write
        latest = None
        for t in range(0, len(row), 2):
            instruction, bit = row[t], row[t + 1]
            if instruction == read:
                assert target[t] == bit == latest
            else:
                assert target[t] == IGNORE_INDEX
                latest = bit if instruction == write else latest


def test_rope_by_hand():
    shift, relative = rope_by_hand.offset_only(trials=200)
    assert shift < 1e-8 and relative < 1e-8
    waves = rope_by_hand.wavelengths()
    assert math.ceil(waves[0]) == 7 and bool((waves[1:] > waves[:-1]).all())


@pytest.mark.slow
def test_the_lab_pipeline(tmp_path):
    out = tmp_path / "lab"
    command = [sys.executable, "-m", "lab.pe_lab", "--quick", "--output", str(out)]
    completed = processes.run(command, timeout=300, cwd=ROOT, env=processes.environment())
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert set(report["summary"]) == {"key-copy", "flip-flop", "text"}
    for task, result in report["summary"].items():
        encodings = report["settings"]["plan"][task]["encodings"]
        labels = {ENCODINGS[encoding].label for encoding in encodings} | set(RESCALED_ROPE.values())
        assert set(result["rows"]) == labels, task
        train_length = result["train_length"]
        lengths = {str(m * train_length) for m in report["settings"]["plan"][task]["multiples"]}
        for row in result["rows"].values():
            assert set(row["metric"]) == lengths
            assert all(math.isfinite(stats["mean"]) and stats["seeds"] >= 1 for stats in row["metric"].values())
            assert set(row["far_mass"]) == (lengths if task == "text" else set())
        assert (out / f"{task}.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "text-far-mass.png").read_bytes()[:4] == b"\x89PNG"
    assert len(report["runs"]) == sum(len(plan["encodings"]) for plan in report["settings"]["plan"].values())
    markdown = (out / "results.md").read_text()
    assert "### text: perplexity ratio" in markdown and "| PaTH-FoX |" in markdown
