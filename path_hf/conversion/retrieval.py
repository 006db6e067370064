# Copyright 2026 The path-hf authors. Apache-2.0.
"""`path-hf convert --retrieval-layers N` and `--full-heads N`: the PaTH layers, or the local layers' full heads,
chosen where the source retrieves from far back.

A hybrid (`--local-window`) sees past its window only through its PaTH layers, so they must be the layers that hold
the source's retrieval heads: with every fourth layer of SmolLM2-135M kept global, the source itself misses every
passkey past a 2048-token window, and with the 7 layers this measures, it finds them all (docs/smollm2/long-context,
"The hybrid's PaTH layers are not the source's retrieval layers"). The measurement is
`path_hf.evaluation.retrieval_heads` on the whole source, before anything is converted.
"""

from __future__ import annotations

import copy
import time

import torch

from ..errors import ConversionError, first_line
from ..loading import load_causal_lm, load_tokenizer
from .options import RETRIEVAL_LENGTH, ConvertOptions, format_heads, format_layers
from .plan import check_source_links, read_source_config, source_context
from .sources import Source, fetch_weights


def choose_retrieval_layers(options: ConvertOptions, source: Source) -> ConvertOptions:
    """`options` with `layers` set to the `options.retrieval_layers` layers where the source's strongest heads look at
    a passkey's needle when they write the key (`rank_retrieval_layers`), measured on prompts of
    `options.retrieval_length` tokens (default: the source's training context, at most `RETRIEVAL_LENGTH`). Prints
    every layer's score. The source loads whole, at `--dtype` (a GGUF: dequantised to it, float32 by default; a
    checkpoint: its own dtype by default)."""
    from ..evaluation import passkey_windows, rank_retrieval_heads, rank_retrieval_layers, retrieval_heads

    check_source_links(source, options.follow_symlinks)
    # a source the converter refuses, or options that cannot run, are refused before the source is loaded
    _, source_config = read_source_config(source, options)
    num_layers = source_config.num_hidden_layers
    if options.retrieval_layers is not None and options.retrieval_layers >= num_layers:
        raise ConversionError(
            f"--retrieval-layers {options.retrieval_layers} asks for at least every layer of the model's "
            f"{num_layers}: give fewer, or leave it out to make every layer a PaTH layer."
        )
    length = options.retrieval_length or min(source_context(source_config), RETRIEVAL_LENGTH)
    name = str(source.gguf.file) if source.gguf else str(source.path)
    try:
        tokenizer = load_tokenizer(name)
    except (OSError, ValueError) as error:
        raise ConversionError(
            f"--retrieval-layers runs the source on passkey prompts, but {source.name} has no tokenizer that loads "
            f"({first_line(error)}); add its tokenizer files, or name the PaTH layers with --layers."
        ) from error
    try:
        passkey_windows(tokenizer, length, 1)
    except ValueError as error:
        raise ConversionError(f"--retrieval-length {length}: {error}.") from error
    if not source.gguf:
        fetch_weights(source)
    dtype = getattr(torch, options.dtype) if options.dtype else source.gguf.dtype if source.gguf else "auto"
    model = load_causal_lm(name, dtype)
    started = time.perf_counter()
    mass = retrieval_heads(model.to("cuda" if torch.cuda.is_available() else "cpu"), tokenizer, length)
    seconds = time.perf_counter() - started
    chosen_options = copy.copy(options)  # both recorded: what was asked and what it chose
    if options.retrieval_layers is not None:
        ranked = rank_retrieval_layers(mass)
        chosen_options.layers = tuple(sorted(ranked[: options.retrieval_layers]))
        strongest = mass.max(-1).values
        print(
            f"retrieval layers: {format_layers(chosen_options.layers)} (each layer's strongest head's attention on the "
            f"passkey, {length} tokens, {seconds:.0f} s: "
            + ", ".join(f"{layer} {strongest[layer]:.2f}" for layer in ranked)
            + ")",
            flush=True,
        )
    if options.full_heads is not None:
        local = [layer for layer in range(num_layers) if layer not in (chosen_options.layers or ())]
        heads = rank_retrieval_heads(mass, local)[: options.full_heads]
        if len(heads) < options.full_heads:
            raise ConversionError(
                f"--full-heads {options.full_heads}: the local layers hold {len(heads)} query heads; give fewer."
            )
        chosen_options.local_full_heads = tuple(sorted(heads))
        print(
            f"full heads: {format_heads(chosen_options.local_full_heads)} (layer:head; attention on the passkey, "
            f"{length} tokens, {seconds:.0f} s: "
            + ", ".join(f"{layer}:{head} {mass[layer, head]:.2f}" for layer, head in heads)
            + ")",
            flush=True,
        )
    return chosen_options


__all__ = ["choose_retrieval_layers"]
