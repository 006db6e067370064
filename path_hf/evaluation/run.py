# Copyright 2026 The path-hf authors. Apache-2.0.
"""An evaluation, what `path-hf eval` runs: perplexity, passkey, multi-key and copy retrieval of several causal LMs at
several context lengths, on the same text.

```python
from path_hf.evaluation import EvalOptions, ModelSpec, evaluate, format_table

options = EvalOptions(models=[ModelSpec.parse("src=HuggingFaceTB/SmolLM2-135M")], data=["held_out.jsonl"],
                      lengths=(2048, 4096), passkey_trials=20)
report = evaluate(options)  # an EvalReport: report.models["src"].lengths[4096].passkey.summary.found
print(format_table(report))
```

`evaluate` checks everything it can before any model is loaded (`EvalOptions.check`, then `check_model` and
`prepare_tokens` for every model), then loads one model at a time and measures it at each length (`measure`). A model
with RoPE scaling whose scaling is the identity at a length (`scaling_is_identity`) takes the result of the same
checkpoint evaluated without scaling in the same run there. The metrics are `path_hf.evaluation`'s, the same functions
the recipes track recovery with.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from ..errors import EvaluationError
from ..loading import load_causal_lm
from .checks import TokenizerCache, Tokens, check_model, check_vocabulary, loading_errors, prepare_tokens
from .copy_retrieval import copy_scores, copy_windows
from .needles import multikey_trials, passkey_trials, score_trials, trial_records
from .options import EvalOptions, ModelSpec, model_train_length
from .results import CopyScore, EvalReport, LengthResult, ModelResult, NeedleScore, NeedleSummary, PerplexityScore
from .rope import rope_scaling
from .scoring import attends_causally, make_windows, score_windows
from .texts import read_texts

# Called with each model's result at each length as soon as it is measured (what `path-hf eval` prints).
LengthCallback = Callable[[ModelSpec, int, LengthResult], None]


def scaling_is_identity(rope_scaling: str, factor: float, length: int, train_length: int) -> bool:
    """Whether transformers' RoPE scaling `rope_scaling` with `factor` computes the unscaled RoPE at `length`: YaRN and
    linear with factor 1, and dynamic NTK up to the training length (it rescales only longer sequences)."""
    if rope_scaling == "dynamic":
        return length <= train_length
    return factor == 1.0


def read_documents(flag: str, files: list[str], text_field: str) -> list[str]:
    """The documents of the files a flag names; refuses files that cannot be read and data without a document."""
    try:
        texts = read_texts(files, text_field)
    except (OSError, ValueError) as error:
        raise EvaluationError(f"{flag}: {error}") from error
    if not texts:
        raise EvaluationError(f"{flag} {' '.join(files)}: no non-empty documents")
    return texts


def read_data(options: EvalOptions) -> tuple[list[str], list[str] | None]:
    """The documents of `--data`, and those of `--needle-data` when a needle test runs on it (else None)."""
    texts = read_documents("--data", options.data, options.text_field)
    needle_texts = None
    if options.needle_data and options.needles_wanted:
        needle_texts = read_documents("--needle-data", options.needle_data, options.text_field)
    return texts, needle_texts


def load_model(spec: ModelSpec, options: EvalOptions, device: str) -> PreTrainedModel:
    """The causal LM of `spec` on `device`, refused if it attends in both directions."""
    with loading_errors("--model", spec.path):
        model = load_causal_lm(
            spec.path, getattr(torch, options.dtype), trust_remote_code=options.trust_remote_code
        ).to(device)
    if not attends_causally(model):
        raise EvaluationError(
            f"--model {spec.path} ({type(model).__name__}) attends in both directions: not a causal decoder"
        )
    return model


def measure(
    model: PreTrainedModel, tokens: Tokens, length: int, factor: float | None, options: EvalOptions
) -> LengthResult:
    """Perplexity, and passkey, multi-key and copy retrieval, of `model` as it is at one context length (`factor`: its
    RoPE scaling's); `seconds` is left to the caller."""
    tokenizer, stream = tokens.tokenizer, tokens.stream
    perplexity = copy = None
    if options.perplexity:
        windows = make_windows(stream, length, options.stride)
        result = score_windows(model, windows, options.batch_size, progress=options.progress)
        perplexity = PerplexityScore(
            ppl=result.ppl,
            nll=result.nll,
            tokens=result.tokens,
            windows=len(windows),
            # the tokens read with at least half a window of context: those past the training length at 2x+
            ppl_second_half=result.ppl_between(length // 2),
        )
    needles = {
        kind: _needle_score(kind, model, tokens, length, options)
        for kind in ("passkey", "multikey")
        if getattr(options, f"{kind}_trials")
    }
    if options.copy_trials:
        prefix = tokenizer("", add_special_tokens=True)["input_ids"]  # BOS, for tokenizers that add one
        try:
            windows = copy_windows(stream, length, options.copy_trials, options.copy_span, options.seed, prefix)
        except ValueError as error:  # a length too short for the span twice, or too little text
            copy = CopyScore(None, None, str(error))
        else:
            copied = copy_scores(model, windows, options.batch_size, progress=options.progress)
            copy = CopyScore(copied.accuracy, copied.nll)
    return LengthResult(perplexity, factor, needles.get("passkey"), needles.get("multikey"), copy)


def _needle_score(kind: str, model: PreTrainedModel, tokens: Tokens, length: int, options: EvalOptions) -> NeedleScore:
    """The passkey or multi-key test at `length` (`path_hf.evaluation.needles`): its summary and one record a trial;
    where the length is too short for a prompt, the error that says so."""
    try:
        if kind == "passkey":
            trials = passkey_trials(
                tokens.tokenizer,
                tokens.haystack,
                length,
                options.passkey_trials,
                options.passkey_depths,
                options.haystacks,
                options.templates(),
                options.seed,
            )
        else:
            trials = multikey_trials(
                tokens.tokenizer,
                tokens.haystack,
                length,
                options.multikey_trials,
                options.multikey_keys,
                options.multikey_questions,
                options.templates(),
                options.seed,
            )
    except ValueError as error:  # a length too short for a prompt
        return NeedleScore(None, error=str(error))
    results = score_trials(model, trials, greedy_check=options.greedy_check, progress=options.progress)
    return NeedleScore(NeedleSummary.of(results), tuple(trial_records(results, tokens.tokenizer)))


def evaluate_model(
    spec: ModelSpec,
    options: EvalOptions,
    tokens: Tokens,
    unscaled: ModelResult | None = None,
    on_length: LengthCallback | None = None,
) -> ModelResult:
    """Load one model and measure it on `tokens` (`prepare_tokens`) at every length; `on_length` is called with each
    length's result as it comes.

    `unscaled`: the result of the same checkpoint evaluated without RoPE scaling in this run, if any. At the lengths
    where this spec's scaling is the identity, its results are taken from there (marked `same_as_unscaled`) instead of
    being computed again."""
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(spec, options, device)
    if options.local_window is not None:  # a model with local layers (check_model)
        model.config.local_window = options.local_window  # the local layers read it at every forward
    # the embeddings themselves, for a config that does not state their number
    check_vocabulary(spec, options, tokens, model.get_input_embeddings().num_embeddings)
    train_length = model_train_length(model.config, options.train_length)
    record = ModelResult(
        spec=spec,
        tokenizer=options.tokenizer_source(spec)[1],
        model_type=model.config.model_type,
        train_length=train_length,
        tokens=len(tokens.stream),
        local_window=getattr(model.config, "local_window", None),
    )
    for length in options.lengths:
        started = time.perf_counter()
        factor = spec.factor_at(length, train_length)
        if (
            unscaled is not None
            and spec.rope_scaling
            and length in unscaled.lengths
            and scaling_is_identity(spec.rope_scaling, factor, length, train_length)
        ):
            result = replace(unscaled.lengths[length], rope_factor=factor, same_as_unscaled=True)
        else:
            try:
                scaled = rope_scaling(model, spec.rope_scaling, factor, train_length) if spec.rope_scaling else None
            except ValueError as error:
                raise EvaluationError(f"--model {spec.label}: {error}") from error
            with scaled or contextlib.nullcontext():
                result = measure(model, tokens, length, factor, options)
            result = replace(result, seconds=round(time.perf_counter() - started, 2))
        record.lengths[length] = result
        if on_length is not None:
            on_length(spec, length, result)
    del model
    gc.collect()
    return record


def evaluate(options: EvalOptions, on_length: LengthCallback | None = None) -> EvalReport:
    """Evaluate every model of `options`, one at a time, after checking all of them; returns the report (what
    `path-hf eval` prints as a table and writes with `write_report`). `on_length(spec, length, result)` is called
    with each result as it comes. Raises `EvaluationError`, on one line, for what it refuses."""
    options.check()
    texts, needle_texts = read_data(options)
    configs = {spec.label: check_model(spec, options) for spec in options.models}
    cache = TokenizerCache()
    tokens = {
        spec.label: prepare_tokens(spec, options, texts, configs[spec.label], cache, needle_texts)
        for spec in options.models
    }
    report = EvalReport(options)
    for spec in options.models:
        unscaled = next(
            (
                model
                for model in report.models.values()
                if model.spec.path == spec.path and model.spec.rope_scaling is None
            ),
            None,
        )
        report.models[spec.label] = evaluate_model(spec, options, tokens[spec.label], unscaled, on_length)
    return report


__all__ = [
    "LengthCallback",
    "evaluate",
    "evaluate_model",
    "load_model",
    "measure",
    "read_data",
    "scaling_is_identity",
]
