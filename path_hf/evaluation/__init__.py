# Copyright 2026 The path-hf authors. Apache-2.0.
"""Length-extrapolation evaluation of any causal language model: perplexity over fixed-length windows, passkey
retrieval, and RoPE scaling (YaRN, dynamic NTK) applied to a loaded model.

One implementation for the recipes' recovery tracking, `path-hf eval` and the demo:

- `texts`: local text files -> documents -> token ids (each document with its special tokens and EOS).
- `scoring`: perplexity over windows of `context_length` tokens (non-overlapping, or sliding by `stride` with each
  token scored once); the model scores every token of a window but the first from the tokens before it in the same
  window, also per position in the window (`PerplexityResult.ppl_between`).
- `needles`: the retrieval protocol of `path-hf eval`: passkey (a key hidden at five depths of a haystack of held-out
  text) and multi-key (several named keys, one asked for), with templates kept apart from training's; teacher-forced
  (every answer token the argmax, as greedy decoding writes it, checked on a sample with `generate`), found / trials
  with a 95% Wilson interval; trials that share the text before their needle share its forward pass.
- `passkey`: the older synthetic prompt (a key in repeated filler sentences), which `retrieval_heads` measures heads
  on.
- `copy_retrieval`: copy retrieval, denser than passkey: a span of real text at the start of a window and again at its
  end; top-1 accuracy and negative log-likelihood of the repeat's tokens (but its first), from `length - span`
  tokens back, in one forward pass with logits formed only at those positions.
- `rope`: `rope_scaling(model, "yarn", factor=4)` swaps the model's rotary embedding for one built with transformers'
  own `rope_parameters` of that type, for the duration of a `with` block.
- `plots`: perplexity against context length, recovery against training tokens.
- `attention_mass`: where attention goes at long range, per layer and head: the probability on the first token (the
  attention sink) and on keys more than F positions back, at the last positions of a long window; exact, from decode
  steps (each layer's one row of probabilities), for PaTH and RoPE layers alike.
- `retrieval_heads`: each head's attention on a passkey's needle when the model writes the key (the retrieval heads),
  and the layers ranked by their strongest head (`path-hf convert --retrieval-layers` keeps those as PaTH layers).

And an evaluation of several models at several lengths on the same text, what `path-hf eval` runs over these metrics:

- `options`: `EvalOptions` (what to evaluate, one field a flag of `path-hf eval`) and `ModelSpec` (a model:
  `[LABEL=]PATH[@ROPE[:FACTOR]]`); `EvalOptions.check` refuses what cannot run before any model is loaded.
- `checks`: what is refused before any model is evaluated (`check_model`: its config, weights and tokenizer files;
  `prepare_tokens`: a tokenizer that does not fit the text or does not belong to the model), and the `Tokens` each
  model is evaluated on.
- `run`: `evaluate(options)` checks every model, then loads one at a time and measures it at each length.
- `results`: the typed results (`EvalReport` of a `ModelResult` per model, of a `LengthResult` per length) and their
  JSON form (`to_json`), the `--output` of `path-hf eval`.
- `report`: the Markdown table (`format_table`, of a report or its JSON) and the JSON and plot files (`write_report`).

```python
from path_hf.evaluation import passkey_accuracy, perplexity, read_texts, tokenize_stream

stream = tokenize_stream(read_texts(["eval.jsonl"]), tokenizer, max_tokens=65536)
result = perplexity(model, stream, context_length=2048)  # one long stream, or a list of documents
print(result.ppl, result.tokens, passkey_accuracy(model, tokenizer, context_length=2048))
```
"""

from .attention_mass import attention_mass, decode_attention_rows
from .checks import Tokens, check_model, prepare_tokens
from .copy_retrieval import COPY_SPAN, CopyResult, copy_accuracy, copy_scores, copy_windows, label_scores
from .needles import (
    DEPTHS,
    NeedleTemplate,
    NeedleTemplates,
    NeedleTrial,
    TrialResult,
    multikey_trials,
    passkey_trials,
    score_trials,
    summarize_trials,
    trial_records,
    wilson_interval,
)
from .options import EvalOptions, ModelSpec, model_train_length, parse_depths, parse_lengths
from .passkey import (
    PASSKEY_FILLER,
    PASSKEY_INTRO,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
    accuracy_by_depth,
    answer_accuracy,
    answer_scores,
    nll_by_depth,
    passkey_accuracy,
    passkey_windows,
)
from .plots import plot_lengths, plot_recovery
from .report import format_table, write_report
from .results import (
    CopyScore,
    DepthCount,
    EvalReport,
    LengthResult,
    ModelResult,
    NeedleScore,
    NeedleSummary,
    PerplexityScore,
    common_train_length,
)
from .retrieval_heads import (
    needle_mass,
    needle_span,
    rank_retrieval_heads,
    rank_retrieval_layers,
    retrieval_heads,
)
from .rope import ROPE_SCALING_TYPES, rope_parameters_for, rope_scaling
from .run import evaluate, evaluate_model, scaling_is_identity
from .scoring import (
    IGNORE_INDEX,
    PerplexityResult,
    Window,
    attends_causally,
    make_windows,
    perplexity,
    score_windows,
    token_nll,
)
from .texts import (
    COMPRESSED_SUFFIXES,
    data_files,
    load_texts,
    read_texts,
    text_documents,
    tokenize_documents,
    tokenize_stream,
)

__all__ = [
    "CopyScore",
    "DepthCount",
    "EvalOptions",
    "EvalReport",
    "LengthResult",
    "ModelResult",
    "ModelSpec",
    "NeedleScore",
    "NeedleSummary",
    "PerplexityScore",
    "Tokens",
    "check_model",
    "common_train_length",
    "evaluate",
    "evaluate_model",
    "format_table",
    "model_train_length",
    "parse_depths",
    "parse_lengths",
    "prepare_tokens",
    "scaling_is_identity",
    "write_report",
    "COMPRESSED_SUFFIXES",
    "DEPTHS",
    "NeedleTemplate",
    "NeedleTemplates",
    "NeedleTrial",
    "TrialResult",
    "multikey_trials",
    "passkey_trials",
    "score_trials",
    "summarize_trials",
    "trial_records",
    "wilson_interval",
    "COPY_SPAN",
    "CopyResult",
    "IGNORE_INDEX",
    "PASSKEY_FILLER",
    "PASSKEY_INTRO",
    "PASSKEY_NEEDLE",
    "PASSKEY_QUESTION",
    "PerplexityResult",
    "ROPE_SCALING_TYPES",
    "Window",
    "accuracy_by_depth",
    "answer_accuracy",
    "answer_scores",
    "attends_causally",
    "attention_mass",
    "copy_accuracy",
    "copy_scores",
    "copy_windows",
    "data_files",
    "decode_attention_rows",
    "label_scores",
    "load_texts",
    "make_windows",
    "needle_mass",
    "needle_span",
    "nll_by_depth",
    "passkey_accuracy",
    "passkey_windows",
    "perplexity",
    "plot_lengths",
    "plot_recovery",
    "rank_retrieval_heads",
    "rank_retrieval_layers",
    "read_texts",
    "retrieval_heads",
    "rope_parameters_for",
    "rope_scaling",
    "score_windows",
    "text_documents",
    "token_nll",
    "tokenize_documents",
    "tokenize_stream",
]
