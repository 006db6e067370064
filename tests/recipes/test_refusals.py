"""Bad configurations fail before any work starts (nothing is written), with a message naming the field."""

import pytest

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
        (["stages.0.block_size=0"], "stages.0.block_size must be positive, got 0"),
        (["model.teacher_dtype=float64"], "model.teacher_dtype must be one of float32, bfloat16, float16, auto"),
        (["stages.0.block_size=512"], "stages.0.block_size 512 is above the model's limit"),
        (["data.text_field=body"], "lighthouse.jsonl has no column 'body'"),
        (["training.log_with=[mlflow]"], "training.log_with: unknown tracker"),
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
