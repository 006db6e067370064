"""Recipe configs that run in seconds on the tiny model, and running `recipes/train.py` in this process."""

import json
from pathlib import Path

import yaml

from path_hf.recipes import train
from path_hf.recipes.settings import parse_config  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]

DATA = Path(__file__).parent / "data" / "lighthouse.jsonl"


def recipe_config(source: Path, output_dir: Path, **sections) -> dict:
    """A recipe config that runs in seconds: 16-token blocks, 4 per batch (64 tokens a step), small evaluation."""
    config = {
        "model": {"path": str(source), "convert": {"rope": "drop"}},
        "data": {"train_files": [str(DATA)], "eval_documents": 10, "eval_tokens": 256, "block_size": 16},
        "stages": [{"name": "lm", "tokens": 128, "learning_rate": 1e-3}],
        "training": {
            "output_dir": str(output_dir),
            "batch_size": 4,
            "eval_every": 100,
            "eval_lengths": [1, 2],
            "eval_batch_size": 8,
            "log_every": 1,
            "log_with": ["jsonl"],
        },
    }
    for section, values in sections.items():
        config[section] = values if isinstance(values, list) else {**config[section], **values}
    return config


def write_config(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def run_recipe(config: dict, tmp_path: Path, *overrides: str) -> int:
    """`recipes/train.py --config ... overrides` in this process; its exit code."""
    return train.main(["--config", str(write_config(config, tmp_path / "recipe.yaml")), *overrides])


def read_log(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "logs" / "recovery" / "log.jsonl").read_text().splitlines()]
