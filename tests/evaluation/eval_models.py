"""Tiny checkpoints (a RoPE Llama and a PaTHLlama) saved with the default model's tokenizer, and the repo's text."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "default_model" / "checkpoint"
EVAL_DATA = ROOT / "examples" / "default_model" / "data" / "eval.jsonl.xz"
TRAIN_LENGTH = 32


def shapes(tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TRAIN_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.1,
    )
