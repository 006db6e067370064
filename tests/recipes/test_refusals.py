"""Bad configurations fail before any work starts (nothing is written), with a message naming the field."""

import shutil

import pytest
from safetensors.torch import load_file, save_file

from path_hf.recipes import train
from path_hf.recipes.models import conversion_options
from tests.conversion.checkpoints import make_source
from tests.recipes.recipe_runs import DATA, parse_config, recipe_config, run_recipe, write_config


@pytest.fixture(scope="module")
def other_vocab_source(tmp_path_factory):
    return make_source(tmp_path_factory.mktemp("source") / "llama-300", "llama", vocab_size=300, tokenizer=True)


def refuse(config, tmp_path, capsys, *overrides) -> str:
    assert run_recipe(config, tmp_path, *overrides) == 1
    assert not (tmp_path / "run").exists(), "a refused configuration must not start any work"
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.learning_rat=1"], "unknown key training.learning_rat"),
        (["optimizer.lr=1"], "unknown key optimizer"),
        (["stages.0.name=pretrain"], "stages.0.name must be one of align, distill, lm"),
        (["stages.0.tokens=many"], "stages.0.tokens must be int, got 'many'"),
        (["stages.0.tokens=1.5"], "stages.0.tokens must be int, got 1.5"),
        (["model.convert.rope=sideways"], "model.convert: --rope must be one of drop, keep"),
        (["model.convert.heads=2"], "unknown key model.convert.heads"),
        (["data.train_files=[missing.jsonl]"], "data.train_files: no such file(s): missing.jsonl"),
        (["data.block_size=1024"], "data.block_size 1024 is above the model's limit (max_position_embeddings=256)"),
        (
            ["stages.0.block_size=0"],
            "stages.0.block_size must be at least 2 (a token and the next one it predicts), got 0",
        ),
        (["model.teacher_dtype=float64"], "model.teacher_dtype must be one of float32, bfloat16, float16, auto"),
        (["stages.0.block_size=512"], "stages.0.block_size 512 is above the model's limit"),
        (["data.text_field=body"], "lighthouse.jsonl has no column 'body'"),
        (["training.log_with=[mlflow]"], "training.log_with: unknown tracker"),
        # every number in its range, finite, checked before anything is loaded
        (["stages.0.learning_rate=.nan"], "stages.0.learning_rate must be a finite number > 0, got nan"),
        (["stages.0.learning_rate=inf"], "stages.0.learning_rate must be a finite number > 0, got inf"),
        (["data.block_size=1"], "data.block_size must be at least 2 (a token and the next one it predicts), got 1"),
        (["stages.0.block_size=1"], "stages.0.block_size must be at least 2"),
        (["stages.0.warmup_ratio=-1"], "stages.0.warmup_ratio must be in [0, 1], got -1.0"),
        (["stages.0.warmup_ratio=5"], "stages.0.warmup_ratio must be in [0, 1], got 5.0"),
        (["stages.0.min_lr_ratio=-3"], "stages.0.min_lr_ratio must be in [0, 1], got -3.0"),
        (["training.max_grad_norm=-1"], "training.max_grad_norm must be a finite number >= 0, got -1.0"),
        (["training.weight_decay=.nan"], "training.weight_decay must be a finite number >= 0, got nan"),
        (["training.distill_temperature=0"], "training.distill_temperature must be a finite number > 0, got 0.0"),
        (["training.target_ratio=-1"], "training.target_ratio must be a finite number > 0, got -1.0"),
        (["training.lora_r=0"], "training.lora_r must be at least 1, got 0"),
        (["training.lora_dropout=1"], "training.lora_dropout must be in [0, 1), got 1.0"),
        (["training.seed=-1"], "training.seed must be in [0, 2**32), got -1"),
        (["data.eval_documents=-1"], "data.eval_documents must be 0 or more, got -1"),
        (["data.eval_tokens=1"], "data.eval_tokens 1 cannot fill the longest evaluation window (training.eval_lengths"),
        (
            ["model.convert.forget_gate=true", "model.convert.forget_gate_bias=.nan"],
            "model.convert: --forget-gate-bias must be a finite number, got nan",
        ),
        (["training.keep_checkpoints=0"], "training.keep_checkpoints must be positive, got 0"),
    ],
    ids=lambda value: value[0] if isinstance(value, list) else None,
)
def test_bad_config_names_the_field(tiny_source, tmp_path, capsys, overrides, message):
    config = recipe_config(tiny_source, tmp_path / "run")
    assert message in refuse(config, tmp_path, capsys, *overrides)


def test_empty_data(tiny_source, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    config = recipe_config(tiny_source, tmp_path / "run", data={"train_files": [str(empty)]})
    assert "data: the evaluation split is empty" in refuse(config, tmp_path, capsys)
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text("The keeper climbed the tower.\n")
    config["data"]["eval_files"] = [str(eval_file)]
    assert "data: no training documents" in refuse(config, tmp_path, capsys)


def test_teacher_with_another_vocabulary(tiny_source, other_vocab_source, tmp_path, capsys):
    config = recipe_config(tiny_source, tmp_path / "run", model={"teacher": str(other_vocab_source)})
    error = refuse(config, tmp_path, capsys)
    assert "model.teacher" in error and "vocabulary of 300 tokens" in error


def test_unknown_yaml_key_and_missing_config(tiny_source, tmp_path, capsys):
    config = recipe_config(tiny_source, tmp_path / "run")
    config["data"]["block_length"] = 16
    assert "unknown key data.block_length" in refuse(config, tmp_path, capsys)
    del config["data"]["block_length"]
    del config["training"]["output_dir"]
    assert "training.output_dir is required" in refuse(config, tmp_path, capsys)


def test_overrides_are_read_as_yaml(tiny_source, tmp_path):
    path = write_config(recipe_config(tiny_source, tmp_path / "run"), tmp_path / "recipe.yaml")
    config = parse_config(
        ["--config", str(path), "stages.0.tokens=1e5", "training.eval_lengths=[1, 8]", "model.convert.layers=0-1"]
    )
    assert config.stages[0].tokens == 100_000 and config.training.eval_lengths == [1, 8]
    assert conversion_options(config.model, "out").layers == (0, 1)


def test_streamed_documents_too_short_for_a_block(tiny_source, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("The keeper climbed the tower.\n\n" * 30)  # 240 tokens in all
    data = {"train_files": [str(short)], "eval_files": [str(DATA)], "streaming": True, "block_size": 256}
    config = recipe_config(tiny_source, tmp_path / "run", data=data, training={"eval_lengths": [1]})
    assert run_recipe(config, tmp_path) == 1
    assert "make no block of data.block_size=256 tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        (b"model:\n  path: [x\ndata: {}\n", "not valid YAML (line 3, column 5: expected ',' or ']', but got ':')"),
        (
            b"model:\n\tpath: x\n",
            "not valid YAML (line 2, column 1: found character '\\t' that cannot start any token (YAML indents with "
            "spaces, not tabs))",
        ),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not a text file (byte 0 is not UTF-8)"),
        (b"model: \x00\x01\x02\n", "not valid YAML (unacceptable character #x0000: special characters are not allowed"),
    ],
    ids=["malformed", "tab-indented", "binary", "control-characters"],
)
def test_an_unreadable_recipe_file_is_one_line_naming_the_file_and_the_place(
    tiny_source, tmp_path, capsys, text, message
):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(text)
    assert train.main(["--config", str(path)]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"error: --config {path}: ") and message in error and len(error.splitlines()) == 1


def test_an_override_that_is_not_yaml_is_one_line_naming_it(tiny_source, tmp_path, capsys):
    error = refuse(recipe_config(tiny_source, tmp_path / "run"), tmp_path, capsys, "training.batch_size=[")
    assert error == (
        "error: override training.batch_size=[: not valid YAML (line 1, column 2: expected the node content, but "
        "found '<stream end>')\n"
    )


@pytest.mark.parametrize("where", ["output_dir", "parent"])
def test_an_output_dir_that_is_a_file_is_refused_before_the_conversion(tiny_source, tmp_path, capsys, where):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    output_dir = file if where == "output_dir" else file / "run"
    assert run_recipe(recipe_config(tiny_source, output_dir), tmp_path) == 1
    error = capsys.readouterr().err
    assert error == f"error: training.output_dir {output_dir}: {file} is a file, not a directory\n"
    assert file.read_text() == "mine" and sorted(tmp_path.iterdir()) == [file, tmp_path / "recipe.yaml"]


def test_a_failed_conversion_is_one_line_and_leaves_nothing(tiny_source, tmp_path, capsys):
    source = tmp_path / "nan-source"
    shutil.copytree(tiny_source, source)
    weights = load_file(source / "model.safetensors")
    weights["lm_head.weight"][0, 0] = float("nan")
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "run"
    assert run_recipe(recipe_config(source, out), tmp_path) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"error: model.path: converting it failed: {source}: tensor 'lm_head.weight' holds 1 NaN")
    assert len(error.splitlines()) == 1
    # The converter's way out, said as a recipe sets it, not as its flag.
    assert "model.convert.allow_nonfinite=true" in error and "--allow-nonfinite" not in error
    assert not out.exists()


def test_a_teacher_without_weights_is_one_line_naming_the_field(tiny_source, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    shutil.copy(tiny_source / "config.json", teacher)
    config = recipe_config(tiny_source, tmp_path / "run", model={"teacher": str(teacher)})
    assert run_recipe(config, tmp_path) == 1
    error = capsys.readouterr().err  # after the student's loading bar
    assert error.endswith("\n") and "Traceback" not in error
    assert error.splitlines()[-1].startswith(f"error: model.teacher {teacher}: cannot load its weights (Error no file")
