"""Tiny source checkpoints (Llama, Qwen2, Qwen3, Mistral) saved with transformers, and helpers that read
checkpoints back, for the conversion tests."""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaForCausalLM,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from path_hf.arguments import from_arguments
from path_hf.cli import build_parser, main
from path_hf.conversion.convert import Conversion, convert
from path_hf.conversion.options import ConvertOptions
from path_hf.conversion.verify import TEXT_FILE
from tests.tiny import WIDE, tiny_config, tiny_fields

TINY = tiny_fields(**WIDE, vocab_size=256, num_hidden_layers=3, max_position_embeddings=256)
# kind (a key of `tests.tiny.CONFIG_CLASSES`) -> its model class
SOURCES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
}
CHAT_TEMPLATE = "{% for message in messages %}<s>{{ message['content'] }}</s>{% endfor %}"


def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of the built-in verification text, with a chat template."""
    words = sorted(set(re.findall(r"\w+|[^\w\s]", TEXT_FILE.read_text())))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{word: i + 3 for i, word in enumerate(words)}}
    assert len(vocab) <= TINY["vocab_size"]
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


def make_source(
    directory: Path,
    kind: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    pytorch_bin: bool = False,
    tokenizer: bool = False,
    **config_fields,
) -> Path:
    """Save a randomly initialised tiny `kind` model to `directory` (sharded if `max_shard_size`, as `.bin` files
    if `pytorch_bin`) and return `directory`."""
    model_class = SOURCES[kind]
    torch.manual_seed(seed)
    model = model_class(tiny_config(kind, **{**TINY, **config_fields}))
    if pytorch_bin:
        # transformers 5 writes safetensors only: two .bin shards and their index, as older versions wrote them.
        directory.mkdir(parents=True)
        model.config.architectures = [model_class.__name__]
        model.config.save_pretrained(directory)
        model.generation_config.save_pretrained(directory)
        state_dict = model.state_dict()
        if model.config.tie_word_embeddings:
            del state_dict["lm_head.weight"]
        names = list(state_dict)
        weight_map = {}
        for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            file_name = f"pytorch_model-0000{i + 1}-of-00002.bin"
            torch.save({name: state_dict[name] for name in part}, directory / file_name)
            weight_map.update(dict.fromkeys(part, file_name))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    else:
        model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        save_tokenizer(directory)
    return directory


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (safetensors or .bin files)."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    for file in sorted(directory.glob("*.bin")):
        tensors.update(torch.load(file, weights_only=True))
    return tensors


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`path-hf` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()  # drop what came before (progress bars of `save_pretrained`)
    code = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def convert_in_process(capsys, *args) -> tuple[Conversion, str]:
    """`path-hf convert ARGS` by its function, `convert`, with the options the CLI parses from `ARGS`: (what it
    returned, stdout). A refusal or a failure raises."""
    capsys.readouterr()  # drop what came before
    options = from_arguments(build_parser().parse_args(["convert", *(str(arg) for arg in args)]), ConvertOptions)
    conversion = convert(options)
    return conversion, capsys.readouterr().out
