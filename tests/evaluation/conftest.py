"""Fixtures: the default model's tokenizer, tiny checkpoints saved with it, and another model's tokenizer."""

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.evaluation import read_texts
from tests.evaluation.eval_models import EVAL_DATA, TOKENIZER, shapes


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


@pytest.fixture(scope="session")
def other_tokenizer(tmp_path_factory) -> Path:
    """Another model's tokenizer that fits the evaluation text: byte-level BPE of 300 tokens learnt from it (no
    unknown token), whose ids all lie within the default vocabulary but are not the default tokenizer's."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(read_texts([EVAL_DATA]), trainer)
    directory = tmp_path_factory.mktemp("other-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>").save_pretrained(directory)
    return directory
