"""Fixtures: the default model's tokenizer, and tiny checkpoints saved with it."""

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from tests.evaluation.eval_models import TOKENIZER, shapes


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """{"llama": dir, "path": dir, "qwen3": dir}: random tiny models, saved like any checkpoint."""
    root = tmp_path_factory.mktemp("eval-checkpoints")
    torch.manual_seed(0)
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(**shapes(tokenizer))),
        "path": PaTHLlamaForCausalLM(PaTHLlamaConfig(**shapes(tokenizer), path_backend="torch")),
        "qwen3": Qwen3ForCausalLM(Qwen3Config(**shapes(tokenizer))),
    }
    paths = {}
    for name, model in models.items():
        paths[name] = root / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths
