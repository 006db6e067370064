"""Needle retrieval (`path_hf.evaluation.needles`, `path-hf eval --passkey-trials / --multikey-trials`): the prompts as
built, the teacher-forced scores with shared prefixes against one whole forward pass, the greedy check, the Wilson
interval, the templates kept apart from the recipe's."""

import dataclasses
import json

import pytest
import torch
from scipy.stats import binomtest
from transformers import LlamaConfig, LlamaForCausalLM

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.cli import main
from path_hf.evaluation import (
    NeedleTemplates,
    TrialResult,
    multikey_trials,
    passkey_trials,
    read_texts,
    score_trials,
    summarize_trials,
    tokenize_stream,
    wilson_interval,
)
from path_hf.recipes.retrieval_blocks import training_templates
from tests.evaluation.eval_models import EVAL_DATA, shapes


@pytest.fixture(scope="module")
def stream(tokenizer) -> list[int]:
    return tokenize_stream(read_texts([str(EVAL_DATA)]), tokenizer, 20_000)


def tiny_models(tokenizer) -> dict:
    torch.manual_seed(0)
    fields = shapes(tokenizer) | {"num_hidden_layers": 3}
    return {
        "llama": LlamaForCausalLM(LlamaConfig(**fields)),
        "path": PaTHLlamaForCausalLM(PaTHLlamaConfig(**fields, path_backend="torch", path_forget_gate=True)),
        "hybrid": PaTHLlamaForCausalLM(
            PaTHLlamaConfig(
                **fields, path_backend="torch", path_layers=[1], local_window=24, local_sinks=2, rope_mode="keep"
            )
        ),
    }


def test_passkey_prompts(tokenizer, stream):
    trials = passkey_trials(tokenizer, stream, 400, trials=10, depths=(0.1, 0.5, 0.9), haystacks=2)
    assert len(trials) == 10
    for index, trial in enumerate(trials):
        assert len(trial.context) + len(trial.answer) == 400
        assert tokenizer.decode(list(trial.answer)).strip() == trial.key and len(trial.key) == 5
        text = tokenizer.decode(list(trial.context))
        template = NeedleTemplates.default().passkey[trial.template]
        assert template.needle.format(key=trial.key) in text
        assert text.endswith(template.question.rstrip())
        assert trial.depth == (0.1, 0.5, 0.9)[index % 3]
        needle_at = len(trial.context) - trial.distance
        assert abs(needle_at / 400 - trial.depth) < 0.15  # at the nearest sentence end of the haystack
    # trials of one haystack and depth share the text before their needle, and other keys
    groups: dict[int, list] = {}
    for trial in trials:
        groups.setdefault(trial.group, []).append(trial)
    shared = [group for group in groups.values() if len(group) > 1]
    assert shared
    for group in shared:
        assert len({trial.context[: trial.shared] for trial in group}) == 1
        assert len({trial.key for trial in group}) == len(group)
    # deeper needles are nearer the question
    by_depth = sorted(trials[:3], key=lambda trial: trial.depth)
    assert by_depth[0].distance > by_depth[1].distance > by_depth[2].distance
    # the first trials the same whatever their number
    assert passkey_trials(tokenizer, stream, 400, trials=4, depths=(0.1, 0.5, 0.9), haystacks=2)[:3] == trials[:3]


def test_multikey_prompts(tokenizer, stream):
    trials = multikey_trials(tokenizer, stream, 500, trials=6, keys=4, questions=2)
    assert len(trials) == 6
    for haystack in range(3):
        asked = [trial for trial in trials if trial.group == haystack]
        assert len(asked) == 2 and asked[0].name != asked[1].name and asked[0].key != asked[1].key
    for trial in trials:
        assert len(trial.context) + len(trial.answer) == 500
        template = NeedleTemplates.default().multikey[trial.template]
        text = tokenizer.decode(list(trial.context))
        # four needles with four names, the asked one among them, and the question about it at the end
        needles = [name for name in NeedleTemplates.default().names if template.needle.format(name=name, key="")[:-1]
                   in text]  # fmt: skip
        assert len(needles) == 4 and trial.name in needles
        assert template.needle.format(name=trial.name, key=trial.key) in text
        assert text.endswith(template.question.format(name=trial.name).rstrip())


@torch.no_grad()
def whole_pass(model, trial) -> tuple[int, float]:
    """The reference: one forward pass over context and answer, the full logits at the answer's positions."""
    ids = torch.tensor([list(trial.context) + list(trial.answer)])
    logits = model(ids).logits[0, len(trial.context) - 1 : -1].float()
    targets = torch.tensor(trial.answer)
    return int((logits.argmax(-1) == targets).sum()), float(
        torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    )


@pytest.mark.parametrize("kind", ["llama", "path", "hybrid"])
def test_scores_equal_one_whole_pass(kind, tokenizer, stream, monkeypatch):
    """Shared prefixes copied from a cache, long continuations in pieces, short ones and the answers a step at a time:
    the same hits and likelihood as the whole prompt in one pass."""
    import path_hf.evaluation.needles as needles

    monkeypatch.setattr(needles, "PIECE", 48)  # several pieces in a continuation of a model without PaTH layers
    monkeypatch.setattr(needles, "STEP_BELOW", 8)
    model = tiny_models(tokenizer)[kind].eval()
    trials = passkey_trials(tokenizer, stream, 160, trials=6, depths=(0.2, 0.8), haystacks=1)
    trials += multikey_trials(tokenizer, stream, 200, trials=4, keys=3, questions=2)
    results = score_trials(model, trials)
    for result in results:
        hits, nll = whole_pass(model, result.trial)
        assert result.hits == hits
        assert result.nll_sum == pytest.approx(nll, rel=1e-4, abs=1e-4)


def test_greedy_check_agrees_with_teacher_forcing(tokenizer, stream):
    """A trial whose answer is what the model writes greedily is found by both verdicts (teacher-forced, and
    `generate` from scratch); the same prompt with another answer by neither."""
    model = tiny_models(tokenizer)["hybrid"].eval()
    trial = passkey_trials(tokenizer, stream, 160, trials=1, depths=(0.5,), haystacks=1)[0]
    prompt = torch.tensor([trial.context])
    written = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    written = tuple(written[0, prompt.shape[1] :].tolist())
    other = tuple((token + 1) % len(tokenizer) for token in written)
    trials = [dataclasses.replace(trial, answer=written), dataclasses.replace(trial, answer=other)]
    results = score_trials(model, trials, greedy_check=2)
    assert [result.found for result in results] == [True, False]
    assert [result.greedy_found for result in results] == [True, False]
    summary = summarize_trials(results)
    assert (summary["found"], summary["greedy_checked"], summary["greedy_agrees"]) == (1, 2, 2)


def test_summary_counts_and_interval():
    results = []
    for depth, found in [(0.1, True), (0.1, False), (0.5, True), (0.9, True)]:
        fake = type("T", (), {"kind": "passkey", "depth": depth, "answer": (1,)})()
        results.append(TrialResult(fake, 1 if found else 0, 1, 0.5))
    summary = summarize_trials(results)
    assert (summary["found"], summary["trials"]) == (3, 4)
    assert summary["by_depth"] == {"0.1": {"found": 1, "trials": 2}, "0.5": {"found": 1, "trials": 1},
                                   "0.9": {"found": 1, "trials": 1}}  # fmt: skip


@pytest.mark.parametrize("found,trials", [(0, 3), (2, 3), (36, 40), (20, 20), (7, 20)])
def test_wilson_interval_is_scipys(found, trials):
    low, high = binomtest(found, trials).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson_interval(found, trials) == pytest.approx((low, high), abs=1e-6)


def test_evaluation_and_training_templates_are_apart():
    evaluation, training = NeedleTemplates.default(), training_templates()

    def sentences(templates):
        return {template.needle for template in (*templates.passkey, *templates.multikey)} | {
            template.question for template in (*templates.passkey, *templates.multikey)
        }

    assert not sentences(evaluation) & sentences(training)
    assert not set(evaluation.names) & set(training.names)
    # nor a key phrase of one in the other
    for phrase in ("pass key", "secret number", "access code", "magic number", "locker"):
        assert not any(phrase in sentence.lower() for sentence in sentences(training))


@pytest.mark.parametrize(
    "data,problem",
    [
        ({"passkey": [{"needle": "no key here", "question": "?"}]}, "needle has no {key}"),
        ({"passkey": [{"needle": "{key}", "question": "is {key}"}]}, "gives the key away"),
        (
            {"passkey": [{"needle": "{key}", "question": "?"}], "multikey": [{"needle": "{key}", "question": "?"}]},
            "needle has no {name}",
        ),  # fmt: skip
        (
            {
                "passkey": [{"needle": "{key}", "question": "?"}],
                "multikey": [{"needle": "{name} {key}", "question": "?"}],
            },
            "must ask for a {name}",
        ),
        (
            {
                "passkey": [{"needle": "{key}", "question": "?"}],
                "multikey": [{"needle": "{name} {key}", "question": "{name}?"}],
                "names": ["one"],
            },
            "at least two distinct names",
        ),
    ],
)
def test_bad_templates_are_refused(tmp_path, data, problem, tokenizer, checkpoints, capsys):
    path = tmp_path / "templates.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=problem):
        NeedleTemplates.from_file(path)
    code = main(["eval", "--model", str(checkpoints["llama"]), "--data", str(EVAL_DATA), "--lengths", "64",
                 "--max-tokens", "128", "--needle-templates", str(path)])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "--needle-templates" in err and problem in err and len(err.strip().splitlines()) == 1


def test_eval_reports_found_trials_and_interval(tmp_path, checkpoints):
    output = tmp_path / "eval.json"
    code = main(["eval", "--model", str(checkpoints["path"]), "--data", str(EVAL_DATA), "--lengths", "96,128",
                 "--max-tokens", "256", "--passkey-trials", "5", "--multikey-trials", "4", "--multikey-keys", "3",
                 "--no-perplexity", "--greedy-check", "1", "--no-progress", "--output", str(output)])  # fmt: skip
    assert code == 0
    report = json.loads(output.read_text())
    entry = report["models"]["path"]["lengths"]["128"]
    assert "ppl" not in entry
    assert entry["passkey"]["trials"] == 5 and len(entry["passkey_trials"]) == 5
    assert set(entry["passkey"]["by_depth"]) == {"0.1", "0.3", "0.5", "0.7", "0.9"}
    assert entry["passkey"]["wilson95"] == pytest.approx(wilson_interval(entry["passkey"]["found"], 5))
    assert entry["multikey"]["trials"] == 4 and {record["kind"] for record in entry["multikey_trials"]} == {"multikey"}
    assert entry["passkey"]["greedy_checked"] == 1 and entry["multikey"]["greedy_checked"] == 1


def test_local_window_at_eval_time(tmp_path, checkpoints, tokenizer, capsys):
    """`--local-window` changes what a hybrid's local layers see, and is refused for a model without them."""
    code = main(["eval", "--model", str(checkpoints["llama"]), "--data", str(EVAL_DATA), "--lengths", "64",
                 "--max-tokens", "128", "--passkey-trials", "0", "--local-window", "16"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "has no local layers" in err
    torch.manual_seed(0)
    hybrid = tiny_models(tokenizer)["hybrid"]
    hybrid.save_pretrained(tmp_path / "hybrid")
    tokenizer.save_pretrained(tmp_path / "hybrid")
    ppl = {}
    for window in ("8", "64"):
        output = tmp_path / f"eval-{window}.json"
        code = main(["eval", "--model", str(tmp_path / "hybrid"), "--data", str(EVAL_DATA), "--lengths", "64",
                     "--max-tokens", "128", "--passkey-trials", "0", "--local-window", window, "--no-progress",
                     "--output", str(output)])  # fmt: skip
        assert code == 0
        report = json.loads(output.read_text())
        assert report["models"]["hybrid"]["local_window"] == int(window)
        ppl[window] = report["models"]["hybrid"]["lengths"]["64"]["ppl"]
    assert ppl["8"] != ppl["64"]
