"""A local path that does not exist is named as one (not passed to the hub as a malformed repo id) by `path-hf
convert --from`, `path-hf eval --model` and the recipe's `model.path` / `model.teacher`; nothing is written."""

from pathlib import Path

import pytest
import yaml

from tests.conversion.checkpoints import make_source, run_cli

ROOT = Path(__file__).resolve().parents[2]
MISSING = ["/no/such/dir", "./missing", "missing.gguf", "../gone/model.safetensors"]


def assert_missing(message: str, source: str) -> None:
    assert f"{source}: no such file or directory" in message, message
    assert "Repo id" not in message and "repo_id" not in message


@pytest.mark.parametrize("source", MISSING)
def test_convert(source, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert_missing(err, source)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source", MISSING)
def test_eval(source, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("The keeper climbed the tower and lit the lamp.\n")
    args = ["eval", "--model", source, "--data", "text.txt", "--lengths", "4", "--max-tokens", "8", "--no-progress"]
    code, _, err = run_cli(capsys, *args, "--output", "report.json")
    assert code == 1
    assert err.splitlines()[-1].startswith(f"error: --model {source}: ")
    assert_missing(err.splitlines()[-1], source)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["text.txt"]


@pytest.fixture(scope="module")
def recipe():
    """recipes/settings.py and recipes/train.py, which imports it as a sibling."""
    from path_hf.recipes import settings, train

    return settings, train


@pytest.mark.parametrize("field", ["path", "teacher"])
@pytest.mark.parametrize("source", ["/no/such/dir", "./missing", "missing.gguf"])
def test_recipe_plan_models(field, source, recipe, tmp_path, monkeypatch):
    settings, train = recipe
    monkeypatch.chdir(tmp_path)
    model = {"path": str(make_source(tmp_path / "llama", "llama")), "convert": {"rope": "drop"}, field: source}
    tree = {
        "model": model,
        "data": {"train_files": [str(ROOT / "tests" / "recipes" / "data" / "lighthouse.jsonl")], "block_size": 16},
        "stages": [{"name": "distill", "tokens": 128, "learning_rate": 1e-3}],
        "training": {"output_dir": str(tmp_path / "run")},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    config = settings.parse_config(["--config", str(tmp_path / "recipe.yaml")])
    with pytest.raises(settings.RecipeError) as refused:
        train.plan_models(config)
    message = str(refused.value)
    assert message.startswith(f"model.{field} {source}: cannot read its config (")
    assert_missing(message, source)
    assert not (tmp_path / "run").exists()
