"""lm-eval-harness on the local-file tasks of examples/lm_eval, for a tiny RoPE Llama and its PaTH conversion (loaded
through the checkpoint's own code, `trust_remote_code=True`), against log-probabilities computed here with plain
forward passes; the task builder's output and its refusals."""

import importlib.util
import json
import lzma
import math
import re
import subprocess
import sys

import lm_eval
import pytest
import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from path_hf.cli import main as path_hf_cli
from tests.evaluation.eval_models import ROOT
from tests.tiny import WIDE, tiny_config

TASKS_DIR = ROOT / "examples" / "lm_eval"
# By path, not through sys.path: the folder also holds a `utils.py` (lm-eval's name for task helpers).
_spec = importlib.util.spec_from_file_location("lm_eval_build_tasks", TASKS_DIR / "build_tasks.py")
build_tasks = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(build_tasks)

MAX_LENGTH = 160  # the tiny models' max_position_embeddings: a perplexity passage takes several windows
LIMIT = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer) -> dict:
    """{"llama": dir, "path": dir}: a tiny random RoPE Llama and its `path-hf convert` conversion (RoPE dropped,
    forget gate, random PaTH parameters), both with the default model's tokenizer."""
    root = tmp_path_factory.mktemp("lm-eval")
    torch.manual_seed(0)
    config = tiny_config("llama", tokenizer, **WIDE, max_position_embeddings=MAX_LENGTH, initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    assert path_hf_cli(["convert", "--from", str(root / "llama"), "--to", str(root / "path"), "--forget-gate"]) == 0
    return {"llama": root / "llama", "path": root / "path"}


def evaluate(model_dir, tasks: list[str], limit: int = LIMIT, batch_size: int = 4) -> dict:
    """`lm_eval.simple_evaluate` as a user calls it, with only this folder's tasks indexed (indexing lm-eval's own
    thousands of tasks takes about a minute)."""
    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},trust_remote_code=True",
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        limit=limit,
        batch_size=batch_size,
        device="cpu",  # the Python API's default is "cuda", even where torch has no CUDA
        log_samples=True,
        bootstrap_iters=0,
    )


def token_logprobs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(ids[t] | ids[:t]) for t >= 1 in float64, and whether ids[t] is the argmax, from one forward pass."""
    input_ids = torch.tensor(ids)[None]
    with torch.no_grad():
        logprobs = F.log_softmax(model(input_ids=input_ids).logits[0, :-1].double(), -1)
    targets = input_ids[0, 1:, None]
    return logprobs.gather(1, targets)[:, 0], (logprobs.argmax(-1) == targets[:, 0])


def rolling_loglikelihood(model, tokenizer, text: str, max_length: int) -> float:
    """The log-likelihood of every token of `text` (as the tokenizer encodes it, after a BOS prefix), `max_length`
    tokens at a time, each group read with the `max_length` tokens before its end (the last group has more context)."""
    stream = [tokenizer.bos_token_id] + tokenizer(text).input_ids
    total = 0.0
    for begin in range(1, len(stream), max_length):  # predict stream[begin:end]
        end = min(begin + max_length, len(stream))
        logprobs = token_logprobs(model, stream[max(0, end - 1 - max_length) : end])[0]
        total += logprobs[-(end - begin) :].sum().item()
    return total


def continuation_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) and whether greedy decoding writes it, the continuation's tokens being what
    encoding `context + continuation` adds to encoding `context`."""
    context_ids, whole = tokenizer(context).input_ids, tokenizer(context + continuation).input_ids
    assert len(whole) <= MAX_LENGTH + 1, "keep the items within the model's length: lm-eval would cut them"
    logprobs, greedy = token_logprobs(model, whole)
    n = len(whole) - len(context_ids)
    return logprobs[-n:].sum().item(), bool(greedy[-n:].all())


def check_against_direct(results: dict, model, tokenizer) -> None:
    """Every sample's log-likelihoods and every aggregated metric of the three pydocs tasks, recomputed here."""
    samples, metrics = results["samples"], results["results"]

    perplexity = samples["pydocs_perplexity"]
    lls = [rolling_loglikelihood(model, tokenizer, s["doc"]["text"], MAX_LENGTH) for s in perplexity]
    for sample, ll in zip(perplexity, lls, strict=True):
        assert sample["filtered_resps"][0] == pytest.approx(ll, rel=1e-5, abs=1e-4)
    words = sum(len(s["doc"]["text"].split()) for s in perplexity)
    size = sum(len(s["doc"]["text"].encode()) for s in perplexity)
    assert metrics["pydocs_perplexity"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / words), rel=1e-4)
    assert metrics["pydocs_perplexity"]["byte_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / size), rel=1e-4)
    bits = -sum(lls) / size / math.log(2)
    assert metrics["pydocs_perplexity"]["bits_per_byte,none"] == pytest.approx(bits, rel=1e-4)

    lastword = samples["pydocs_lastword"]
    direct = [
        continuation_loglikelihood(model, tokenizer, s["doc"]["context"], " " + s["doc"]["word"]) for s in lastword
    ]
    for sample, (ll, greedy) in zip(lastword, direct, strict=True):
        assert sample["filtered_resps"][0][0] == pytest.approx(ll, rel=1e-5, abs=1e-4)
        assert sample["filtered_resps"][0][1] == greedy
    mean_ll = sum(ll for ll, _ in direct) / len(direct)
    assert metrics["pydocs_lastword"]["perplexity,none"] == pytest.approx(math.exp(-mean_ll), rel=1e-4)
    assert metrics["pydocs_lastword"]["acc,none"] == sum(greedy for _, greedy in direct) / len(direct)

    nextsentence = samples["pydocs_nextsentence"]
    acc = acc_norm = 0
    for sample in nextsentence:
        doc = sample["doc"]
        lls = [continuation_loglikelihood(model, tokenizer, doc["context"], " " + c)[0] for c in doc["choices"]]
        assert [resp[0] for resp in sample["filtered_resps"]] == pytest.approx(lls, rel=1e-5, abs=1e-4)
        acc += max(range(4), key=lambda i: lls[i]) == doc["label"]
        acc_norm += max(range(4), key=lambda i: lls[i] / len(doc["choices"][i])) == doc["label"]
    assert metrics["pydocs_nextsentence"]["acc,none"] == acc / len(nextsentence)
    assert metrics["pydocs_nextsentence"]["acc_norm,none"] == acc_norm / len(nextsentence)


@pytest.mark.parametrize("kind", ["llama", "path"])
def test_lm_eval_matches_direct_computation(kind, models, tokenizer, monkeypatch):
    """simple_evaluate(model="hf", trust_remote_code=True) on all three tasks (the tag `pydocs`) against direct
    forward passes of one unpadded sequence each: lm-eval's batches of 4 are right-padded and carry no attention mask,
    which PaTH's causal transforms, convolution and forget gate never read back. The model's length comes from its
    config."""
    loaded = []
    monkeypatch.setattr(HFLM, "_create_model", _recording(HFLM._create_model, loaded))
    results = evaluate(models[kind], ["pydocs"])
    lm = loaded[0]
    assert lm.max_length == MAX_LENGTH
    # path_hf is imported here, so its registered class serves even with trust_remote_code=True.
    model_class = {"llama": "transformers.models.llama.modeling_llama.LlamaForCausalLM"}
    model_class["path"] = "path_hf.modeling_path_llama.PaTHLlamaForCausalLM"
    assert f"{type(lm.model).__module__}.{type(lm.model).__name__}" == model_class[kind]
    assert {task: len(samples) for task, samples in results["samples"].items()} == {
        "pydocs_perplexity": LIMIT,
        "pydocs_lastword": LIMIT,
        "pydocs_nextsentence": LIMIT,
    }
    check_against_direct(results, AutoModelForCausalLM.from_pretrained(models[kind]).eval(), tokenizer)


def _recording(create_model, loaded: list):
    def create_and_record(self, *args, **kwargs):
        create_model(self, *args, **kwargs)
        loaded.append(self)

    return create_and_record


CLI_WITHOUT_PATH_HF = """
import sys
sys.modules["path_hf"] = None  # the checkpoint's own code (auto_map) must serve: path_hf cannot be imported
import lm_eval.tasks
from lm_eval.__main__ import cli_evaluate

# Only the --include_path tasks are indexed, not lm-eval's own thousands (about a minute).
index_all = lm_eval.tasks.TaskManager.__init__
lm_eval.tasks.TaskManager.__init__ = lambda self, *a, **k: index_all(self, *a, **{**k, "include_defaults": False})
sys.argv = ["lm_eval", *sys.argv[1:]]
cli_evaluate()
print("model code:", *sorted(name for name in sys.modules if name.endswith(".modeling_path_llama")))
"""


def parsed(value):
    """A response as lm-eval writes it to its samples file, strings for numbers and booleans, read back."""
    if isinstance(value, list):
        return [parsed(item) for item in value]
    return {"True": True, "False": False}[value] if value in ("True", "False") else float(value)


@pytest.mark.slow
def test_command_line_on_the_converted_model_without_path_hf(models, tokenizer, tmp_path):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path examples/lm_eval` in a
    fresh process where path_hf cannot be imported: the model comes from the checkpoint's own code, and the numbers
    agree with the direct computation."""
    output = tmp_path / "results"
    args = [
        "--model", "hf", "--model_args", f"pretrained={models['path']},trust_remote_code=True",
        "--include_path", str(TASKS_DIR), "--tasks", "pydocs", "--limit", str(LIMIT), "--batch_size", "4",
        "--output_path", str(output), "--log_samples",
    ]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", CLI_WITHOUT_PATH_HF, *args],
        capture_output=True,
        text=True,
        env={**env, "HOME": str(tmp_path)},
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (code_line,) = [line for line in run.stdout.splitlines() if line.startswith("model code:")]
    (module,) = code_line.split()[2:]
    assert module.startswith("transformers_modules."), module  # copied next to the weights by save_pretrained
    (results_file,) = output.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    results["samples"] = {task: [] for task in results["results"]}
    for task, samples in results["samples"].items():
        for line in next(output.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines():
            sample = json.loads(line)
            samples.append({**sample, "filtered_resps": parsed(sample["filtered_resps"])})
    assert results["config"]["model_args"]["trust_remote_code"] is True
    check_against_direct(results, AutoModelForCausalLM.from_pretrained(models["path"]).eval(), tokenizer)


def test_shipped_tasks_are_what_the_builder_writes(tmp_path):
    """The task configs and data in examples/lm_eval are exactly what build_tasks.py writes from the texts it names."""
    for name, source in build_tasks.TEXTS.items():
        build_tasks.build(ROOT / source, name, tmp_path)
    built = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*") if path.is_file())
    shipped = sorted(path.relative_to(TASKS_DIR) for path in [*TASKS_DIR.glob("*.yaml"), *TASKS_DIR.glob("data/*")])
    assert built == shipped
    for path in built:
        assert (tmp_path / path).read_bytes() == (TASKS_DIR / path).read_bytes(), (
            f"{path} differs from what `python examples/lm_eval/build_tasks.py` writes: rebuild"
        )


def normalized(text: str) -> str:
    return " ".join(text.split())


def test_builder_items_come_from_the_text(tmp_path):
    """Built from another text (the held-out docs as plain JSON lines, another seed): passages are verbatim; a last
    word ends a sentence of the text right after its context and occurs in it; the label points at the sentence that
    follows the context in the text (up to whitespace and list bullets), and the three other choices do not."""
    documents = [json.loads(line) for line in lzma.open(ROOT / build_tasks.TEXTS["pydocs"], "rt")]
    source = tmp_path / "other.jsonl"
    source.write_text("".join(json.dumps({"text": doc["text"], "id": i}) + "\n" for i, doc in enumerate(documents)))
    out = tmp_path / "tasks"
    assert build_tasks.main(["--source", str(source), "--name", "other", "--out", str(out), "--seed", "1"]) == 0
    texts = [doc["text"] for doc in documents]
    prose = "\n\n".join(normalized(re.sub(r"(?m)^\s*[*-] ", "", text)) for text in texts)  # list bullets dropped

    def read(task: str) -> list[dict]:
        return [json.loads(line) for line in (out / "data" / f"other_{task}.jsonl").read_text().splitlines()]

    passages = read("perplexity")
    assert len(passages) == build_tasks.Options.perplexity_passages
    assert all(any(p["text"] in text for text in texts) for p in passages)
    lastword = read("lastword")
    assert len(lastword) > 200
    for item in lastword:
        assert normalized(f"{item['context']} {item['word']}.") in prose
        assert item["word"].lower() in item["context"].lower()
    nextsentence = read("nextsentence")
    assert len(nextsentence) == build_tasks.Options.nextsentence_items
    for item in nextsentence:
        follows = [normalized(f"{item['context']} {choice}") in prose for choice in item["choices"]]
        assert follows == [i == item["label"] for i in range(4)]
    assert sorted({item["label"] for item in nextsentence}) == [0, 1, 2, 3]
    config = (out / "other_nextsentence.yaml").read_text()
    assert "task: other_nextsentence" in config and "data_file: data/other_nextsentence.jsonl" in config


def test_builder_refuses_a_file_without_text(tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"content": "no text field"}) + "\n")
    assert build_tasks.main(["--source", str(source), "--name", "bad", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "line 1" in err and "'text'" in err
    assert not (tmp_path / "out").exists()
