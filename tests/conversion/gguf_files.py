"""Tiny GGUF files written the way llama.cpp's `convert_hf_to_gguf.py` writes them (metadata keys, tensor names,
the Q/K row permutation of Llama, 1-D tensors kept in F32), from a tiny transformers model and the default model's
byte-level BPE tokenizer, with the `gguf` package's `GGUFWriter`."""

import json
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedModel, Qwen2ForCausalLM, Qwen3ForCausalLM

from tests.tiny import WIDE, tiny_config, tiny_fields

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "default_model" / "checkpoint"
CHAT_TEMPLATE = "{% for message in messages %}<s>{{ message['content'] }}</s>{% endfor %}"
# GGUF architecture (and its kind in `tests.tiny.CONFIG_CLASSES`) -> the transformers class of a model that llama.cpp
# writes under it.
MODELS = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}


@cache
def default_tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def tiny_model(arch: str = "llama", seed: int = 0, **fields) -> PreTrainedModel:
    """A random tiny model of `arch`, with the default model's vocabulary; rows are multiples of 32 (the block of
    the quantised types). Qwen3 keeps transformers' default head dim, 128: a GGUF of Qwen3 does not state it."""
    shapes = tiny_fields(
        default_tokenizer(),
        **WIDE,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    if arch == "qwen3":
        shapes.update(head_dim=128)
    torch.manual_seed(seed)
    return MODELS[arch](tiny_config(arch, **{**shapes, **fields})).eval()


def _llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of q_proj / k_proj rows (rotary halves interleaved), which readers undo."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    path: Path,
    model: PreTrainedModel,
    arch: str = "llama",
    tensor_type: str = "F32",
    *,
    name: str = "tiny",
    tokenizer: bool = True,
    extra: dict | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, str]] | None = None,
) -> Path:
    """Write `model` as the GGUF llama.cpp would, its 2-D weights stored as `tensor_type` (F32, F16, BF16, or a type
    `gguf.quants.quantize` writes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1). `extra` adds metadata (`{key: value}`, strings,
    ints or floats); `raw_tensors` adds tensors as raw bytes of a ggml type (`{gguf_name: (uint8 array of the byte
    shape, type name)}`)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    if tokenizer:
        _add_tokenizer(writer)

    # Tensor names as llama.cpp writes them for `arch` (as for llama where `arch` is not one of `MODELS`).
    tensor_arch = arch if arch in MODELS else "llama"
    model_arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == tensor_arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    state_dict = model.state_dict()
    if config.tie_word_embeddings:
        del state_dict["lm_head.weight"]  # llama.cpp writes no output.weight for tied embeddings
    for hf_name, tensor in state_dict.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            data = _llama_permute(data, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            data = _llama_permute(data, config.num_key_value_heads)
        kind = gguf.GGMLQuantizationType[tensor_type if data.ndim == 2 else "F32"]
        if kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    for gguf_name, (raw, type_name) in (raw_tensors or {}).items():
        writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The default model's byte-level BPE as llama.cpp stores a GPT-2 style vocabulary."""
    hf = default_tokenizer()
    vocab = hf.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[token] for token in tokens] == list(range(len(tokens)))
    merges = json.loads(hf.backend_tokenizer.to_str())["model"]["merges"]
    special = set(hf.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens])
    writer.add_token_merges([merge if isinstance(merge, str) else " ".join(merge) for merge in merges])
    writer.add_bos_token_id(hf.bos_token_id)
    writer.add_eos_token_id(hf.eos_token_id)
    writer.add_pad_token_id(hf.pad_token_id)
    writer.add_add_bos_token(hf("a").input_ids[0] == hf.bos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
