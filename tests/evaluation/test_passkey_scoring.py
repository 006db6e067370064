"""Passkey scoring at the answer positions only (the verdicts of the whole logits, without forming them), the key at
given depths, and `path-hf eval --passkey-depths`."""

import json

import pytest
import torch
from torch import nn
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.cli import main
from path_hf.errors import EvaluationError
from path_hf.evaluation import (
    IGNORE_INDEX,
    PASSKEY_FILLER,
    PASSKEY_INTRO,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
    EvalOptions,
    ModelSpec,
    Window,
    accuracy_by_depth,
    answer_accuracy,
    answer_scores,
    parse_depths,
    passkey_accuracy,
    passkey_windows,
    scoring,
)
from path_hf.evaluation.scoring import position_logits, window_batches
from tests.evaluation.eval_models import EVAL_DATA, shapes


def tiny_model(kind: str, tokenizer) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shapes(tokenizer))).eval()
    return PaTHLlamaForCausalLM(PaTHLlamaConfig(**shapes(tokenizer), path_backend="torch")).eval()


@torch.no_grad()
def whole_logits_verdicts(model: nn.Module, windows: list[Window], batch_size: int) -> list[bool]:
    """The reference: the model's full `[B, T, vocab]` logits of each padded batch, argmax at every position, each
    labelled token compared."""
    verdicts = []
    for input_ids, attention_mask, labels in window_batches(windows, batch_size):
        predicted = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].argmax(-1)
        targets = labels[:, 1:]
        verdicts += ((predicted == targets) | (targets == IGNORE_INDEX)).all(1).tolist()
    return verdicts


@torch.no_grad()
def greedy(model: nn.Module, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """`prompt` and `steps` tokens of greedy decoding after it, one full forward per token."""
    ids = prompt
    for _ in range(steps):
        ids = torch.cat([ids, model(input_ids=ids[None]).logits[0, -1].argmax()[None]])
    return ids


def mixed_windows(model: nn.Module, tokenizer) -> list[Window]:
    """Windows of several lengths whose verdicts are known: passkey prompts answered with what greedy decoding
    writes (right), the same with one answer token changed (wrong), and the real keys (a random model misses them)."""
    windows = []
    for trial, window in enumerate(passkey_windows(tokenizer, 160, trials=4, seed=7)):
        real = window.labels != IGNORE_INDEX
        prompt = window.input_ids[~real][: 100 + 13 * trial]  # four lengths
        answer = 1 + trial % 3
        right = greedy(model, prompt, answer)
        wrong = right.clone()
        wrong[-1 - trial % answer] = (wrong[-1 - trial % answer] + 1) % len(tokenizer)
        for ids in (right, wrong):
            labels = torch.full_like(ids, IGNORE_INDEX)
            labels[len(prompt) :] = ids[len(prompt) :]
            windows.append(Window(ids, labels))
        windows.append(window)
    return windows


@pytest.mark.parametrize("kind", ["llama", "path"])
def test_answer_positions_give_the_verdicts_of_the_whole_logits(kind, tokenizer):
    model = tiny_model(kind, tokenizer)
    windows = mixed_windows(model, tokenizer)
    assert len({len(window.input_ids) for window in windows}) > 4  # padded batches
    for batch_size in (1, 5, len(windows)):
        reference = whole_logits_verdicts(model, windows, batch_size)
        assert reference[0::3] == [True] * 4 and reference[1::3] == [False] * 4
        assert answer_accuracy(model, windows, batch_size=batch_size) == reference
    # real passkey prompts of two lengths and several depths in one batch
    prompts = passkey_windows(tokenizer, 200, trials=2, depths=(0, 0.5, 1)) + passkey_windows(tokenizer, 128, 3)
    assert answer_accuracy(model, prompts, batch_size=4) == whole_logits_verdicts(model, prompts, 4)


@torch.no_grad()
def whole_logits_answer_nll(model: nn.Module, window: Window) -> tuple[float, int]:
    """The reference: one window alone, unpadded, its full logits; the summed negative log-likelihood of its labelled
    tokens (float64 log-softmax) and their number."""
    logits = model(input_ids=window.input_ids[None]).logits[0, :-1].double()
    targets = window.labels[1:]
    scored = targets != IGNORE_INDEX
    return -logits.log_softmax(-1)[scored, targets[scored]].sum().item(), int(scored.sum())


@pytest.mark.parametrize("kind", ["llama", "path"])
def test_answer_likelihood_is_that_of_the_whole_logits(kind, tokenizer):
    """`answer_scores`' per-window likelihood of the key, from padded batches of several lengths, is each window's
    own from its full logits; its verdicts are `answer_accuracy`'s."""
    model = tiny_model(kind, tokenizer)
    windows = mixed_windows(model, tokenizer)
    reference = [whole_logits_answer_nll(model, window) for window in windows]
    for batch_size in (1, 5):
        scores = answer_scores(model, windows, batch_size=batch_size)
        assert list(scores.tokens) == [count for _, count in reference]
        torch.testing.assert_close(
            torch.tensor(scores.nll_sum, dtype=torch.float64),
            torch.tensor([nll for nll, _ in reference], dtype=torch.float64),
            rtol=1e-4,
            atol=1e-4,
        )
        assert list(scores.all_correct) == whole_logits_verdicts(model, windows, batch_size)
    assert scores.nll == pytest.approx(sum(nll for nll, _ in reference) / sum(count for _, count in reference), 1e-4)


@pytest.mark.parametrize("kind", ["llama", "path"])
def test_the_whole_logits_are_never_formed(kind, tokenizer, monkeypatch):
    """The output embedding sees only the rows of the positions that predict a labelled token; the model's own
    forward (which would form `[B, T, vocab]` logits) is never called."""
    model = tiny_model(kind, tokenizer)
    windows = passkey_windows(tokenizer, 200, trials=3, depths=(0.2, 0.8)) + passkey_windows(tokenizer, 140, 2)
    expected = whole_logits_verdicts(model, windows, 3)
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: rows.append(args[0].shape))

    def no_forward(*args, **kwargs):
        raise AssertionError("the model's forward forms the logits of every position")

    monkeypatch.setattr(model, "forward", no_forward)
    try:
        assert answer_accuracy(model, windows, batch_size=3) == expected
    finally:
        hook.remove()
    answers = sum(int((window.labels[1:] != IGNORE_INDEX).sum()) for window in windows)
    assert len(rows) == 3 and all(len(shape) == 2 for shape in rows)  # [positions, hidden], one call a batch
    assert sum(shape[0] for shape in rows) == answers


def test_a_model_without_decoder_and_head_is_scored_whole(tokenizer):
    """Falls back to the model's forward when the generic API is missing: same verdicts."""

    class Wrapped(nn.Module):  # no get_decoder / get_output_embeddings
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    model = tiny_model("llama", tokenizer)
    windows = mixed_windows(model, tokenizer)
    assert scoring.output_head(Wrapped(model)) is None
    assert answer_accuracy(Wrapped(model), windows, batch_size=5) == whole_logits_verdicts(model, windows, 5)
    model.get_decoder = lambda: None  # a model that says it has none
    assert scoring.output_head(model) is None
    assert answer_accuracy(model, windows, batch_size=5) == whole_logits_verdicts(model, windows, 5)


@pytest.mark.parametrize(
    "model_class, config_class, options",
    [
        (Gemma2ForCausalLM, Gemma2Config, dict(final_logit_softcapping=0.5, head_dim=8, sliding_window=16)),
        (CohereForCausalLM, CohereConfig, dict(logit_scale=3.0)),
        (GraniteForCausalLM, GraniteConfig, dict(logits_scaling=0.25)),
        (
            FalconH1ForCausalLM,
            FalconH1Config,
            dict(lm_head_multiplier=3.0, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8),
        ),
    ],
    ids=["gemma2-softcap", "cohere-scale", "granite-scaling", "falcon-h1-multiplier"],
)
def test_the_head_applies_the_final_scaling(model_class, config_class, options, tokenizer):
    """Logits formed at some positions are the model's own there, soft-capping and scaling included."""
    config = config_class(**shapes(tokenizer) | options)
    torch.manual_seed(0)
    model = model_class(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    positions = torch.zeros_like(ids, dtype=torch.bool)
    positions[0, [3, 11]] = positions[1, [0, 8]] = True
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits[positions]
        logits = position_logits(model, ids, mask, positions, "cpu")
    assert scoring.output_head(model) is not None
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    plain = model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state)
    assert not torch.allclose(plain[0, 3], expected[0], atol=1e-3)  # the scaling matters here


def piece(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_key_at_each_depth(tokenizer):
    depths = (0.0, 0.1, 0.5, 0.9, 1.0)
    windows = passkey_windows(tokenizer, 512, trials=3, seed=5, depths=depths)
    random_depth = passkey_windows(tokenizer, 512, trials=3, seed=5)
    assert len(windows) == 3 * len(depths)
    filler, intro, question = (piece(tokenizer, text) for text in (PASSKEY_FILLER, PASSKEY_INTRO, PASSKEY_QUESTION))
    start = 1 + len(intro)  # BOS, then the intro
    for j, window in enumerate(windows):
        trial, depth = divmod(j, len(depths))
        answer = window.labels[window.labels != IGNORE_INDEX]
        key = tokenizer.decode(answer).strip()
        assert key == tokenizer.decode(random_depth[trial].labels[random_depth[trial].labels != IGNORE_INDEX]).strip()
        needle = piece(tokenizer, PASSKEY_NEEDLE.format(key=key))
        ids = window.input_ids.tolist()
        at = next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)
        end = len(ids) - len(answer) - len(question)  # where the question starts
        span = end - start - len(needle)  # the filler's tokens
        assert span % len(filler) == 0 and span // len(filler) >= 8
        # within one filler sentence of the asked depth
        assert abs(at - start - depths[depth] * span) <= len(filler) / 2
        if depths[depth] == 0.0:
            assert at == start  # right after the intro
        if depths[depth] == 1.0:
            assert at + len(needle) == end  # right before the question
    for bad in ([1.5], [-0.1], [float("nan")], []):
        with pytest.raises(ValueError, match="depth"):
            passkey_windows(tokenizer, 512, trials=1, depths=bad)


def test_accuracy_by_depth():
    correct = [True, False, True, True, False, False]  # two trials at three depths, trial by trial
    assert accuracy_by_depth(correct, (0.1, 0.5, 0.9)) == {0.1: 1.0, 0.5: 0.0, 0.9: 0.5}
    with pytest.raises(ValueError, match="whole number of trials"):
        accuracy_by_depth(correct, (0.1, 0.5, 0.9, 1.0))
    with pytest.raises(ValueError, match="whole number of trials"):
        accuracy_by_depth([], (0.5,))


def test_passkey_accuracy_at_depths(tokenizer):
    model = tiny_model("llama", tokenizer)
    windows = passkey_windows(tokenizer, 160, trials=2, depths=(0.25, 0.75))
    correct = answer_accuracy(model, windows)
    assert passkey_accuracy(model, tokenizer, 160, trials=2, depths=(0.25, 0.75)) == sum(correct) / 4


def test_eval_reports_retrieval_by_depth(checkpoints, tmp_path):
    """path-hf eval's passkey cell: the depths asked for, found/trials at each and in all (the trials' own verdicts),
    a Wilson interval around the rate, and a length too short for a prompt reported as such."""
    output = tmp_path / "eval.json"
    code = main([
        "eval", "--model", str(checkpoints["llama"]), "--data", str(EVAL_DATA), "--lengths", "32,160",
        "--max-tokens", "160", "--passkey-trials", "6", "--passkey-depths", "1,0.5,0", "--output", str(output),
        "--no-progress",
    ])  # fmt: skip
    assert code == 0
    report = json.loads(output.read_text())
    assert report["passkey_depths"] == [0.0, 0.5, 1.0]
    lengths = report["models"]["llama"]["lengths"]
    assert lengths["32"]["passkey"] is None and "too short for a passkey prompt" in lengths["32"]["passkey_error"]
    entry, trials = lengths["160"]["passkey"], lengths["160"]["passkey_trials"]
    assert len(trials) == entry["trials"] == 6 and entry["found"] == sum(trial["found"] for trial in trials)
    assert sorted(trial["depth"] for trial in trials) == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    for depth, cell in entry["by_depth"].items():
        at_depth = [trial for trial in trials if trial["depth"] == float(depth)]
        assert cell == {"found": sum(trial["found"] for trial in at_depth), "trials": len(at_depth)}
    low, high = entry["wilson95"]
    assert 0 <= low <= entry["found"] / 6 <= high <= 1 and high - low > 0.3  # six trials cannot pin a rate down


def test_bad_depths_are_refused(checkpoints, capsys):
    assert parse_depths("0.9, 0.1,0.5,0.5") == (0.1, 0.5, 0.9)
    for bad, message in [
        ("", "give one or more depths"),
        ("a,b", "not a comma-separated list of numbers"),
        ("0.5,1.5", "each depth must be between 0 (the key first) and 1 (right before the question), got 1.5"),
        ("-0.1", "got -0.1"),
        ("nan", "got nan"),
    ]:
        with pytest.raises(ValueError, match="--passkey-depths") as error:
            parse_depths(bad)
        assert message in str(error.value)
        with pytest.raises(SystemExit):  # argparse: exit code 2 and the message
            main(["eval", "--model", "x", "--data", "y", "--lengths", "32", "--passkey-depths", bad])
        assert "--passkey-depths" in capsys.readouterr().err
    options = dict(models=[ModelSpec.parse(str(checkpoints["llama"]))], data=[str(EVAL_DATA)], lengths=(32,))
    for bad in ((0.5, 2.0), ()):
        with pytest.raises(EvaluationError, match="--passkey-depths"):
            EvalOptions(**options, passkey_depths=bad).check()
    EvalOptions(**options, passkey_depths=(0.0, 1.0)).check()
