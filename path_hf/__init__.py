# Copyright 2026 The path-hf authors. Apache-2.0.
"""PaTH attention for Hugging Face Transformers.

Importing path_hf registers `PaTHLlamaConfig` (`model_type="path_llama"`) and its models with `AutoConfig`,
`AutoModel` and `AutoModelForCausalLM`, and marks them so that `save_pretrained` copies their code next to the
weights: a saved model then loads with `trust_remote_code=True` where path_hf is not installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_path_llama import PaTHCacheLayer, PaTHStaticCacheLayer
from .configuration_path_llama import PaTHLlamaConfig, RopeMode
from .local_attention import LocalCacheLayer
from .modeling_path_llama import (
    PaTHLlamaAttention,
    PaTHLlamaDecoderLayer,
    PaTHLlamaForCausalLM,
    PaTHLlamaLocalAttention,
    PaTHLlamaModel,
    PaTHLlamaPreTrainedModel,
    PaTHLlamaRoPEAttention,
    init_path_parameters,
)

AutoConfig.register(PaTHLlamaConfig.model_type, PaTHLlamaConfig)
AutoModel.register(PaTHLlamaConfig, PaTHLlamaModel)
AutoModelForCausalLM.register(PaTHLlamaConfig, PaTHLlamaForCausalLM)
PaTHLlamaConfig.register_for_auto_class()
PaTHLlamaModel.register_for_auto_class("AutoModel")
PaTHLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "LocalCacheLayer",
    "PaTHCacheLayer",
    "PaTHLlamaAttention",
    "PaTHLlamaConfig",
    "PaTHLlamaDecoderLayer",
    "PaTHLlamaForCausalLM",
    "PaTHLlamaLocalAttention",
    "PaTHLlamaModel",
    "PaTHLlamaPreTrainedModel",
    "PaTHLlamaRoPEAttention",
    "PaTHStaticCacheLayer",
    "RopeMode",
    "init_path_parameters",
]
