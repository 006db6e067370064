# Copyright 2026 The path-hf authors. Apache-2.0.
"""RoPE scaling of a loaded model: `rope_scaling(model, "yarn", factor=4)` swaps the model's rotary embedding for one
built with transformers' own `rope_parameters` of that type (YaRN, dynamic NTK, linear interpolation), for the
duration of a `with` block."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from ..configuration_path_llama import RopeMode, source_context

ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn")


def rope_parameters_for(config, rope_type: str, factor: float, original_length: int | None = None) -> dict:
    """transformers' `rope_parameters` of `rope_type` ("linear", "dynamic" or "yarn") with `factor`, on the model's
    own `rope_theta`; `original_length` (the training context) defaults to the model's (`source_context`: its
    RoPE's `original_max_position_embeddings`, else `max_position_embeddings`).

    Dynamic NTK rescales the base only for sequences longer than `max_position_embeddings`, so that must be the
    training context; YaRN and linear interpolation apply `factor` at every length."""
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(f"unknown RoPE scaling {rope_type!r}: use one of {', '.join(ROPE_SCALING_TYPES)}")
    if factor < 1:
        raise ValueError(f"the RoPE scaling factor must be at least 1, got {factor}")
    current = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "rope_mode", None) == RopeMode.DROP and all(
        map(config.is_path_layer, range(config.num_hidden_layers))
    ):
        raise ValueError(f"{type(config).__name__} has rope_mode='drop' in every layer: the model uses no RoPE")
    if "rope_theta" not in current:
        raise ValueError(f"{type(config).__name__} has no rope_parameters with a rope_theta: the model uses no RoPE")
    original_length = original_length or source_context(config)
    parameters = {"rope_type": rope_type, "rope_theta": current["rope_theta"], "factor": float(factor)}
    if rope_type == "yarn":
        parameters["original_max_position_embeddings"] = original_length
    if "partial_rotary_factor" in current:
        parameters["partial_rotary_factor"] = current["partial_rotary_factor"]
    return parameters


@contextlib.contextmanager
def rope_scaling(
    model: nn.Module, rope_type: str, factor: float, original_length: int | None = None
) -> Iterator[nn.Module]:
    """Within the block, `model`'s rotary embeddings (every submodule named `rotary_emb`) are replaced by ones of the
    same class built from a copy of its config with `rope_parameters_for(...)`, i.e. transformers' own YaRN / dynamic
    NTK / linear implementation; the originals come back after. Raises `ValueError` for a model without RoPE.

    The local layers of a PaTH hybrid (`local_window`) keep their own RoPE (`local_rotary_emb`): no distance they see
    exceeds the window, so none is out of distribution while the window is at most the training context
    (`original_length`). A window longer than that is rescaled with the rest."""
    config = copy.deepcopy(model.config)
    original_length = original_length or source_context(config)
    config.rope_parameters = rope_parameters_for(config, rope_type, factor, original_length)
    if rope_type == "dynamic":
        config.max_position_embeddings = original_length
    window = getattr(config, "local_window", None)
    names = {"rotary_emb"}
    if window is not None and window > original_length:
        names.add("local_rotary_emb")
    swapped = []
    for name, module in list(model.named_modules()):
        attribute = name.rsplit(".", 1)[-1]
        if attribute in names:
            parent = model.get_submodule(name.rpartition(".")[0])
            device = next(iter(module.buffers()), torch.empty(0)).device
            setattr(parent, attribute, type(module)(config).to(device))
            swapped.append((parent, attribute, module))
    if not swapped:
        raise ValueError(f"{type(model).__name__} has no rotary embedding (rotary_emb) to rescale: it uses no RoPE")
    try:
        yield model
    finally:
        for parent, attribute, module in swapped:
            setattr(parent, attribute, module)


__all__ = ["ROPE_SCALING_TYPES", "rope_parameters_for", "rope_scaling"]
