"""recipes/train.py on the tiny model, on CPU: every stage and trainable set, LoRA merging, exact resume, recovery
outputs, and every refused configuration."""

import json
import lzma
import shutil

import pytest
import torch
from datasets import load_dataset
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import path_hf  # noqa: F401  (registers path_llama)
from path_hf.errors import RecipeError
from path_hf.evaluation import load_texts
from path_hf.recipes import train
from path_hf.recipes.data import pack_documents
from path_hf.recipes.losses import AttentionAlignment
from path_hf.recipes.models import select_trainable
from path_hf.recipes.schedule import batches_drawn, plan_stages, stage_at, stage_scheduler
from path_hf.recipes.settings import Stage, TrainingSettings, plan_stage_blocks
from tests.conversion.checkpoints import make_source
from tests.recipes.recipe_runs import DATA, ROOT, parse_config, read_log, recipe_config, run_recipe


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def changed(before: dict, after: dict) -> set[str]:
    """The parameter kinds (names without the layer index) that training moved."""
    return {
        name.split(".")[-2] if name.endswith(("weight", "bias")) else name
        for name in before
        if not torch.equal(before[name], after[name])
    }


def test_all_stages_train_only_the_path_parameters_and_track_recovery(tiny_source, tmp_path):
    out = tmp_path / "run"
    stages = [
        {"name": "align", "tokens": 128, "learning_rate": 1e-2},
        {"name": "distill", "tokens": 128, "learning_rate": 1e-2},
        {"name": "lm", "tokens": 128, "learning_rate": 1e-2},
    ]
    config = recipe_config(tiny_source, out, stages=stages, training={"eval_every": 2, "trainable": "path"})
    assert run_recipe(config, tmp_path) == 0

    log = read_log(out)
    losses = {key: entry[key] for entry in log for key in entry if key.startswith("train/")}
    assert {"train/align_loss", "train/distill_loss", "train/lm_loss"} <= set(losses)
    steps = [entry["step"] for entry in log if "train/lr" in entry]
    assert steps == list(range(1, 7))  # 128 tokens / 64 per step = 2 steps per stage
    assert changed(weights(out / "converted"), weights(out / "final")) == {"w_proj", "w_conv1d", "bt_proj", "bt_gain"}
    # the final model's card: the conversion's, and what the recipe did
    card = (out / "final" / "README.md").read_text()
    assert card.startswith((out / "converted" / "README.md").read_text().rstrip()) and "## Trained" in card
    assert "| align | 128 | 0.01 |" in card and "parameters trained: `path`" in card

    recovery = json.loads((out / "recovery.json").read_text())
    assert set(recovery["source_ppl"]) == {"1x", "2x"}
    assert [entry["step"] for entry in recovery["history"]] == [0, 2, 4, 6]
    assert [entry["tokens"] for entry in recovery["history"]] == [0, 128, 256, 384]
    final = recovery["final"]
    assert final["ratio"]["2x"] == pytest.approx(final["ppl"]["2x"] / recovery["source_ppl"]["2x"])
    assert (out / "recovery.png").stat().st_size > 0
    assert any("eval/ratio_1x" in entry for entry in log)
    # The final model is a plain PaTHLlama checkpoint.
    assert type(AutoModelForCausalLM.from_pretrained(out / "final")).__name__ == "PaTHLlamaForCausalLM"


@pytest.mark.parametrize(
    "trainable, stage, moved",
    [
        ("gate", "lm", {"bt_proj", "bt_gain", "g_proj", "g_gain"}),
        ("attention", "distill", {"w_proj", "w_conv1d", "bt_proj", "bt_gain", "q_proj", "k_proj", "v_proj", "o_proj"}),
        (
            "full",
            "lm",
            {
                "w_proj",
                "w_conv1d",
                "bt_proj",
                "bt_gain",
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "input_layernorm",
                "post_attention_layernorm",
                "embed_tokens",
                "norm",
                "lm_head",
            },
        ),
    ],
)
def test_trainable_sets(tiny_source, tmp_path, trainable, stage, moved):
    out = tmp_path / "run"
    stages = [{"name": stage, "tokens": 64, "learning_rate": 1e-2}]
    training = {"trainable": trainable, "gradient_accumulation_steps": 2, "batch_size": 2}
    model = {"convert": {"rope": "drop", "forget_gate": True}} if trainable == "gate" else {}
    config = recipe_config(tiny_source, out, stages=stages, training=training, model=model)
    assert run_recipe(config, tmp_path) == 0
    assert changed(weights(out / "converted"), weights(out / "final")) == moved


def test_lora_is_merged_into_a_plain_checkpoint_equal_to_the_peft_model(tiny_source, tmp_path):
    out = tmp_path / "run"
    stages = [
        {"name": "align", "tokens": 64, "learning_rate": 1e-2},
        {"name": "lm", "tokens": 64, "learning_rate": 1e-2},
    ]
    config = recipe_config(tiny_source, out, stages=stages, training={"trainable": "lora", "lora_r": 4})
    assert run_recipe(config, tmp_path) == 0

    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(out / "converted")
    peft_model = PeftModel.from_pretrained(base, out / "adapter").eval()
    input_ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = peft_model(input_ids=input_ids).logits
        actual = merged(input_ids=input_ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    moved = changed(weights(out / "converted"), weights(out / "final"))
    assert {"q_proj", "w_proj", "bt_proj"} <= moved and "gate_proj" not in moved


def test_resume_continues_exactly(tiny_source, tmp_path):
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    stages = [
        {"name": "distill", "tokens": 128, "learning_rate": 1e-2},
        {"name": "lm", "tokens": 128, "learning_rate": 1e-2},
    ]
    training = {"save_every": 2, "keep_checkpoints": 3, "trainable": "attention"}
    config = recipe_config(tiny_source, uninterrupted, stages=stages, training=training)
    assert run_recipe(config, tmp_path) == 0

    # As if the run had been stopped after step 2: only that checkpoint and the log up to it.
    resumed.mkdir()
    shutil.copytree(uninterrupted / "converted", resumed / "converted")
    shutil.copytree(uninterrupted / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    config = recipe_config(tiny_source, resumed, stages=stages, training={**training, "resume": True})
    assert run_recipe(config, tmp_path) == 0

    def losses(out):
        return {
            e["step"]: e.get("train/distill_loss", e.get("train/lm_loss")) for e in read_log(out) if "train/lr" in e
        }

    first, second = losses(uninterrupted), losses(resumed)
    assert sorted(second) == [3, 4]
    assert second == {step: first[step] for step in (3, 4)}
    for name, tensor in weights(uninterrupted / "final").items():
        assert torch.equal(tensor, weights(resumed / "final")[name]), name


def test_target_ratio_stops_early(tiny_source, tmp_path):
    out = tmp_path / "run"
    config = recipe_config(tiny_source, out, training={"eval_every": 1, "target_ratio": 100.0})
    assert run_recipe(config, tmp_path) == 0
    recovery = json.loads((out / "recovery.json").read_text())
    assert recovery["stopped_at_target"] and recovery["final"]["step"] == 1


def test_non_finite_loss_stops_with_the_step_and_the_state_before_it(tiny_source, tmp_path, capsys):
    out = tmp_path / "run"
    # A learning rate of 1e30 makes the weights huge after the first step, the second loss is not finite.
    config = recipe_config(tiny_source, out, stages=[{"name": "lm", "tokens": 640, "learning_rate": 1e30}])
    assert run_recipe(config, tmp_path, "training.trainable=full", "stages.0.warmup_ratio=0") == 1
    error = capsys.readouterr().err
    checkpoint = out / "checkpoints" / "step-00000001"
    assert f"non-finite lm loss at step 2; the state before that step is saved in {checkpoint}" in error
    assert "may already be diverging" in error and "last good" not in error  # said as what is known, no more
    saved = load_file(checkpoint / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in saved.values())


def test_packed_blocks_restart_positions_at_each_document():
    class Tokenizer:
        eos_token_id = 0

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[int(word) for word in text.split()] for text in texts]}

    blocks = pack_documents(["5 6 7", "8 9", "1 2 3 4 5 6"], Tokenizer(), block_size=4)
    assert blocks["input_ids"] == [[5, 6, 7, 0], [8, 9, 0, 1], [2, 3, 4, 5]]
    assert blocks["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]
    assert blocks["labels"] == [[-100, 6, 7, 0], [-100, 9, 0, -100], [-100, 3, 4, 5]]


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "whole-student"])
@pytest.mark.parametrize("rope, exact", [("keep", True), ("drop", False)])
def test_alignment_loss_is_zero_for_an_exact_conversion(tmp_path, rope, exact, isolated):
    """With RoPE kept and identity transforms a PaTH layer computes the source layer: the stage-1 loss is 0, which
    it can only be if every PaTH attention ran on its own source layer's input and was compared to its output."""
    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions

    # Weights large enough that the attention outputs are of order 1.
    source = make_source(tmp_path / "source", "llama", initializer_range=0.3)
    convert(ConvertOptions(source=str(source), output=str(tmp_path / "path"), rope=rope, init="identity"))
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "path")
    teacher = AutoModelForCausalLM.from_pretrained(source).eval()
    alignment = AttentionAlignment(student, teacher, isolated=isolated)
    input_ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.tensor([list(range(10)) + list(range(6))] * 2)  # two documents per row
    with alignment.aligning():
        loss = alignment.loss(student, teacher, {"input_ids": input_ids, "position_ids": position_ids})
        if loss.requires_grad:
            loss.backward()
    assert (loss.item() < 1e-10) if exact else (loss.item() > 1e-3)
    assert student.model.layers[2].self_attn.bt_gain.weight.grad is not None


def test_a_bfloat16_teacher_leaves_the_student_its_own_rope_tables(tmp_path):
    """A bfloat16 teacher records cos/sin rounded to bfloat16; the student's attention gets its own tables, from its
    rotary embedding at its precision, computed once a step."""
    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions

    source = make_source(tmp_path / "source", "llama")
    convert(ConvertOptions(source=str(source), output=str(tmp_path / "path"), rope="interleave", init="identity"))
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "path")
    teacher = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    alignment = AttentionAlignment(student, teacher)
    input_ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(100, 116)[None]
    with alignment.aligning():
        teacher(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        recorded = alignment.inputs[0]["position_embeddings"]
        tables = [alignment.recorded_input(idx, torch.float32)["position_embeddings"] for idx in (0, 1)]
    assert recorded[0].dtype == torch.bfloat16
    expected = student.model.rotary_emb(torch.zeros(1), position_ids)
    for cos_sin in tables:
        for table, exact, rounded in zip(cos_sin, expected, recorded, strict=True):
            assert table.dtype == torch.float32 and torch.equal(table, exact)
            assert not torch.equal(table, rounded.float())
    assert tables[0][0] is tables[1][0]  # computed once for every layer
    assert not alignment.tables  # and dropped after the step


@pytest.mark.parametrize(
    "amx, avx512_bf16, expected",
    [(True, True, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32)],
    ids=["amx", "avx512-bf16", "avx2"],
)
def test_teacher_dtype_auto_takes_bfloat16_where_the_cpu_is_fast_at_it(monkeypatch, amx, avx512_bf16, expected):
    from path_hf.recipes.models import teacher_dtype

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert teacher_dtype("auto", torch.device("cpu")) is expected
    assert teacher_dtype("float16", torch.device("cpu")) is torch.float16


@pytest.mark.parametrize("whole_weights", [True, False], ids=["heads-per-chunk", "whole-logits"])
@pytest.mark.parametrize("chunk", [3, 1000], ids=["chunked", "one-chunk"])
def test_distillation_loss_is_the_kl_over_predicting_positions_by_brute_force(tmp_path, chunk, whole_weights):
    """The chunked, recomputed KL equals KL(teacher || student) written out from the two softmaxes, over the positions
    whose next token is in their own document, with its gradients, at a temperature other than 1: with the logits
    formed chunk by chunk from the final hidden states (one process, DDP) and from the models' whole logits (FSDP,
    DeepSpeed). The student's head is untied, so its own gradient is checked too."""
    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions
    from path_hf.recipes.losses import distillation_loss

    source = make_source(tmp_path / "source", "llama", initializer_range=0.3)
    convert(ConvertOptions(source=str(source), output=str(tmp_path / "path"), rope="drop", forget_gate=True))
    teacher = AutoModelForCausalLM.from_pretrained(source).eval()
    input_ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.tensor([list(range(10)) + list(range(6))] * 2)
    labels = input_ids.clone()
    labels[position_ids == 0] = -100  # a document's first token is predicted by none of its own
    batch = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
    temperature, grads = 2.0, []
    for brute_force in (False, True):
        student = AutoModelForCausalLM.from_pretrained(tmp_path / "path")
        if brute_force:
            # use_cache=False: transformers' Llama keeps packed documents apart only without a cache
            inputs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
            p_teacher = (teacher(**inputs).logits[:, :-1].detach().double() / temperature).softmax(-1)
            p_student = (student(**inputs).logits[:, :-1].double() / temperature).softmax(-1)
            kl = (p_teacher * (p_teacher.log() - p_student.log())).sum(-1)
            keep = labels[:, 1:] != -100
            loss = kl[keep].mean() * temperature**2
        else:
            loss = distillation_loss(student, teacher, batch, temperature, chunk=chunk, whole_weights=whole_weights)
        loss.backward()
        grads.append((loss.item(), {n: p.grad.double() for n, p in student.named_parameters()}))
    (loss, grad), (expected, expected_grad) = grads
    assert loss == pytest.approx(expected, rel=1e-5) and expected > 1e-3
    for name, value in expected_grad.items():
        scale = value.abs().max().item()  # float32 logits against float64 probabilities
        torch.testing.assert_close(grad[name], value, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_isolated_alignment_equals_the_whole_student_run(tmp_path):
    """Running each PaTH attention alone on the teacher's input, backpropagated layer by layer, gives the loss and
    the gradients of the whole student's forward with the inputs substituted, also when the whole student recomputes
    its layers in backward (activation checkpointing: the hooks must again feed the teacher's inputs)."""
    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions

    source = make_source(tmp_path / "source", "llama", initializer_range=0.3)
    convert(ConvertOptions(source=str(source), output=str(tmp_path / "path"), rope="drop", forget_gate=True))
    teacher = AutoModelForCausalLM.from_pretrained(source).eval()
    input_ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "position_ids": torch.tensor([list(range(10)) + list(range(6))] * 2)}
    results = []
    for isolated, checkpointing in ((True, False), (False, False), (False, True)):
        student = AutoModelForCausalLM.from_pretrained(tmp_path / "path")
        if checkpointing:
            student.activation_checkpointing_enable()
        select_trainable(student, TrainingSettings(output_dir=".", trainable="attention"))
        alignment = AttentionAlignment(student, teacher, isolated=isolated)
        with alignment.aligning():
            loss = alignment.loss(student, teacher, batch)
            if not isolated:
                loss.backward()
        grads = {name: param.grad for name, param in student.named_parameters() if param.requires_grad}
        results.append((loss.item(), grads))
    (isolated_loss, isolated_grads), *whole_runs = results
    for whole_loss, whole_grads in whole_runs:
        assert isolated_loss == pytest.approx(whole_loss, rel=1e-5) and whole_loss > 1e-3
        assert isolated_grads.keys() == whole_grads.keys()
        for name, grad in whole_grads.items():
            assert grad is not None and grad.abs().sum() > 0, name
            torch.testing.assert_close(isolated_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_streamed_data_trains_and_resumes_at_the_same_position(tiny_source, tmp_path):
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    data = {"streaming": True}
    training = {"save_every": 1, "keep_checkpoints": 3}
    config = recipe_config(tiny_source, uninterrupted, data=data, training=training)
    assert run_recipe(config, tmp_path) == 0
    resumed.mkdir()
    shutil.copytree(uninterrupted / "converted", resumed / "converted")
    shutil.copytree(uninterrupted / "checkpoints" / "step-00000001", resumed / "checkpoints" / "step-00000001")
    config = recipe_config(tiny_source, resumed, data=data, training={**training, "resume": True})
    assert run_recipe(config, tmp_path) == 0
    for name, tensor in weights(uninterrupted / "final").items():
        assert torch.equal(tensor, weights(resumed / "final")[name]), name


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_shipped_configs_parse_and_start_with_their_launch_line(path):
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# accelerate launch ") and f"--config recipes/configs/{path.name}" in first_line
    config = parse_config(["--config", str(path)])
    assert config.stages and config.training.output_dir


def test_a_converted_checkpoint_finds_its_teacher_in_the_conversion_record(tiny_source, tmp_path):
    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions

    convert(ConvertOptions(source=str(tiny_source), output=str(tmp_path / "path"), rope="keep", init="identity"))
    out = tmp_path / "run"
    config = recipe_config(tiny_source, out, model={"path": str(tmp_path / "path"), "convert": {}})
    assert run_recipe(config, tmp_path) == 0
    recovery = json.loads((out / "recovery.json").read_text())
    assert not (out / "converted").exists()
    # RoPE kept, transforms at identity: the converted model starts exactly at the source's perplexity.
    assert recovery["history"][0]["ratio"] == pytest.approx({"1x": 1.0, "2x": 1.0}, abs=1e-5)


def test_packed_blocks_keep_documents_apart_in_both_models(tiny_source, tmp_path):
    """The recipe's blocks give every document the logits it gets alone, in the RoPE teacher and the PaTH model."""
    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions

    convert(ConvertOptions(source=str(tiny_source), output=str(tmp_path / "path"), rope="drop"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_source)
    texts = ["The keeper climbed the tower .", "In spring the birds returned before the boats did ."]
    block = pack_documents(texts, tokenizer, block_size=12)
    input_ids, position_ids = torch.tensor(block["input_ids"][:1]), torch.tensor(block["position_ids"][:1])
    first = position_ids[0].tolist().index(0, 1)
    for model in (
        AutoModelForCausalLM.from_pretrained(tiny_source),
        AutoModelForCausalLM.from_pretrained(tmp_path / "path"),
    ):
        with torch.no_grad():
            packed = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
            alone = [model(input_ids=ids[None]).logits[0] for ids in (input_ids[0, :first], input_ids[0, first:])]
        torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_each_stage_has_its_own_warmup_and_cosine_schedule():
    stages = [
        Stage("align", tokens=10 * 64, learning_rate=1e-2, warmup_ratio=0.2, min_lr_ratio=0.1),
        Stage("lm", tokens=3 * 64 + 1, learning_rate=1e-4, warmup_ratio=0.0, min_lr_ratio=0.0),
    ]
    plans = plan_stages(plan_stage_blocks(stages, block_size=64), sequences_per_step=1)
    assert [(plan.first_step, plan.steps) for plan in plans] == [(0, 10), (10, 4)]
    # as train.py sets them: a scheduler from each stage's first step, stepped once an optimizer step
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    rates, scheduled = [], None
    for step in range(14):
        current = stage_at(plans, step)
        if current is not scheduled:
            scheduled, scheduler = current, stage_scheduler(optimizer, current, step)
        else:
            scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        # a run resumed at this step sets the same rate
        resumed = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        assert stage_scheduler(resumed, current, step).get_last_lr() == [rates[-1]]
    assert rates[0] < rates[1] < rates[2] == pytest.approx(1e-2)  # 2 warmup steps, then the peak
    assert rates[:2] == pytest.approx([1e-2 / 3, 2e-2 / 3])  # every warmup step trains (none at 0)
    assert all(a > b for a, b in zip(rates[2:10], rates[3:10], strict=False))
    assert rates[9] > 1e-3  # decays towards 0.1 x peak
    assert rates[10] == pytest.approx(1e-4) and rates[13] < 1e-4


def test_stages_with_their_own_block_length_are_planned_and_resume_their_data():
    stages = [
        Stage("align", tokens=128, learning_rate=1e-3),
        Stage("distill", tokens=256, learning_rate=1e-3, block_size=32),
        Stage("lm", tokens=64, learning_rate=1e-3),
    ]
    planned = plan_stage_blocks(stages, block_size=16)
    assert [p.block_size_setting for p in planned] == ["data.block_size", "stages.1.block_size", "data.block_size"]
    plans = plan_stages(planned, sequences_per_step=4)
    assert [(p.first_step, p.steps, p.block_size, p.tokens_per_step) for p in plans] == [
        (0, 2, 16, 64),
        (2, 2, 32, 128),
        (4, 1, 16, 64),
    ]
    # each block length's data continues where the steps before left it
    assert [batches_drawn(plans, step, 16, micro_batches=2) for step in range(6)] == [0, 2, 4, 4, 4, 6]
    assert [batches_drawn(plans, step, 32, micro_batches=2) for step in range(6)] == [0, 0, 0, 2, 4, 4]


def test_a_stage_trains_on_its_own_block_length_and_resumes_exactly(tiny_source, tmp_path, monkeypatch):
    """A stage's `block_size` gives its batches that length (its own packing of the data) and its token count; a run
    stopped inside it resumes with the same batches, to the same weights."""
    shapes = []
    micro_batch = train.train_micro_batch

    def recording(batch, stage, **kwargs):
        shapes.append((stage.name, tuple(batch["input_ids"].shape)))
        return micro_batch(batch, stage, **kwargs)

    monkeypatch.setattr(train, "train_micro_batch", recording)
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    stages = [
        {"name": "distill", "tokens": 128, "learning_rate": 1e-2},
        {"name": "lm", "tokens": 256, "learning_rate": 1e-2, "block_size": 32},
    ]
    training = {"save_every": 1, "keep_checkpoints": 5, "trainable": "attention"}
    assert run_recipe(recipe_config(tiny_source, uninterrupted, stages=stages, training=training), tmp_path) == 0
    assert shapes == [("distill", (4, 16))] * 2 + [("lm", (4, 32))] * 2
    assert [e["tokens"] for e in read_log(uninterrupted) if "train/lr" in e] == [64, 128, 256, 384]

    # As if stopped after step 3, the first of the 32-token stage
    resumed.mkdir()
    shutil.copytree(uninterrupted / "converted", resumed / "converted")
    shutil.copytree(uninterrupted / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    shapes.clear()
    config = recipe_config(tiny_source, resumed, stages=stages, training={**training, "resume": True})
    assert run_recipe(config, tmp_path) == 0
    assert shapes == [("lm", (4, 32))]
    for name, tensor in weights(uninterrupted / "final").items():
        assert torch.equal(tensor, weights(resumed / "final")[name]), name


def test_a_stage_sets_its_own_activation_checkpointing_and_a_resume_may_change_it(tiny_source, tmp_path, monkeypatch):
    """`stages.N.activation_checkpointing` overrides the run's setting for that stage's steps, the gradients are those
    of a run that never recomputes (the same weights at the end), and a resume may change it."""
    flags = []
    micro_batch = train.train_micro_batch

    def recording(batch, stage, **kwargs):
        layers = kwargs["model"].model.layers
        flags.append((stage.name, {layer.gradient_checkpointing for layer in layers}))
        return micro_batch(batch, stage, **kwargs)

    monkeypatch.setattr(train, "train_micro_batch", recording)
    stages = [
        {"name": "distill", "tokens": 128, "learning_rate": 1e-2, "activation_checkpointing": False},
        {"name": "lm", "tokens": 128, "learning_rate": 1e-2},
        {"name": "distill", "tokens": 128, "learning_rate": 1e-2, "activation_checkpointing": False},
    ]
    training = {"save_every": 1, "keep_checkpoints": 6, "trainable": "attention", "activation_checkpointing": True}
    mixed, never = tmp_path / "mixed", tmp_path / "never"
    assert run_recipe(recipe_config(tiny_source, mixed, stages=stages, training=training), tmp_path) == 0
    assert flags == [("distill", {False})] * 2 + [("lm", {True})] * 2 + [("distill", {False})] * 2

    flags.clear()
    never_training = {**training, "activation_checkpointing": False}
    assert run_recipe(recipe_config(tiny_source, never, stages=stages, training=never_training), tmp_path) == 0
    assert {flag for _, (flag,) in flags} == {False}
    moved = changed(weights(mixed / "converted"), weights(mixed / "final"))
    assert "q_proj" in moved
    for name, tensor in weights(never / "final").items():
        torch.testing.assert_close(weights(mixed / "final")[name], tensor, msg=name)

    # Resumed after step 3 (inside the recomputing stage) with that stage no longer recomputing
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(mixed / "converted", resumed / "converted")
    shutil.copytree(mixed / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    flags.clear()
    changed_stages = [stages[0], {**stages[1], "activation_checkpointing": False}, stages[2]]
    config = recipe_config(tiny_source, resumed, stages=changed_stages, training={**training, "resume": True})
    assert run_recipe(config, tmp_path) == 0
    assert flags == [("lm", {False})] + [("distill", {False})] * 2
    for name, tensor in weights(mixed / "final").items():
        torch.testing.assert_close(weights(resumed / "final")[name], tensor, msg=name)


@pytest.mark.parametrize("kind", ["txt", "parquet", "jsonl.xz", "dataset-directory"])
def test_data_formats(tiny_source, tmp_path, kind):
    texts = load_dataset("json", data_files=str(DATA), split="train")
    if kind == "txt":  # documents separated by blank lines
        data = {"train_files": [str(tmp_path / "docs.txt")]}
        (tmp_path / "docs.txt").write_text("\n\n".join(texts["text"]) + "\n")
    elif kind == "parquet":
        data = {"train_files": [str(tmp_path / "docs.parquet")]}
        texts.to_parquet(tmp_path / "docs.parquet")
    elif kind == "jsonl.xz":  # how the embedded default model's data ships
        data = {"train_files": [str(tmp_path / "docs.jsonl.xz")]}
        with lzma.open(tmp_path / "docs.jsonl.xz", "wt") as file:
            file.writelines(json.dumps({"text": text}) + "\n" for text in texts["text"])
    else:  # what `dataset` loads from the hub, here a local directory of data files
        data = {"train_files": [], "dataset": str(DATA.parent)}
    out = tmp_path / "run"
    assert run_recipe(recipe_config(tiny_source, out, data=data), tmp_path) == 0
    assert json.loads((out / "recovery.json").read_text())["final"]["tokens"] == 128


def test_files_whose_records_carry_different_fields_mix(tiny_source, tmp_path):
    """Only the text field is read from each file: JSONL files with other, different fields train together."""
    texts = load_dataset("json", data_files=str(DATA), split="train")["text"]
    files = []
    for i, extra in enumerate(("title", "path")):
        files.append(tmp_path / f"docs-{i}.jsonl")
        files[-1].write_text("".join(json.dumps({extra: str(n), "text": text}) + "\n" for n, text in enumerate(texts)))
    out = tmp_path / "run"
    data = {"train_files": [str(file) for file in files]}
    assert run_recipe(recipe_config(tiny_source, out, data=data), tmp_path) == 0
    read = load_texts(files, "text")
    assert read.column_names == ["text"] and list(read["text"]) == list(texts) * 2


def test_lora_all_linear_never_wraps_the_path_projections(tiny_source, tmp_path):
    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions

    options = ConvertOptions(source=str(tiny_source), output=str(tmp_path / "path"), forget_gate=True)
    convert(options)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "path")
    training = TrainingSettings(output_dir=str(tmp_path), trainable="lora", lora_target_modules="all-linear")
    peft_model = select_trainable(model, training)
    wrapped = {name.split(".")[-1] for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trained_fully = {
        n.split(".modules_to_save.")[0].split(".")[-1]
        for n, _ in peft_model.named_parameters()
        if ".modules_to_save." in n
    }
    assert trained_fully == {"w_proj", "w_conv1d", "bt_proj", "bt_gain", "g_proj", "g_gain"}
    with pytest.raises(RecipeError, match="lora_target_modules"):
        select_trainable(model, TrainingSettings(output_dir=".", trainable="lora", lora_target_modules=["bt_proj"]))


def test_isolated_alignment_runs_under_the_accelerators_mixed_precision(tmp_path):
    """The isolated attentions bypass the wrapped model's forward, which is where accelerate enters autocast: the
    align stage must enter it itself, or a bf16 run aligns in float32."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions

    source = make_source(tmp_path / "source", "llama")
    convert(ConvertOptions(source=str(source), output=str(tmp_path / "path"), rope="drop"))
    teacher = AutoModelForCausalLM.from_pretrained(source).eval()
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "path")
    alignment = AttentionAlignment(student, teacher)
    seen = []
    for attention in alignment.layers.values():
        attention.register_forward_hook(lambda module, args, output: seen.append(torch.is_autocast_enabled("cpu")))
    batch = {"input_ids": torch.randint(3, 200, (1, 16)), "position_ids": torch.arange(16)[None]}
    try:
        for precision in ("no", "bf16"):
            AcceleratorState._reset_state(reset_partial_state=True)  # a process holds one accelerator state
            accelerator = Accelerator(cpu=True, mixed_precision=precision)
            with alignment.aligning():
                alignment.loss(student, teacher, batch, accelerator)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    layers = len(alignment.layers)
    assert seen == [False] * layers + [True] * layers
