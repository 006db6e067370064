"""Tiny PaTHLlama models and their source models (Llama, Qwen2, Qwen3), built from configs."""

import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from tests.tiny import tiny_config, tiny_fields

VOCAB = 101
TINY = tiny_fields(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=None)

# Source models a PaTHLlama must hold: (model class, config, PaTHLlama fields describing it).
SOURCES = {
    "llama-gqa-bias-headdim": (
        LlamaForCausalLM,
        tiny_config("llama", **TINY, attention_bias=True, mlp_bias=True, head_dim=16),
        {},
    ),
    "llama-tied": (LlamaForCausalLM, tiny_config("llama", **TINY, tie_word_embeddings=True), {}),
    "llama-llama3-rope": (
        LlamaForCausalLM,
        tiny_config(
            "llama",
            **TINY,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
        {},
    ),
    "llama-yarn-rope": (
        LlamaForCausalLM,
        tiny_config(
            "llama",
            **TINY,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        {},
    ),
    "qwen2": (Qwen2ForCausalLM, tiny_config("qwen2", **TINY), {"attention_bias": True, "attention_o_bias": False}),
    "qwen3": (
        Qwen3ForCausalLM,
        tiny_config("qwen3", **{**TINY, "num_attention_heads": 3, "num_key_value_heads": 1}, head_dim=16),
        {"qk_norm": True},
    ),
}


def path_config_from(source_config, **path_fields) -> PaTHLlamaConfig:
    """The PaTHLlamaConfig of a source config: its shared fields, plus `path_fields`."""
    fields = PaTHLlamaConfig.__dataclass_fields__
    shared = {k: v for k, v in source_config.to_dict().items() if k in fields and k != "model_type"}
    return PaTHLlamaConfig(**{**shared, **path_fields})


def tiny_model_config(**overrides) -> PaTHLlamaConfig:
    """`tiny_model`'s config: a 2-layer GQA PaTHLlama with every PaTH feature on, and an init that gives peaked,
    decisive logits."""
    fields = dict(TINY, path_forget_gate=True, path_conv_size=3, initializer_range=0.2, path_backend="torch")
    return tiny_config("path", **{**fields, **overrides})


def tiny_model(seed: int = 0, **overrides) -> PaTHLlamaForCausalLM:
    torch.manual_seed(seed)
    model = PaTHLlamaForCausalLM(tiny_model_config(**overrides)).eval()
    for module in model.modules():  # a forget gate that keeps most of the context, so attention spans matter
        if hasattr(module, "g_proj") and module.g_proj is not None:
            torch.nn.init.uniform_(module.g_proj.bias, 1.0, 3.0)
    return model


def random_tokens(batch_size: int, seq_len: int, seed: int = 0) -> torch.LongTensor:
    return torch.randint(1, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
