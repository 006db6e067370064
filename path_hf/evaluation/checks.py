# Copyright 2026 The path-hf authors. Apache-2.0.
"""What an evaluation refuses before any model is evaluated, each on one line (`EvaluationError`), and the tokens each
model is evaluated on.

`check_model`, on the config alone: a model that is not a causal decoder (an encoder-decoder config), a RoPE scaling
without a training length or of a model without RoPE, `--local-window` for a model without local layers, a local
checkpoint whose weights hold NaN or Inf, and a checkpoint directory without tokenizer files. `prepare_tokens`: a
tokenizer without a vocabulary, one that writes more than `MAX_UNKNOWN_SHARE` unknown tokens on the data, too little
text for the longest length, and a tokenizer that does not belong to the model (an id without an embedding, or a
`--tokenizer` that writes other ids than the model's own tokenizer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ..errors import EvaluationError, SourceError, first_line
from ..loading import TOKENIZER_FILES, GGUFFile, find_gguf, load_config, load_tokenizer
from .options import EvalOptions, ModelSpec, model_train_length
from .rope import rope_parameters_for
from .texts import tokenize_stream

# A tokenizer that fits the text writes few unknown tokens; more than this share of the stream is refused.
MAX_UNKNOWN_SHARE = 0.05
# The haystack text read for the needle prompts: this many times the longest length (their stretches are drawn from it).
HAYSTACK_LENGTHS = 8
# `--tokenizer` and a model's own tokenizer must write the same ids for the first this many characters of --data.
PROBE_CHARACTERS = 4000


@contextlib.contextmanager
def loading_errors(flag: str, source: str) -> Iterator[None]:
    """Turns the errors of loading `source` into one line naming `flag` and it."""
    try:
        yield
    except (OSError, ValueError) as error:
        raise EvaluationError(f"{flag} {source}: cannot load it ({first_line(error)})") from error
    except SourceError as error:  # a GGUF that cannot be read, a path that does not exist
        raise EvaluationError(f"{flag} {source}: {error}") from error


def _has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES) or any(directory.glob("*.tiktoken"))


def check_model(spec: ModelSpec, options: EvalOptions) -> PretrainedConfig:
    """Refuse, before any weights are loaded, a `--model` whose config is an encoder-decoder, a RoPE scaling without
    a training length or of a model without RoPE, and a local checkpoint directory without tokenizer files (a GGUF
    carries its own tokenizer). Returns the model's config."""
    with loading_errors("--model", spec.path):
        config = load_config(spec.path, trust_remote_code=options.trust_remote_code)
    if getattr(config, "is_encoder_decoder", False):
        raise EvaluationError(
            f"--model {spec.path} is an encoder-decoder model ({type(config).__name__}): not a causal decoder"
        )
    if spec.rope_scaling and not model_train_length(config, options.train_length):
        raise EvaluationError(f"--model {spec.label}: RoPE scaling needs the training length: pass --train-length")
    if spec.rope_scaling:  # a model without RoPE has nothing to scale: refused now, not after loading it
        try:
            rope_parameters_for(config, spec.rope_scaling, max(1.0, spec.rope_factor or 1.0))
        except ValueError as error:
            raise EvaluationError(f"--model {spec.label}: @{spec.rope_scaling}: {error}") from error
    if options.local_window is not None and getattr(config, "local_window", None) is None:
        raise EvaluationError(
            f"--local-window {options.local_window}: --model {spec.label} has no local layers (no local_window in "
            "its config): leave the option out, or give a hybrid (path-hf convert --local-window)"
        )
    _check_finite_weights(spec)
    flag, source = options.tokenizer_source(spec)
    directory = Path(source).expanduser()
    if not directory.is_dir():
        return config  # a hub id or a file (a GGUF carries its own tokenizer)
    with loading_errors(flag, source):
        gguf = find_gguf(source)
    if gguf is None and not _has_tokenizer_files(directory):
        advice = "pass --tokenizer PATH_OR_ID" if flag == "--model" else "give the model's own tokenizer"
        raise EvaluationError(
            f"{flag} {source}: the directory holds no tokenizer files ({', '.join(TOKENIZER_FILES)}, *.tiktoken): "
            f"{advice}"
        )
    return config


def _check_finite_weights(spec: ModelSpec) -> None:
    """Refuse a local safetensors checkpoint whose tensors hold NaN or Inf (its logits would be NaN, and the causality
    check would call it bidirectional), naming the first such tensor: read here, before any model is evaluated."""
    from safetensors import safe_open

    directory = Path(spec.path).expanduser()
    for file in sorted(directory.glob("*.safetensors")) if directory.is_dir() else []:
        with safe_open(file, framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                tensor = weights.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    raise EvaluationError(
                        f"--model {spec.path}: tensor {name!r} of {file.name} holds {bad:,} NaN or Inf value(s) of "
                        f"{tensor.numel():,}: the checkpoint is damaged; convert or train it again"
                    )


@dataclass(frozen=True)
class Tokens:
    """What a model is evaluated on: its tokenizer, the first `--max-tokens` tokens of the data in it, the haystack
    text of the needle prompts (`--needle-data`, or more of `--data`), and the largest token id the model is fed
    (needles and questions included), which its vocabulary must hold."""

    tokenizer: Any
    stream: list[int]
    largest_id: int
    haystack: list[int] = field(default_factory=list)


@dataclass
class TokenizerCache:
    """What the models of one run share: the tokens of each tokenizer source, and the models whose `--tokenizer` was
    compared with their own."""

    tokens: dict[str, Tokens] = field(default_factory=dict)
    compared: set[str] = field(default_factory=set)


def _tokenize(
    flag: str, source: str, label: str, options: EvalOptions, texts: list[str], needle_texts: list[str] | None = None
) -> Tokens:
    """The tokenizer of `source` and the data in it; refuses a tokenizer without a vocabulary, one that does not fit
    the text, and too little text for the longest length."""
    with loading_errors(flag, source):
        tokenizer = load_tokenizer(source, trust_remote_code=options.trust_remote_code)
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise EvaluationError(
            f"{flag} {source}: the tokenizer has no vocabulary, only {len(tokenizer)} special token(s): give the "
            "model's own tokenizer"
        )
    stream = tokenize_stream(texts, tokenizer, options.max_tokens)
    unknown = stream.count(tokenizer.unk_token_id) if tokenizer.unk_token_id is not None else 0
    if unknown > MAX_UNKNOWN_SHARE * len(stream):
        raise EvaluationError(
            f"{unknown / len(stream):.0%} of the first {len(stream)} tokens of --data are the unknown token "
            f"{tokenizer.unk_token!r}: {source}'s tokenizer does not fit the text; give the model's own (--tokenizer)"
        )
    if len(stream) < options.lengths[-1]:
        raise EvaluationError(
            f"--data holds {len(stream)} tokens for {label}'s tokenizer, fewer than the longest length "
            f"{options.lengths[-1]}: give more text or drop the longer lengths"
        )
    largest_id = max(stream)
    haystack: list[int] = []
    if options.needles_wanted:
        haystack = tokenize_stream(
            needle_texts or texts, tokenizer, max(options.max_tokens, HAYSTACK_LENGTHS * options.lengths[-1])
        )
        if len(haystack) < options.lengths[-1]:
            raise EvaluationError(
                f"{'--needle-data' if needle_texts else '--data'} holds {len(haystack)} tokens for {label}'s "
                f"tokenizer, fewer than a needle prompt of the longest length {options.lengths[-1]}: give more text"
            )
        templates = options.templates()
        pieces = [template.needle + template.question for template in (*templates.passkey, *templates.multikey)]
        pieces += [" ".join(templates.names) + " 0123456789"]
        largest_id = max(largest_id, *haystack, *(max(tokenizer(piece)["input_ids"] or [0]) for piece in pieces))
    return Tokens(tokenizer, stream, largest_id, haystack)


def model_vocabulary(config: PretrainedConfig) -> int | None:
    """The number of token embeddings of a model, from its config."""
    return getattr(config.get_text_config(), "vocab_size", None)


def check_vocabulary(spec: ModelSpec, options: EvalOptions, tokens: Tokens, vocabulary: int | None) -> None:
    """Refuse a tokenizer that writes a token id the model has no embedding for. A tokenizer with fewer tokens than
    the model's embeddings is common (vocabularies padded to a multiple of 64 or 128: Qwen2.5 has 151,665 tokens and
    151,936 embeddings) and passes."""
    if vocabulary is None or tokens.largest_id < vocabulary:
        return
    written = (
        f"writes token id {tokens.largest_id} on the evaluation text, and the model has {vocabulary} token embeddings"
    )
    if options.tokenizer:
        raise EvaluationError(
            f"--tokenizer {options.tokenizer} does not belong to --model {spec.path}: it {written}: give the model's "
            "own tokenizer"
        )
    raise EvaluationError(
        f"--model {spec.path}: its tokenizer {written}: the tokenizer and the weights do not belong together; pass "
        "--tokenizer with the model's own"
    )


def _own_tokenizer(spec: ModelSpec) -> str | None:
    """Where the model of `spec` keeps a tokenizer of its own, if it is local: a GGUF with one in its metadata, or a
    checkpoint directory with tokenizer files (a hub id is not asked: that would need the network)."""
    try:
        gguf = find_gguf(spec.path)
        if gguf is not None:
            return spec.path if GGUFFile.read(gguf).has_tokenizer else None
    except SourceError:
        return None
    directory = Path(spec.path).expanduser()
    return spec.path if directory.is_dir() and _has_tokenizer_files(directory) else None


def _check_own_tokenizer(spec: ModelSpec, options: EvalOptions, tokens: Tokens, texts: list[str]) -> None:
    """Refuse a `--tokenizer` that writes other ids than the model's own tokenizer on the start of the data. Their
    vocabulary sizes may differ (one padded, one with extra special tokens) as long as the ids agree; a model whose
    own tokenizer does not load (a reason to pass another) is not compared."""
    own_source = _own_tokenizer(spec)
    given = Path(options.tokenizer).expanduser()
    if own_source is None or (given.exists() and given.resolve() == Path(own_source).expanduser().resolve()):
        return
    try:
        own = load_tokenizer(own_source, trust_remote_code=options.trust_remote_code)
    except Exception:  # whatever a broken tokenizer raises: there is nothing to compare with
        return
    probe, left = [], PROBE_CHARACTERS
    for text in texts:
        if left <= 0:
            break
        probe.append(text[:left])
        left -= len(probe[-1])
    if tokenize_stream(probe, own) != tokenize_stream(probe, tokens.tokenizer):
        raise EvaluationError(
            f"--tokenizer {options.tokenizer} does not belong to --model {spec.path}: on the first "
            f"{PROBE_CHARACTERS - max(left, 0)} characters of --data it writes other token ids than the model's own "
            f"tokenizer ({len(tokens.tokenizer)} tokens; the model's: {len(own)}): leave out --tokenizer to use the "
            "model's own"
        )


def prepare_tokens(
    spec: ModelSpec,
    options: EvalOptions,
    texts: list[str],
    config: PretrainedConfig,
    cache: TokenizerCache,
    needle_texts: list[str] | None = None,
) -> Tokens:
    """The tokens `spec` is evaluated on (`config`: its model's), checked before any model is loaded: the tokenizer
    must fit the text (`_tokenize`) and belong to the model: every id it writes has an embedding, and a `--tokenizer`
    writes the ids of the model's own tokenizer, if the model has one. `cache` keeps what models of the same run
    share: a tokenizer and its tokens, a comparison of the same model's tokenizers."""
    flag, source = options.tokenizer_source(spec)
    if source not in cache.tokens:
        cache.tokens[source] = _tokenize(flag, source, spec.label, options, texts, needle_texts)
    tokens = cache.tokens[source]
    check_vocabulary(spec, options, tokens, model_vocabulary(config))
    if options.tokenizer and spec.path not in cache.compared:
        _check_own_tokenizer(spec, options, tokens, texts)
        cache.compared.add(spec.path)
    return tokens


__all__ = [
    "HAYSTACK_LENGTHS",
    "MAX_UNKNOWN_SHARE",
    "PROBE_CHARACTERS",
    "TokenizerCache",
    "Tokens",
    "check_model",
    "check_vocabulary",
    "loading_errors",
    "model_vocabulary",
    "prepare_tokens",
]
