"""The tiny model configs the tests build: one set of shapes (`SHAPES`, or `WIDE` rows for the checkpoints that the
conversion and GGUF tests write), each test's own fields passed over them as overrides."""

from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from path_hf import PaTHLlamaConfig

# Hidden 32, 2 layers, GQA: two query heads read each key head.
SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# Wider rows (head dim 16): the source checkpoints that the conversion and GGUF tests write.
WIDE = dict(hidden_size=64, intermediate_size=96)
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "path": PaTHLlamaConfig,
}


def tiny_fields(tokenizer=None, **overrides) -> dict:
    """`SHAPES`, with `tokenizer`'s vocabulary size and special token ids if one is given, and `overrides` over them."""
    fields = dict(SHAPES)
    if tokenizer is not None:
        fields.update(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return {**fields, **overrides}


def tiny_config(kind: str = "llama", tokenizer=None, **overrides) -> PretrainedConfig:
    """The tiny config of `kind` ("llama", "mistral", "qwen2", "qwen3" or "path"): `tiny_fields(tokenizer,
    **overrides)`."""
    return CONFIG_CLASSES[kind](**tiny_fields(tokenizer, **overrides))
