"""The recipe's retrieval blocks (a distill stage's `retrieval` share) and training window (`local_window`): blocks
built from the training text as described, drawn the same on a resumed run, the answers under cross entropy beside the
KL, the window in force during a step only, and the refusals."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.evaluation import IGNORE_INDEX, read_texts, tokenize_stream
from path_hf.recipes import train as train_module
from path_hf.recipes.losses import distillation_loss
from path_hf.recipes.retrieval_blocks import RetrievalBlocks, training_templates
from tests.recipes.recipe_runs import ROOT, recipe_config, run_recipe
from tests.tiny import tiny_fields

TOKENIZER = ROOT / "examples" / "default_model" / "checkpoint"
TEXT = ROOT / "examples" / "default_model" / "data" / "eval.jsonl.xz"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def batch(tokenizer) -> dict[str, torch.Tensor]:
    stream = tokenize_stream(read_texts([str(TEXT)]), tokenizer, 4 * 512)
    ids = torch.tensor(stream).view(4, 512)
    positions = torch.arange(512).repeat(4, 1)
    positions[1, 100:] = torch.arange(412)  # a second document starts inside the block
    return {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}


def test_blocks_hold_needles_and_answers(tokenizer, batch):
    blocks = RetrievalBlocks(tokenizer, share=1.0, seed=3)
    made = blocks(batch, step=7)
    templates = training_templates()
    assert made["input_ids"].shape == batch["input_ids"].shape
    for row in range(4):
        ids, answers = made["input_ids"][row], made["answer_labels"][row]
        assert torch.equal(made["position_ids"][row], torch.arange(512))  # one sequence
        assert made["labels"][row, 0] == IGNORE_INDEX and torch.equal(made["labels"][row, 1:], ids[1:])
        at = (answers != IGNORE_INDEX).nonzero().flatten()
        assert len(at) and torch.equal(answers[at], ids[at])
        text = tokenizer.decode(ids)
        # every answer is a key that a needle stated earlier, and its question comes right before it
        for start, stop in _runs(at.tolist()):
            key = tokenizer.decode(ids[start:stop]).strip()
            assert key.isdigit() and 4 <= len(key) <= 7
            needle_at = text.find(key)
            assert 0 <= needle_at < len(tokenizer.decode(ids[:start]))
            before = tokenizer.decode(ids[:start])
            assert any(before.rstrip().endswith(t.question.format(name=n).rstrip()) for t in
                       (*templates.passkey, *templates.multikey) for n in templates.names)  # fmt: skip
    # the same step and seed draw the same blocks (a resumed run); another step others
    assert torch.equal(blocks(batch, step=7)["input_ids"], made["input_ids"])
    assert not torch.equal(blocks(batch, step=8)["input_ids"], made["input_ids"])


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    runs = []
    for position in positions:
        if runs and position == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([position, position + 1])
    return [tuple(run) for run in runs]


def test_share_of_blocks(tokenizer, batch):
    assert RetrievalBlocks(tokenizer, share=0.0)(batch, step=0) is batch
    counts = []
    for step in range(40):
        made = RetrievalBlocks(tokenizer, share=0.5, seed=1)(batch, step)
        answers = made.get("answer_labels")
        counts.append(0 if answers is None else int((answers != IGNORE_INDEX).any(-1).sum()))
        if answers is not None:  # the rows left as they were are the batch's own
            kept = ~(answers != IGNORE_INDEX).any(-1)
            assert torch.equal(made["input_ids"][kept], batch["input_ids"][kept])
    assert 0.35 < sum(counts) / (40 * 4) < 0.65


def test_answers_add_their_cross_entropy(tokenizer, batch):
    torch.manual_seed(0)
    fields = tiny_fields(tokenizer, num_hidden_layers=2)
    student = PaTHLlamaForCausalLM(PaTHLlamaConfig(**fields, path_backend="torch")).eval()
    teacher = PaTHLlamaForCausalLM(PaTHLlamaConfig(**fields, path_layers=[])).eval()
    made = RetrievalBlocks(tokenizer, share=1.0, seed=0)({k: v[:2, :128] for k, v in batch.items()}, step=0)
    plain = {k: v for k, v in made.items() if k != "answer_labels"}
    kl = distillation_loss(student, teacher, plain, 1.0)
    with_answers = distillation_loss(student, teacher, made, 1.0, answer_weight=0.5)
    logits = student(made["input_ids"], position_ids=made["position_ids"]).logits[:, :-1]
    targets = made["answer_labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    cross_entropy = F.cross_entropy(logits[mask], targets[mask])
    torch.testing.assert_close(with_answers, kl + 0.5 * cross_entropy, rtol=1e-5, atol=1e-5)


def test_training_window_holds_during_steps_only(tiny_source, tmp_path, monkeypatch):
    """The stage's windows are what the local layers see in its training steps (one drawn a step), the model's own in
    evaluation, and the saved model keeps its own; the stage's retrieval blocks reach the loss."""
    seen: list[tuple[int, bool]] = []
    loss = train_module.distillation_loss

    def recording(model, teacher, batch, *args, **kwargs):
        seen.append((model.config.local_window, "answer_labels" in batch))
        return loss(model, teacher, batch, *args, **kwargs)

    monkeypatch.setattr(train_module, "distillation_loss", recording)
    out = tmp_path / "run"
    model = {"convert": {"rope": "keep", "init": "identity", "layers": "1", "local_window": 24, "local_sinks": 2}}
    stages = [{"name": "distill", "tokens": 1024, "learning_rate": 1e-3, "retrieval": 1.0, "local_window": [4, 8]}]
    config = recipe_config(tiny_source, out, model=model, stages=stages, data={"block_size": 128},
                           training={"trainable": "attention", "batch_size": 1})  # fmt: skip
    assert run_recipe(config, tmp_path) == 0
    assert {window for window, _ in seen} == {4, 8} and all(retrieval for _, retrieval in seen)
    assert json.loads((out / "final" / "config.json").read_text())["local_window"] == 24


@pytest.mark.parametrize(
    "stage,convert,message",
    [
        (
            {"name": "lm", "retrieval": 0.5},
            {"layers": "1", "local_window": 8},
            "retrieval blocks are trained by a distill stage",
        ),  # fmt: skip
        ({"name": "distill", "retrieval": 1.5}, {"layers": "1", "local_window": 8}, "retrieval must be in \\[0, 1\\]"),
        (
            {"name": "distill", "local_window": [8, 0]},
            {"layers": "1", "local_window": 8},
            "local_window must be a positive number",
        ),  # fmt: skip
        ({"name": "distill", "local_window": 8}, {}, "the model has none"),
    ],
)
def test_refusals(stage, convert, message, tiny_source, tmp_path, capsys):
    stages = [{"tokens": 64, "learning_rate": 1e-3, **stage}]
    config = recipe_config(tiny_source, tmp_path / "run", model={"convert": {"rope": "keep", **convert}},
                           stages=stages, data={"block_size": 32})  # fmt: skip
    assert run_recipe(config, tmp_path) == 1
    err = capsys.readouterr().err
    assert "error:" in err and len(err.strip().splitlines()) == 1
    assert __import__("re").search(message, err), err


def test_kl_at_every_kth_position(tokenizer, batch):
    """`kl_stride` k: the KL of positions k-1, 2k-1, ... only (the mean over them), as the whole KL restricted to
    them computes it."""
    torch.manual_seed(0)
    fields = tiny_fields(tokenizer, num_hidden_layers=2)
    student = PaTHLlamaForCausalLM(PaTHLlamaConfig(**fields, path_backend="torch")).eval()
    teacher = PaTHLlamaForCausalLM(PaTHLlamaConfig(**fields, path_layers=[])).eval()
    plain = {k: v[:2, :64] for k, v in batch.items()}
    strided = distillation_loss(student, teacher, plain, 1.0, kl_stride=4)
    with torch.no_grad():
        rows = [m(plain["input_ids"], position_ids=plain["position_ids"]).logits[:, :-1] for m in (student, teacher)]
    kept = plain["labels"][:, 1:] != IGNORE_INDEX
    kept &= torch.arange(63) % 4 == 3
    kl = F.kl_div(F.log_softmax(rows[0][kept], -1), F.log_softmax(rows[1][kept], -1), log_target=True, reduction="sum")
    torch.testing.assert_close(strided.detach(), kl / kept.sum(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(strided, distillation_loss(student, teacher, plain, 1.0))
