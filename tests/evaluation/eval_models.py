"""Tiny checkpoints (a RoPE Llama and a PaTHLlama) saved with the default model's tokenizer, and the repo's text."""

from pathlib import Path

from tests.tiny import tiny_fields

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "default_model" / "checkpoint"
EVAL_DATA = ROOT / "examples" / "default_model" / "data" / "eval.jsonl.xz"
TRAIN_LENGTH = 32


def shapes(tokenizer) -> dict:
    """The evaluation tests' tiny config fields: `tokenizer`'s vocabulary and special tokens, a context of
    `TRAIN_LENGTH`."""
    return tiny_fields(tokenizer, max_position_embeddings=TRAIN_LENGTH, initializer_range=0.1)
