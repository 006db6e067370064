"""Copy retrieval: the windows (a span of the text, more text, the span again), the scores at the repeat's positions
against whole logits, a model built to copy, and `path-hf eval --copy-trials / --copy-span`."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.cli import main
from path_hf.evaluation import (
    IGNORE_INDEX,
    CopyResult,
    Window,
    copy_accuracy,
    copy_scores,
    copy_windows,
    read_texts,
    tokenize_stream,
)
from tests.evaluation.eval_models import EVAL_DATA, shapes

PREFIX = [1]  # the test tokenizer's BOS


def tiny_model(kind: str, tokenizer) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shapes(tokenizer))).eval()
    return PaTHLlamaForCausalLM(PaTHLlamaConfig(**shapes(tokenizer), path_backend="torch")).eval()


def eval_stream(tokenizer, max_tokens: int) -> list[int]:
    return tokenize_stream(read_texts([EVAL_DATA]), tokenizer, max_tokens)


@torch.no_grad()
def reference_scores(model: nn.Module, windows: list[Window]) -> CopyResult:
    """The reference: one unpadded forward per window, its whole `[T, vocab]` logits, argmax and log-softmax (float64)
    at every position, kept where the next token is labelled."""
    correct, nll_sum, tokens = [], [], []
    for window in windows:
        logits = model(input_ids=window.input_ids[None]).logits[0, :-1].double()
        targets = window.labels[1:]
        scored = targets != IGNORE_INDEX
        log_probs = F.log_softmax(logits[scored], -1)
        correct.append(int((logits[scored].argmax(-1) == targets[scored]).sum()))
        nll_sum.append(-log_probs.gather(1, targets[scored, None]).sum().item())
        tokens.append(int(scored.sum()))
    return CopyResult(tuple(correct), tuple(nll_sum), tuple(tokens))


def assert_same_scores(result: CopyResult, reference: CopyResult) -> None:
    assert result.correct == reference.correct and result.tokens == reference.tokens
    assert result.nll_sum == pytest.approx(reference.nll_sum, rel=1e-5)


# --- the windows -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, span, prefix", [(64, 8, PREFIX), (64, 16, []), (33, 16, PREFIX), (40, 2, [5, 6])])
def test_the_windows(length, span, prefix):
    stream = list(range(10, 510))  # distinct ids: a window's text tells where in the stream it was taken
    windows = copy_windows(stream, length, trials=6, span=span, seed=3, prefix=prefix)
    assert len(windows) == 6
    starts = []
    for window in windows:
        ids, labels = window.input_ids.tolist(), window.labels
        assert len(ids) == len(labels) == length
        assert ids[: len(prefix)] == prefix
        source = ids[len(prefix) : len(prefix) + span]
        assert ids[length - span :] == source  # the span, repeated exactly at the end
        start = ids[len(prefix)] - 10
        text = length - len(prefix) - span
        assert ids[len(prefix) : length - span] == stream[start : start + text]  # the span and the text after it
        starts.append(start)
        # labelled: the repeat but its first token
        assert (labels[: length - span + 1] == IGNORE_INDEX).all()
        assert labels[length - span + 1 :].tolist() == ids[length - span + 1 :]
        assert window.scored == span - 1
    assert len(set(starts)) == 6  # a different place each trial
    again = copy_windows(stream, length, trials=6, span=span, seed=3, prefix=prefix)
    assert all(
        torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        for a, b in zip(windows, again, strict=True)
    )
    more = copy_windows(stream, length, trials=9, span=span, seed=3, prefix=prefix)
    assert all(
        torch.equal(a.input_ids, b.input_ids) for a, b in zip(windows, more[:6], strict=True)
    )  # the first trials stay
    other = copy_windows(stream, length, trials=6, span=span, seed=4, prefix=prefix)
    assert [window.input_ids.tolist() for window in other] != [window.input_ids.tolist() for window in windows]


def test_windows_that_cannot_be_made():
    stream = list(range(100))
    with pytest.raises(ValueError, match="too short for a copy window with a 16-token span: it needs at least 33"):
        copy_windows(stream, 32, trials=1, span=16, prefix=PREFIX)
    copy_windows(stream, 32, trials=1, span=16)  # without a prefix, the span twice fits
    with pytest.raises(ValueError, match="the stream of 100 tokens is too short for a copy window of 128 tokens"):
        copy_windows(stream, 128, trials=1, span=16, prefix=PREFIX)
    # 100 - (64 - 1 - 16) + 1 = 54 places
    assert len(copy_windows(stream, 64, trials=54, span=16, prefix=PREFIX)) == 54
    with pytest.raises(ValueError, match="holds 54 different copy windows .* fewer than the 55 trials"):
        copy_windows(stream, 64, trials=55, span=16, prefix=PREFIX)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        copy_windows(stream, 64, trials=1, span=1)
    assert copy_windows(stream, 64, trials=0, span=16) == []


# --- the scores against whole logits ----------------------------------------------------------------------------


def mixed_windows(tokenizer) -> list[Window]:
    """Copy windows of the evaluation text at two lengths (padded batches)."""
    stream = eval_stream(tokenizer, 300)
    return copy_windows(stream, 96, 3, span=16, seed=1, prefix=PREFIX) + copy_windows(stream, 64, 2, 8, prefix=PREFIX)


@pytest.mark.parametrize("kind", ["llama", "path"])
def test_scores_equal_the_whole_logits(kind, tokenizer):
    model = tiny_model(kind, tokenizer)
    windows = mixed_windows(tokenizer)
    reference = reference_scores(model, windows)
    assert reference.tokens == (15, 15, 15, 7, 7)
    for batch_size in (1, 2, len(windows)):
        assert_same_scores(copy_scores(model, windows, batch_size=batch_size), reference)
    result = copy_scores(model, windows)
    assert result.accuracy == sum(reference.correct) / 59
    assert result.nll == pytest.approx(sum(reference.nll_sum) / 59, rel=1e-5)
    assert_same_scores(copy_scores(model, windows, batch_size=2, logits_chunk=7), reference)  # the rows in chunks


@pytest.mark.parametrize("kind", ["llama", "path"])
def test_the_whole_logits_are_never_formed(kind, tokenizer, monkeypatch):
    """The output embedding sees only the rows of the positions that predict a labelled token; the model's own
    forward (which would form `[B, T, vocab]` logits) is never called."""
    model = tiny_model(kind, tokenizer)
    windows = mixed_windows(tokenizer)
    reference = reference_scores(model, windows)
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: rows.append(args[0].shape))

    def no_forward(*args, **kwargs):
        raise AssertionError("the model's forward forms the logits of every position")

    monkeypatch.setattr(model, "forward", no_forward)
    try:
        assert_same_scores(copy_scores(model, windows, batch_size=3), reference)
    finally:
        hook.remove()
    assert len(rows) == 2 and all(len(shape) == 2 for shape in rows)  # [positions, hidden], one call a batch
    assert [shape[0] for shape in rows] == [45, 14]


def test_a_model_without_decoder_and_head_is_scored_whole(tokenizer):
    class Wrapped(nn.Module):  # no get_decoder / get_output_embeddings
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    model = tiny_model("llama", tokenizer)
    windows = mixed_windows(tokenizer)
    assert_same_scores(copy_scores(Wrapped(model), windows, batch_size=2), reference_scores(model, windows))


# --- a model built to copy --------------------------------------------------------------------------------------


class Copier(nn.Module):
    """A model that copies from `distance` tokens back: its logits at position t are `confidence` for the token at
    t + 1 - distance and 0 for every other (all 0 before that position exists). Its decoder writes that one-hot row
    as the hidden state and its output embedding is the identity, so it is scored like a transformers model."""

    class Decoder(nn.Module):
        def __init__(self, vocab: int, distance: int, confidence: float):
            super().__init__()
            self.vocab, self.distance, self.confidence = vocab, distance, confidence

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            source = torch.zeros_like(input_ids)
            source[:, self.distance - 1 :] = input_ids[:, : input_ids.shape[1] - self.distance + 1]
            hidden = F.one_hot(source, self.vocab).float() * self.confidence
            hidden[:, : self.distance - 1] = 0
            return SimpleNamespace(last_hidden_state=hidden)

    def __init__(self, vocab: int, distance: int, confidence: float = 4.0):
        super().__init__()
        self.decoder = self.Decoder(vocab, distance, confidence)
        self.head = nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(vocab))

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.head(self.decoder(input_ids).last_hidden_state))


def test_a_model_built_to_copy():
    vocab, length, span = 50, 80, 12
    rng = random.Random(0)
    stream = [rng.randrange(2, vocab) for _ in range(400)]
    windows = copy_windows(stream, length, trials=4, span=span, seed=2, prefix=PREFIX)
    distance = length - span - len(PREFIX)  # from the span to its repeat
    confidence = 4.0
    copier = Copier(vocab, distance, confidence)
    result = copy_scores(copier, windows, batch_size=3)
    assert_same_scores(result, reference_scores(copier, windows))
    assert result.correct == result.tokens == (span - 1,) * 4 and result.accuracy == 1.0
    # the copier's NLL, from its definition: the target has logit `confidence`, every other token 0
    assert result.nll == pytest.approx(math.log(math.exp(confidence) + vocab - 1) - confidence, rel=1e-6)
    assert copy_accuracy(copier, stream, length, 4, span, seed=2, prefix=PREFIX, batch_size=3) == result

    # copying from one token further back predicts the token before the right one: right only where they are equal
    late = copy_scores(Copier(vocab, distance + 1, confidence), windows)
    for window, correct in zip(windows, late.correct, strict=True):
        ids = window.input_ids.tolist()
        assert correct == sum(ids[t] == ids[t - 1] for t in range(length - span + 1, length))
    assert late.accuracy < 0.5

    # one source token changed: the copier misses exactly the one repeat token copied from it
    for k in (1, 5, span - 1):
        changed = [Window(window.input_ids.clone(), window.labels) for window in windows]
        at = len(PREFIX) + k
        changed[1].input_ids[at] = (changed[1].input_ids[at] + 1) % vocab
        flipped = copy_scores(copier, changed, batch_size=3)
        assert flipped.correct == (span - 1, span - 2, span - 1, span - 1)
        assert flipped.accuracy == (4 * (span - 1) - 1) / (4 * (span - 1))
        assert flipped.nll > result.nll
        assert_same_scores(flipped, reference_scores(copier, changed))
    # the span's first token (its repeat is not scored) and the text after the span are not copied from
    for at in (len(PREFIX), len(PREFIX) + span + 3):
        changed = [Window(window.input_ids.clone(), window.labels) for window in windows]
        changed[2].input_ids[at] = (changed[2].input_ids[at] + 1) % vocab
        assert copy_scores(copier, changed) == result


# --- path-hf eval ------------------------------------------------------------------------------------------------


def run_eval(*args) -> int:
    return main(["eval", "--data", str(EVAL_DATA), "--no-progress", "--passkey-trials", "0", *map(str, args)])


def test_eval_reports_copy_retrieval(checkpoints, tokenizer, tmp_path, capsys):
    output = tmp_path / "eval.json"
    code = run_eval(
        "--model", checkpoints["path"], "--lengths", "32,128", "--max-tokens", 160, "--copy-trials", 3,
        "--copy-span", 16, "--seed", 5, "--output", output,
    )  # fmt: skip
    assert code == 0
    report = json.loads(output.read_text())
    assert report["copy_trials"] == 3 and report["copy_span"] == 16
    lengths = report["models"]["path"]["lengths"]
    short = lengths["32"]  # the span twice and BOS are 33 tokens
    assert short["copy"] is None and short["copy_nll"] is None
    assert "too short for a copy window with a 16-token span" in short["copy_error"]
    model = AutoModelForCausalLM.from_pretrained(checkpoints["path"]).eval()
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]
    windows = copy_windows(eval_stream(tokenizer, 160), 128, 3, span=16, seed=5, prefix=prefix)
    reference = reference_scores(model, windows)
    assert lengths["128"]["copy"] == sum(reference.correct) / (3 * 15)
    assert lengths["128"]["copy_nll"] == pytest.approx(sum(reference.nll_sum) / (3 * 15), rel=1e-5)
    out = capsys.readouterr()
    assert "copy accuracy (16-token span)" in out.out and f"copy {lengths['128']['copy']:.1%}" in out.out
    assert "  copy " in out.err  # the line of each length
    # without --copy-trials: no copy test, no copy keys
    code = run_eval(
        "--model", checkpoints["llama"], "--lengths", "32", "--max-tokens", 64, "--output", output, "--force"
    )
    assert code == 0
    report = json.loads(output.read_text())
    assert report["copy_trials"] == 0 and not any("copy" in key for key in report["models"]["llama"]["lengths"]["32"])
    assert "copy" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--copy-trials", "-1"], "--copy-trials must be at least 0 (0 skips the copy test), got -1"),
        (["--copy-span", "1"], "--copy-span must be at least 2 (tokens of the copied span, whose first is not scored)"
         ", got 1"),
        (["--copy-trials", "2", "--copy-span", "32"], "--copy-span 32 does not fit the longest length 64: a copy "
         "window holds the span twice and a BOS token (65 tokens): give a --copy-span of at most 31, or longer "
         "--lengths"),
    ],
)  # fmt: skip
def test_bad_copy_flags_are_refused(args, message, checkpoints, tmp_path, capsys):
    output = tmp_path / "eval.json"
    code = run_eval("--model", checkpoints["llama"], "--lengths", "32,64", "--output", output, *args)
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not output.exists()
    with pytest.raises(SystemExit):  # not a number: argparse's exit code 2 and the message
        run_eval("--model", checkpoints["llama"], "--lengths", "32", "--copy-span", "x")
    assert "--copy-span" in capsys.readouterr().err
