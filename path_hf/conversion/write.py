# Copyright 2026 The path-hf authors. Apache-2.0.
"""Write a planned conversion: stream the source tensors into the output shards, make each PaTH layer's new
parameters with PaTHLlama's own init, and write the config, the model's code files and a model card.

Each output shard's header is written first, then each tensor's bytes in its order: a tensor whose dtype does not
change is copied file to file, so it is bit-identical by construction and memory stays small whatever the model size.
Every tensor is checked for NaN and Inf on the way.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelCardData
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save
from transformers.tokenization_utils_base import TOKENIZER_CONFIG_FILE
from transformers.utils import GENERATION_CONFIG_NAME

from .. import PaTHLlamaConfig, PaTHLlamaForCausalLM, init_path_parameters
from ..configuration_path_llama import RopeMode
from ..errors import ConversionError
from ..modeling_path_llama import FORGET_GATE_MODULES, PATH_MODULES, PaTHLlamaAttention
from .architectures import path_parameters
from .io import (
    NonFiniteValues,
    SafetensorsWriter,
    SourceReader,
    count_nonfinite,
    shard_file_names,
    value_chunks,
    write_index,
)
from .options import format_layers, format_size
from .plan import ConversionPlan, OutputTensor, band_pairs, package_version

# Warnings list at most this many tensors holding non-finite values.
_NAMED_TENSORS = 5


def layer_seed(seed: int, layer_idx: int) -> int:
    """The RNG seed the new parameters of layer `layer_idx` are drawn with: a layer's init depends on `--seed` and
    its index only, not on which other layers are converted."""
    return seed * 1_000_000 + layer_idx


def init_new_parameters(config: PaTHLlamaConfig, layer_idx: int, seed: int) -> dict[str, torch.Tensor]:
    """The new parameters of PaTH layer `layer_idx`, initialised by `init_path_parameters` (PaTHLlama's own init)
    after seeding torch's RNG with `layer_seed(seed, layer_idx)`; keyed by their name in the attention."""
    with torch.device("meta"):
        attention = PaTHLlamaAttention(config, layer_idx)
    # Only the new modules get memory; q/k/v/o stay on the meta device.
    for name in PATH_MODULES:
        if (module := getattr(attention, name)) is not None:
            module.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, layer_idx))
        init_path_parameters(attention, config)
    return {name: param.detach() for name, param in path_parameters(attention)}


def write_conversion(plan: ConversionPlan, directory: Path) -> None:
    """Write the converted checkpoint `plan` describes into the existing, empty `directory`.

    Each source tensor is checked for NaN and Inf as it is written, and so is what casting it to `--dtype` gives:
    the first one that holds any raises `ConversionError`; with `--allow-nonfinite`, they are written and named in
    a warning."""
    config, options = plan.config, plan.options
    file_names = shard_file_names(len(plan.shards))
    new_tensors: dict[str, torch.Tensor] = {}  # of layer `new_layer`, by name in the attention
    new_layer = None
    nonfinite: list[NonFiniteValues] = []

    def finite(tensor: OutputTensor, chunks, cast: bool = False) -> bool:
        found = count_nonfinite(tensor.name, chunks)
        if found is None:
            return True
        if not options.allow_nonfinite:
            if cast:
                dtype = str(tensor.dtype).removeprefix("torch.")
                raise ConversionError(
                    f"{plan.source.name}: tensor {tensor.name!r} becomes {found.describe()} when cast to {dtype} "
                    "(values beyond its range); choose a wider --dtype, or pass --allow-nonfinite to convert it "
                    "anyway."
                )
            raise ConversionError(
                f"{plan.source.name}: tensor {tensor.name!r} holds {found.describe()}, so the model computes NaN; "
                "repair or re-export the checkpoint, or pass --allow-nonfinite to convert it as it is."
            )
        nonfinite.append(found)
        return False

    with SourceReader() as reader:
        for shard, file_name in zip(plan.shards, file_names, strict=True):
            print(f"writing {file_name} ({format_size(sum(t.nbytes for t in shard))})", flush=True)
            with SafetensorsWriter(directory / file_name, shard) as writer:
                for tensor in shard:
                    if tensor.source is None:
                        if tensor.layer != new_layer:  # the first new tensor of a layer: make them all
                            new_layer = tensor.layer
                            new_tensors = init_new_parameters(config, new_layer, options.seed)
                        data = new_tensors[tensor.parameter].to(tensor.dtype)
                        if (found := count_nonfinite(tensor.name, value_chunks(data))) is not None:
                            raise ConversionError(  # made by this conversion: no source to blame or allow
                                f"the new tensor {tensor.name!r} holds {found.describe()}: the PaTH options of "
                                "this conversion give a model that computes NaN; check them (--forget-gate-bias, "
                                "--init, --dtype)."
                            )
                        writer.write_tensor(tensor, data)
                    elif tensor.source.offset is not None and tensor.dtype == tensor.source.dtype:
                        finite(tensor, reader.chunks(tensor.source))  # read now, copied from the page cache
                        writer.copy_tensor(tensor, reader.raw_file(tensor.source), tensor.source.offset)
                    else:
                        stored = reader.tensor(tensor.source)
                        data = stored.to(tensor.dtype)
                        if finite(tensor, value_chunks(stored)) and data.dtype != stored.dtype:
                            finite(tensor, value_chunks(data), cast=True)
                        writer.write_tensor(tensor, data)
    if nonfinite:
        named = ", ".join(f"{found.name} ({found.describe()})" for found in nonfinite[:_NAMED_TENSORS])
        more = f" and {len(nonfinite) - _NAMED_TENSORS} more" if len(nonfinite) > _NAMED_TENSORS else ""
        print(
            f"warning: {len(nonfinite)} tensor(s) hold NaN or Inf, converted as they are (--allow-nonfinite): "
            f"{named}{more}",
            file=sys.stderr,
            flush=True,
        )
    if len(plan.shards) > 1:
        write_index(directory, plan.shards, file_names)

    save_model_code(directory, config)
    config.save_pretrained(directory)  # config.json with the auto_map, and the config's code file
    generation_config = plan.source.path / GENERATION_CONFIG_NAME
    if generation_config.is_file():
        shutil.copyfile(generation_config, directory / GENERATION_CONFIG_NAME)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(directory)
    for path in plan.extra_files:
        if path.name == TOKENIZER_CONFIG_FILE and "auto_map" in (tokenizer_config := json.loads(path.read_text())):
            # The source's tokenizer code is not carried over (no .py file is): a map to it would fail every
            # `trust_remote_code=True` load. Without it, transformers uses its own class of that tokenizer.
            del tokenizer_config["auto_map"]
            (directory / path.name).write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
            print(
                f"note: {path.name}'s auto_map dropped: it names tokenizer code of the source, which is not copied",
                flush=True,
            )
        else:
            shutil.copyfile(path, directory / path.name)
    model_card(plan).save(directory / "README.md")


def save_model_code(directory: Path, config: PaTHLlamaConfig) -> None:
    """What `save_pretrained` does for a model registered with `register_for_auto_class`, for `trust_remote_code`:
    copy its modeling file and the files it imports relatively into `directory`, and map the auto class in `config`
    (which `config.save_pretrained` then writes)."""
    with torch.device("meta"):  # an instance of the class is what transformers reads its module and name from
        model = PaTHLlamaForCausalLM(config)
    custom_object_save(model, directory, config=config)


def source_license(directory: Path) -> str | None:
    """The `license` of the source's own model card (README.md front matter), which the converted model keeps."""
    card = directory / "README.md"
    if not card.is_file():
        return None
    try:
        return ModelCard.load(card).data.license
    except (ValueError, OSError):  # no or broken front matter: nothing to keep
        return None


def model_card(plan: ConversionPlan) -> ModelCard:
    """README.md of the converted model: the hub's metadata (`ModelCardData`, the YAML front matter), what was done,
    and how to load and train it."""
    config, source = plan.config, plan.source
    card_data = ModelCardData(
        base_model=source.repo_id,  # None (left out) for a local directory or a GGUF file
        license=source_license(source.path),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["path-attention", "path-hf"],
    )
    revision = f" (revision `{source.revision}`)" if source.revision else ""
    source_named = (
        f"[{source.repo_id}](https://huggingface.co/{source.repo_id})" if source.repo_id else f"`{source.public_name}`"
    )
    if source.gguf:
        source_named = f"the GGUF file `{source.gguf.file.name}`"
        copied = f"Every weight is copied as transformers reads it from the GGUF ({source.gguf.describe()})."
    elif plan.options.dtype is None:
        copied = "Every weight of the source is copied unchanged: same name, dtype and bytes."
    else:
        copied = f"Every weight of the source is copied under its own name, cast to {plan.options.dtype}."
    trained = [json.dumps(name) for name in PATH_MODULES if config.path_forget_gate or name not in FORGET_GATE_MODULES]
    kept_rope = {
        RopeMode.KEEP: "RoPE is kept and PaTH's Householder transforms act on top of it",
        RopeMode.INTERLEAVE: (
            "RoPE is kept and turns the Householder directions too, which puts its rotation by one position between "
            "consecutive transforms (the logits depend on the tokens between query and key, not on where they stand)"
        ),
    }.get(config.rope_mode)
    changes = []  # how the PaTH layers differ from the source's attention besides the transforms
    if (pairs := band_pairs(config)) is not None and pairs[1]:
        changes.append(
            f"RoPE pairs {format_layers(pairs[1])} removed (`rope_max_wavelength` {config.rope_max_wavelength:g}: "
            "they do not rotate)"
        )
    if config.path_attn_temperature_scale:
        changes.append(
            f"its queries scaled by Llama 4's attention temperature from position {config.attn_temperature_length - 1} "
            "on"
        )
    if kept_rope and config.path_init == "identity" and changes:
        starting_point = (
            f"{kept_rope}. Every Householder transform starts at the identity (the `bt_gain` gains are 0), so this "
            f"model computes exactly what the source model computes with, in its PaTH layers, {' and '.join(changes)}, "
            "until training moves the new parameters (`--verify` checks this against the source changed so by hand)."
        )
    elif kept_rope and config.path_init == "identity":
        starting_point = (
            f"{kept_rope}. Every Householder transform starts at the identity (the `bt_gain` gains are 0), so this "
            "model computes exactly what the source model computes until training moves the new parameters."
        )
    elif kept_rope:
        starting_point = (
            f"{kept_rope}. The new parameters start from a random init, so the model differs from the source until "
            "it is trained."
        )
    else:
        starting_point = (
            "RoPE is removed from the PaTH layers, as in the paper: the model starts far from the source and must "
            "be distilled from it or trained further to recover its quality."
        )
    return ModelCard(f"""---
{card_data.to_yaml()}
---

# {Path(plan.options.output).name}

This is {source_named}{revision} with its attention converted to PaTH attention (Yang et
al., 2025, [arXiv:2505.16381](https://arxiv.org/abs/2505.16381)) by `path-hf convert` (path-hf
{package_version()}).

## What was done

```
{plan.describe(public=True)}
```

{copied} Each PaTH layer gets new parameters: `w_proj` (the Householder directions),
`w_conv1d` (a short causal convolution on them, if `path_conv_size > 0`), `bt_proj` and `bt_gain` (their strengths
beta) and, with the forget gate, `g_proj` and `g_gain`. They are initialised by PaTHLlama's own init, seeded from
`--seed {plan.options.seed}`. {starting_point}

The command and its options are recorded in `config.json` under `path_conversion`.

## Load

```python
import path_hf  # registers the path_llama model type
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{Path(plan.options.output).name}", dtype="auto")
tokenizer = AutoTokenizer.from_pretrained("{Path(plan.options.output).name}")
```

path-hf installs from a checkout of its repository: `pip install ".[fla]"` there (or the wheel that its `make wheel`
builds: `pip install "dist/path_hf-0.1.0-py3-none-any.whl[fla]"`). Without path-hf installed,
`from_pretrained(..., trust_remote_code=True)` loads the model code stored beside the weights. PaTH attention runs
with flash-linear-attention's Triton kernel on CUDA when it is installed (the `fla` extra, or
`pip install "flash-linear-attention>=0.6,<0.7" triton` beside the remote code) and with a PyTorch implementation
everywhere else.

## Train

The new parameters are ordinary parameters: fine-tune, distill from the source model (the paper's recipe matches
each attention layer's output, then the logits) or continue pretraining with any transformers trainer; the
recipes of path-hf do this with accelerate. With PEFT, keep the new modules trainable: `modules_to_save=[{trained[0]},
{", ".join(trained[1:])}]`.
""")


__all__ = ["init_new_parameters", "layer_seed", "model_card", "save_model_code", "write_conversion"]
