# Copyright 2026 The path-hf authors. Apache-2.0.
"""`path-hf eval`: perplexity, passkey and copy retrieval at several context lengths, for several causal LMs at once.

```
path-hf eval --model source=meta-llama/Llama-3.2-1B --model yarn=meta-llama/Llama-3.2-1B@yarn \\
    --model path=./Llama-3.2-1B-PaTH --data held_out.jsonl --lengths 2048,4096,8192,16384 \\
    --output eval.json --plot eval.png
```

A model is `[LABEL=]PATH[@ROPE[:FACTOR]]`: any checkpoint `AutoModelForCausalLM.from_pretrained` loads, or a
llama.cpp GGUF file (read by transformers and dequantised whole to `--dtype`, `path_hf.loading`), evaluated as it
is or, with `@yarn`, `@dynamic` or `@linear`, with transformers' RoPE scaling of that type swapped in (see
`path_hf.evaluation.rope_scaling`). Without a FACTOR, YaRN and linear use `length / train length` at each length (no
scaling at or below the training length) and dynamic NTK uses 1 (it rescales by the sequence length itself).

PATH is taken whole when it exists ('@' and all); ROPE may be in any case. `--tokenizer` gives every model a tokenizer
(for checkpoints saved without one); `--data` takes files or directories of them.

Refused before scoring, on one line: a model that is not a causal decoder (an encoder-decoder config, or logits that
change with later tokens: `path_hf.evaluation.attends_causally`), a checkpoint directory without tokenizer files, a
tokenizer without a vocabulary, one that writes more than `MAX_UNKNOWN_SHARE` unknown tokens on the data, and one that
does not belong to the model (`prepare_tokens`). Before any model is loaded: a number out of its range, data that
cannot be read, and an `--output` or `--plot` that could not be written at the end.

The metrics are `path_hf.evaluation`'s, the same functions the recipes track recovery with.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..arguments import DTYPES
from ..arguments import flag as option_flag
from ..atomic import atomic_file
from ..configuration_path_llama import source_context
from ..errors import EvaluationError, SourceError, first_line
from ..evaluation import COPY_SPAN, ROPE_SCALING_TYPES
from ..evaluation.needles import DEPTHS, HAYSTACKS, MULTIKEY_KEYS, MULTIKEY_QUESTIONS
from ..loading import TOKENIZER_FILES


@dataclass(frozen=True)
class ModelSpec:
    """One `--model`: where it is, what to call it, and the RoPE scaling to evaluate it with."""

    label: str
    path: str
    rope_scaling: str | None = None
    rope_factor: float | None = None

    @classmethod
    def parse(cls, spec: str) -> ModelSpec:
        """`[LABEL=]PATH[@ROPE[:FACTOR]]`; the label defaults to the directory name (and `+ROPE`). ROPE is one of
        `ROPE_SCALING_TYPES` in any case; an '@' in the last part of PATH starts it, unless PATH with it exists."""
        label, path = "", spec
        if "=" in spec.split("/")[0] and not Path(spec).expanduser().exists():
            label, _, path = spec.partition("=")
        rope, factor = None, None
        if "@" in path.rsplit("/", 1)[-1] and not Path(path).expanduser().exists():
            missing = path
            path, _, suffix = path.rpartition("@")
            rope, colon, factor_text = suffix.partition(":")
            rope = rope.lower()
            if rope not in ROPE_SCALING_TYPES:
                raise ValueError(
                    f"--model {spec!r}: unknown RoPE scaling {suffix.partition(':')[0]!r} (choices: "
                    f"{', '.join(ROPE_SCALING_TYPES)}, then optionally :FACTOR); no path {missing!r} exists either"
                )
            if colon:
                try:
                    factor = float(factor_text)
                except ValueError:
                    factor = math.nan
                if not (math.isfinite(factor) and factor >= 1):
                    raise ValueError(
                        f"--model {spec!r}: the RoPE scaling factor must be a number of at least 1, got {factor_text!r}"
                    )
        if not path:
            raise ValueError(f"--model {spec!r} names no checkpoint: use [LABEL=]PATH[@yarn|@dynamic|@linear[:FACTOR]]")
        label = label or Path(path.rstrip("/")).name + (f"+{rope}" if rope else "")
        return cls(label, path, rope, factor)


def parse_lengths(spec: str) -> tuple[int, ...]:
    """`"256,512,1024"` -> `(256, 512, 1024)`: distinct context lengths of at least 2 tokens, sorted."""
    try:
        lengths = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--lengths {spec!r} is not a comma-separated list of token counts such as 256,512") from None
    if not lengths or lengths[0] < 2:
        raise ValueError(f"--lengths {spec!r}: give one or more context lengths of at least 2 tokens")
    return tuple(lengths)


def parse_depths(spec: str) -> tuple[float, ...]:
    """`"0.1,0.5,0.9"` -> `(0.1, 0.5, 0.9)`: distinct relative depths of the passkey needle in [0, 1], sorted."""
    try:
        depths = sorted({float(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(
            f"--passkey-depths {spec!r} is not a comma-separated list of numbers such as 0.1,0.5,0.9"
        ) from None
    if not depths:
        raise ValueError(f"--passkey-depths {spec!r}: give one or more depths between 0 and 1, such as 0.1,0.5,0.9")
    _check_depths(depths)
    return tuple(depths)


def _check_depths(depths) -> None:
    for depth in depths:
        if not 0.0 <= depth <= 1.0:  # nan too
            raise ValueError(
                f"--passkey-depths: each depth must be between 0 (the key first) and 1 (right before the "
                f"question), got {depth:g}"
            )


@dataclass(kw_only=True)
class EvalOptions:
    """Everything `path-hf eval` was asked to do: one field per flag (`path_hf.arguments`)."""

    models: list[ModelSpec] = field(
        metadata={
            "flag": "--model",
            "parse": ModelSpec.parse,
            "repeat": True,
            "metavar": "[LABEL=]PATH[@ROPE[:F]]",
            "help": "a checkpoint (directory, hub id or llama.cpp .gguf file); repeat to compare models. @yarn, "
            "@dynamic or @linear evaluate it with that RoPE scaling (factor F; default: length / train length for "
            "yarn and linear, 1 for dynamic)",
        }
    )
    data: list[str] = field(
        metadata={
            "nargs": "+",
            "metavar": "FILE",
            "help": ".txt, .jsonl or .parquet files (may be compressed), or directories of them",
        }
    )
    lengths: tuple[int, ...] = field(
        metadata={"parse": parse_lengths, "metavar": "N,N,...", "help": "context lengths in tokens"}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "metavar": "PATH_OR_ID",
            "help": "the tokenizer of every --model, for checkpoints saved without one (default: each model's own)",
        },
    )
    text_field: str = field(default="text", metadata={"help": "column of JSON/parquet records (default: %(default)s)"})
    max_tokens: int = field(
        default=65536,
        metadata={
            "metavar": "N",
            "help": "evaluate on the first N tokens of the data, the same tokens at every length (default: "
            "%(default)s)",
        },
    )
    stride: int | None = field(
        default=None,
        metadata={
            "metavar": "S",
            "help": "sliding windows that move by S tokens, each token scored once with up to length-1 tokens of "
            "context (default: non-overlapping windows)",
        },
    )
    batch_size: int = field(default=8, metadata={"help": "windows per forward pass (default: %(default)s)"})
    perplexity: bool = field(
        default=True,
        metadata={"negate": "--no-perplexity", "help": "skip the perplexity windows (retrieval only)"},
    )
    passkey_trials: int = field(
        default=20,
        metadata={
            "metavar": "N",
            "help": "passkey prompts per length, a key hidden in the haystack text (--needle-data) and asked for at "
            "the end, spread over --passkey-depths; 0 skips the test (default: %(default)s)",
        },
    )
    passkey_depths: tuple[float, ...] = field(
        default=DEPTHS,
        metadata={
            "parse": parse_depths,
            "metavar": "D,D,...",
            "help": "the share of the haystack before the passkey, one depth a trial in turn (default: "
            + ",".join(f"{depth:g}" for depth in DEPTHS)
            + ")",
        },
    )
    haystacks: int = field(
        default=HAYSTACKS,
        metadata={
            "metavar": "H",
            "help": "stretches of text a length's passkey trials are hidden in; the trials of one haystack and depth "
            "share the forward pass over the text before their key (default: %(default)s)",
        },
    )
    multikey_trials: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": "multi-key prompts per length: --multikey-keys keys with distinct names in one haystack, one of "
            "them asked for; 0 skips the test (default: %(default)s)",
        },
    )
    multikey_keys: int = field(
        default=MULTIKEY_KEYS, metadata={"metavar": "K", "help": "keys in a multi-key haystack (default: %(default)s)"}
    )
    multikey_questions: int = field(
        default=MULTIKEY_QUESTIONS,
        metadata={
            "metavar": "Q",
            "help": "questions asked of each multi-key haystack, each a trial sharing its forward pass (default: "
            "%(default)s)",
        },
    )
    needle_data: list[str] | None = field(
        default=None,
        metadata={
            "nargs": "+",
            "metavar": "FILE",
            "help": "the haystack text of the passkey and multi-key prompts (default: --data); held-out text",
        },
    )
    needle_templates: str | None = field(
        default=None,
        metadata={
            "metavar": "FILE.json",
            "help": "needle and question templates of the passkey and multi-key prompts (default: path_hf's "
            "evaluation set, path_hf/evaluation/needle_templates.json)",
        },
    )
    greedy_check: int = field(
        default=1,
        metadata={
            "metavar": "N",
            "help": "the first N passkey and multi-key trials of each length are also decoded greedily with generate, "
            "from scratch: a check of the teacher-forced verdict (default: %(default)s)",
        },
    )
    local_window: int | None = field(
        default=None,
        metadata={
            "metavar": "W",
            "help": "evaluate models with local layers (a hybrid's local_window) with this window instead of the "
            "one they were converted with",
        },
    )
    copy_trials: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": "copy-retrieval windows per length, each a span of --data at its start and again at its end, "
            "scored on the repeat (top-1 accuracy and NLL); one forward pass of the length per window; 0 skips the "
            "test (default: %(default)s)",
        },
    )
    copy_span: int = field(
        default=COPY_SPAN,
        metadata={
            "metavar": "S",
            "help": "tokens of the copied span; its last S-1 tokens are scored, copied from length-S tokens back "
            "(default: %(default)s)",
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of the passkey prompts and of the copy spans (default: %(default)s)"}
    )
    train_length: int | None = field(
        default=None,
        metadata={
            "metavar": "N",
            "help": "the models' training context, for RoPE scaling, the plot and the table (default: from each "
            "config)",
        },
    )
    dtype: str = field(default="float32", metadata={"choices": DTYPES, "help": "dtype the models are loaded in"})
    device: str | None = field(
        default=None, metadata={"help": "cpu, cuda, cuda:1, ... (default: cuda when there is one)"}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "allow code shipped with a checkpoint"})
    output: str | None = field(default=None, metadata={"metavar": "FILE.json", "help": "write every number as JSON"})
    plot: str | None = field(
        default=None,
        metadata={"metavar": "FILE.png", "help": "plot perplexity against context length, one line a model"},
    )
    force: bool = field(default=False, metadata={"help": "replace --output / --plot if they exist"})
    progress: bool = field(default=True, metadata={"negate": "--no-progress", "help": "no progress bars"})
    debug: bool = field(default=False, repr=False, metadata={"help": "print the traceback of an error"})

    def check(self) -> None:
        """Refuse what cannot run before any model is loaded: labels, every number out of its range, and outputs
        that could not be written at the end."""
        labels = [spec.label for spec in self.models]
        if duplicated := sorted({label for label in labels if labels.count(label) > 1}):
            raise EvaluationError(f"two --model share the label {duplicated[0]!r}: name them with LABEL=PATH")
        if not self.lengths or min(self.lengths) < 2:
            raise EvaluationError(f"--lengths {self.lengths}: give one or more context lengths of at least 2 tokens")
        for option in fields(self):
            minimum, meaning = _MINIMUMS.get(option.name, (None, ""))
            value = getattr(self, option.name)
            if minimum is not None and value is not None and value < minimum:
                raise EvaluationError(f"{option_flag(option)} must be at least {minimum} ({meaning}), got {value}")
        if not self.passkey_depths:
            raise EvaluationError("--passkey-depths is empty: give one or more depths between 0 and 1")
        try:
            _check_depths(self.passkey_depths)
        except ValueError as error:
            raise EvaluationError(str(error)) from None
        if not (self.perplexity or self.passkey_trials or self.multikey_trials or self.copy_trials):
            raise EvaluationError(
                "--no-perplexity with no retrieval test measures nothing: give --passkey-trials, --multikey-trials or "
                "--copy-trials"
            )
        if self.needle_templates is not None:
            try:
                self.templates()
            except ValueError as error:
                raise EvaluationError(f"--needle-templates {error}") from None
            if self.multikey_trials and self.multikey_keys > len(self.templates().names):
                raise EvaluationError(
                    f"--multikey-keys {self.multikey_keys} is more than the {len(self.templates().names)} names of "
                    f"--needle-templates {self.needle_templates}: give fewer keys or more names"
                )
        if self.copy_trials and 2 * self.copy_span + 1 > self.lengths[-1]:
            raise EvaluationError(
                f"--copy-span {self.copy_span} does not fit the longest length {self.lengths[-1]}: a copy window holds "
                f"the span twice and a BOS token ({2 * self.copy_span + 1} tokens): give a --copy-span of at most "
                f"{(self.lengths[-1] - 1) // 2}, or longer --lengths"
            )
        if self.stride is not None and self.stride > self.lengths[0]:
            raise EvaluationError(
                f"--stride {self.stride} must be between 1 and the shortest length ({self.lengths[0]}): each "
                "window slides by that many tokens"
            )
        if self.max_tokens < self.lengths[-1]:
            raise EvaluationError(
                f"--max-tokens {self.max_tokens} is below the longest length {self.lengths[-1]}: no window would fit"
            )
        self._check_outputs()

    def templates(self):
        """The needle templates of the passkey and multi-key prompts (`--needle-templates`, or path_hf's own)."""
        from ..evaluation import NeedleTemplates

        if self.needle_templates is None:
            return NeedleTemplates.default()
        return NeedleTemplates.from_file(self.needle_templates)

    def _check_outputs(self) -> None:
        """`--output` and `--plot` must be files that can be written where they are named (a directory that exists
        and takes new files), not directories, not each other, not existing files without `--force`; the plot in a
        format matplotlib writes."""
        outputs = [(flag, path) for flag, path in (("--output", self.output), ("--plot", self.plot)) if path]
        if len(outputs) == 2 and Path(self.output).resolve() == Path(self.plot).resolve():
            raise EvaluationError(f"--output and --plot are the same file, {self.output}: give two paths")
        for flag, path in outputs:
            target = Path(path)
            if target.is_dir():
                raise EvaluationError(f"{flag} {path} is a directory: give a file path")
            if target.exists() and not self.force:
                raise EvaluationError(f"{flag} {path} exists: pass --force to replace it, or choose another path")
            directory = target.resolve().parent
            if not directory.is_dir():
                raise EvaluationError(f"{flag} {path}: its directory does not exist: create it or choose another path")
            try:  # what atomic_file does at the end: a new file in that directory
                handle, probe = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.")
            except OSError as error:
                raise EvaluationError(
                    f"{flag} {path}: cannot write in {directory} ({error.strerror}): choose another path"
                ) from error
            os.close(handle)
            os.unlink(probe)
        if self.plot:
            _check_plot_format(self.plot)


# The smallest value of each numeric option (those with a range beyond it are checked in `EvalOptions.check`).
_MINIMUMS = {
    "max_tokens": (1, "tokens of --data to evaluate on"),
    "stride": (1, "tokens a sliding window moves by"),
    "batch_size": (1, "windows per forward pass"),
    "passkey_trials": (0, "0 skips the passkey test"),
    "haystacks": (1, "stretches of text the passkey trials are hidden in"),
    "multikey_trials": (0, "0 skips the multi-key test"),
    "multikey_keys": (2, "keys in a multi-key haystack, one asked for"),
    "multikey_questions": (1, "questions asked of each multi-key haystack"),
    "greedy_check": (0, "0 decodes no trial with generate"),
    "local_window": (1, "tokens a local layer sees"),
    "copy_trials": (0, "0 skips the copy test"),
    "copy_span": (2, "tokens of the copied span, whose first is not scored"),
    "seed": (0, "the seed of the passkey prompts"),
    "train_length": (1, "the models' training context, in tokens"),
}


def _check_plot_format(plot: str) -> None:
    """Refuse a `--plot` whose suffix is not a format matplotlib writes here (pgf needs its TeX program)."""
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(plot).suffix.lower().lstrip(".")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if suffix not in formats:
        problem = f"matplotlib cannot write .{suffix} files" if suffix else "no suffix names the format"
        raise EvaluationError(
            f"--plot {plot}: {problem}: end the name with one of {', '.join('.' + name for name in formats)}"
        )
    texsystem = matplotlib.rcParams["pgf.texsystem"]
    if suffix == "pgf" and shutil.which(texsystem) is None:
        raise EvaluationError(f"--plot {plot}: matplotlib writes .pgf with {texsystem}, which is not installed")


def _train_length(config, given: int | None) -> int | None:
    if given is not None:
        return given
    return source_context(config)


def common_train_length(records: Iterable[dict]) -> int | None:
    """The report's `train_length`: the one training context of all `records` (each a model's, or a whole report's,
    with a `"train_length"`), or None when they differ."""
    train_lengths = {record["train_length"] for record in records}
    return train_lengths.pop() if len(train_lengths) == 1 else None


def scaling_is_identity(rope_scaling: str, factor: float, length: int, train_length: int) -> bool:
    """Whether transformers' RoPE scaling `rope_scaling` with `factor` computes the unscaled RoPE at `length`: YaRN and
    linear with factor 1, and dynamic NTK up to the training length (it rescales only longer sequences)."""
    if rope_scaling == "dynamic":
        return length <= train_length
    return factor == 1.0


# A tokenizer that fits the text writes few unknown tokens; more than this share of the stream is refused.
MAX_UNKNOWN_SHARE = 0.05


@contextlib.contextmanager
def _loading(flag: str, source: str):
    """Turns the errors of loading `source` into one line naming `flag` and it."""
    try:
        yield
    except (OSError, ValueError) as error:
        raise EvaluationError(f"{flag} {source}: cannot load it ({first_line(error)})") from error
    except SourceError as error:  # a GGUF that cannot be read, a path that does not exist
        raise EvaluationError(f"{flag} {source}: {error}") from error


def _tokenizer_source(spec: ModelSpec, options: EvalOptions) -> tuple[str, str]:
    """The flag and the source of the tokenizer `spec` is evaluated with."""
    return ("--tokenizer", options.tokenizer) if options.tokenizer else ("--model", spec.path)


def _has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES) or any(directory.glob("*.tiktoken"))


def check_model(spec: ModelSpec, options: EvalOptions):
    """Refuse, before any weights are loaded, a `--model` whose config is an encoder-decoder, a RoPE scaling without
    a training length or of a model without RoPE, and a local checkpoint directory without tokenizer files (a GGUF
    carries its own tokenizer). Returns the model's config."""
    from ..loading import find_gguf, load_config

    with _loading("--model", spec.path):
        config = load_config(spec.path, trust_remote_code=options.trust_remote_code)
    if getattr(config, "is_encoder_decoder", False):
        raise EvaluationError(
            f"--model {spec.path} is an encoder-decoder model ({type(config).__name__}): not a causal decoder"
        )
    if spec.rope_scaling and not _train_length(config, options.train_length):
        raise EvaluationError(f"--model {spec.label}: RoPE scaling needs the training length: pass --train-length")
    if spec.rope_scaling:  # a model without RoPE has nothing to scale: refused now, not after loading it
        from ..evaluation import rope_parameters_for

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
    flag, source = _tokenizer_source(spec, options)
    directory = Path(source).expanduser()
    if not directory.is_dir():
        return config  # a hub id or a file (a GGUF carries its own tokenizer)
    with _loading(flag, source):
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
    import torch
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


# The haystack text read for the needle prompts: this many times the longest length (their stretches are drawn from it).
HAYSTACK_LENGTHS = 8


def _needles_wanted(options: EvalOptions) -> bool:
    return bool(options.passkey_trials or options.multikey_trials)


def _tokenize(
    flag: str, source: str, label: str, options: EvalOptions, texts: list[str], needle_texts: list[str] | None = None
) -> Tokens:
    """The tokenizer of `source` and the data in it; refuses a tokenizer without a vocabulary, one that does not fit
    the text, and too little text for the longest length."""
    from ..evaluation import tokenize_stream
    from ..loading import load_tokenizer

    with _loading(flag, source):
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
    if _needles_wanted(options):
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


def _vocabulary(config) -> int | None:
    """The number of token embeddings of a model, from its config."""
    return getattr(config.get_text_config(), "vocab_size", None)


def _check_vocabulary(spec: ModelSpec, options: EvalOptions, tokens: Tokens, vocabulary: int | None) -> None:
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
    from ..loading import GGUFFile, find_gguf

    try:
        gguf = find_gguf(spec.path)
        if gguf is not None:
            return spec.path if GGUFFile.read(gguf).has_tokenizer else None
    except SourceError:
        return None
    directory = Path(spec.path).expanduser()
    return spec.path if directory.is_dir() and _has_tokenizer_files(directory) else None


# `--tokenizer` and a model's own tokenizer must write the same ids for the first this many characters of --data.
PROBE_CHARACTERS = 4000


def _check_own_tokenizer(spec: ModelSpec, options: EvalOptions, tokens: Tokens, texts: list[str]) -> None:
    """Refuse a `--tokenizer` that writes other ids than the model's own tokenizer on the start of the data. Their
    vocabulary sizes may differ (one padded, one with extra special tokens) as long as the ids agree; a model whose
    own tokenizer does not load (a reason to pass another) is not compared."""
    from ..evaluation import tokenize_stream
    from ..loading import load_tokenizer

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
    spec: ModelSpec, options: EvalOptions, texts: list[str], config, cache: dict, needle_texts: list[str] | None = None
) -> Tokens:
    """The tokens `spec` is evaluated on (`config`: its model's), checked before any model is loaded: the tokenizer
    must fit the text (`_tokenize`) and belong to the model: every id it writes has an embedding, and a `--tokenizer`
    writes the ids of the model's own tokenizer, if the model has one. `cache` keeps what models of the same run
    share: a tokenizer and its tokens, a comparison of the same model's tokenizers."""
    flag, source = _tokenizer_source(spec, options)
    if ("tokens", source) not in cache:
        cache["tokens", source] = _tokenize(flag, source, spec.label, options, texts, needle_texts)
    tokens = cache["tokens", source]
    _check_vocabulary(spec, options, tokens, _vocabulary(config))
    if options.tokenizer and ("compared", spec.path) not in cache:
        _check_own_tokenizer(spec, options, tokens, texts)
        cache["compared", spec.path] = True
    return tokens


def _model(spec: ModelSpec, options: EvalOptions, device: str):
    """The causal LM of `spec` on `device`, refused if it attends in both directions."""
    import torch

    import path_hf  # noqa: F401  (registers PaTHLlama with the Auto classes)

    from ..evaluation import attends_causally
    from ..loading import load_causal_lm

    with _loading("--model", spec.path):
        model = load_causal_lm(
            spec.path, getattr(torch, options.dtype), trust_remote_code=options.trust_remote_code
        ).to(device)
    if not attends_causally(model):
        raise EvaluationError(
            f"--model {spec.path} ({type(model).__name__}) attends in both directions: not a causal decoder"
        )
    return model


def _measure(model, tokens: Tokens, length: int, factor: float | None, options: EvalOptions) -> dict:
    """Perplexity, and passkey, multi-key and copy retrieval, of `model` as it is at one context length (`factor`: its
    RoPE scaling's)."""
    from ..evaluation import copy_scores, copy_windows, make_windows, score_windows

    tokenizer, stream = tokens.tokenizer, tokens.stream
    entry: dict[str, Any] = {}
    if options.perplexity:
        windows = make_windows(stream, length, options.stride)
        result = score_windows(model, windows, options.batch_size, progress=options.progress)
        entry |= {
            "ppl": result.ppl,
            "nll": result.nll,
            "tokens": result.tokens,
            "windows": len(windows),
            # the tokens read with at least half a window of context: those past the training length at 2x+
            "ppl_second_half": result.ppl_between(length // 2),
        }
    if factor is not None:
        entry["rope_factor"] = factor
    for kind in ("passkey", "multikey"):
        if getattr(options, f"{kind}_trials"):
            entry |= _needle_entry(kind, model, tokens, length, options)
    if options.copy_trials:
        prefix = tokenizer("", add_special_tokens=True)["input_ids"]  # BOS, for tokenizers that add one
        try:
            windows = copy_windows(stream, length, options.copy_trials, options.copy_span, options.seed, prefix)
        except ValueError as error:  # a length too short for the span twice, or too little text
            entry["copy"], entry["copy_nll"], entry["copy_error"] = None, None, str(error)
        else:
            copied = copy_scores(model, windows, options.batch_size, progress=options.progress)
            entry["copy"], entry["copy_nll"] = copied.accuracy, copied.nll
    return entry


def _needle_entry(kind: str, model, tokens: Tokens, length: int, options: EvalOptions) -> dict:
    """`{kind: summary, f"{kind}_trials": one record a trial}` of the passkey or multi-key test at `length`
    (`path_hf.evaluation.needles`); `{kind: None, f"{kind}_error": why}` where the length is too short for a prompt."""
    from ..evaluation import multikey_trials, passkey_trials, score_trials, summarize_trials, trial_records

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
        return {kind: None, f"{kind}_error": str(error)}
    results = score_trials(model, trials, greedy_check=options.greedy_check, progress=options.progress)
    return {kind: summarize_trials(results), f"{kind}_trials": trial_records(results, tokens.tokenizer)}


def evaluate_model(
    spec: ModelSpec, options: EvalOptions, tokens: Tokens, unscaled: dict[str, dict] | None = None
) -> dict:
    """Load one model and measure it on `tokens` (`prepare_tokens`) at every length; returns its JSON record.

    `unscaled`: the record of the same checkpoint evaluated without RoPE scaling in this run, if any. At the lengths
    where this spec's scaling is the identity, its entries are taken from there (marked `same_as_unscaled`) instead of
    being computed again."""
    import torch

    from ..evaluation import rope_scaling

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    stream = tokens.stream
    model = _model(spec, options, device)
    if options.local_window is not None:  # a model with local layers (check_model)
        model.config.local_window = options.local_window  # the local layers read it at every forward
    # the embeddings themselves, for a config that does not state their number
    _check_vocabulary(spec, options, tokens, model.get_input_embeddings().num_embeddings)
    train_length = _train_length(model.config, options.train_length)
    record = {
        "path": spec.path,
        "tokenizer": _tokenizer_source(spec, options)[1],
        "model_type": model.config.model_type,
        "rope_scaling": spec.rope_scaling,
        "train_length": train_length,
        "tokens": len(stream),
        "local_window": getattr(model.config, "local_window", None),
        "lengths": {},
    }
    for length in options.lengths:
        started = time.perf_counter()
        factor = spec.rope_factor
        if spec.rope_scaling and factor is None:
            factor = 1.0 if spec.rope_scaling == "dynamic" else max(1.0, length / train_length)
        if (
            unscaled is not None
            and spec.rope_scaling
            and str(length) in unscaled["lengths"]
            and scaling_is_identity(spec.rope_scaling, factor, length, train_length)
        ):
            entry = {**unscaled["lengths"][str(length)], "rope_factor": factor, "same_as_unscaled": True}
            record["lengths"][str(length)] = entry
            print(f"{spec.label:>24}  {length:>6}  {_line(entry)}  (the unscaled model's)", file=sys.stderr)
            continue
        try:
            scaled = rope_scaling(model, spec.rope_scaling, factor, train_length) if spec.rope_scaling else None
        except ValueError as error:
            raise EvaluationError(f"--model {spec.label}: {error}") from error
        with scaled or contextlib.nullcontext():
            entry = _measure(model, tokens, length, factor, options)
        entry["seconds"] = round(time.perf_counter() - started, 2)
        record["lengths"][str(length)] = entry
        print(f"{spec.label:>24}  {length:>6}  {_line(entry)}  ({entry['seconds']:.1f} s)", file=sys.stderr)
    del model
    gc.collect()
    return record


def _found(summary: dict) -> str:
    """`"37/40"` of a passkey or multi-key summary."""
    return f"{summary['found']}/{summary['trials']}"


def _line(entry: dict) -> str:
    """One length's numbers on one line (the progress printout)."""
    parts = [f"ppl {entry['ppl']:9.3f}"] if "ppl" in entry else []
    for kind in ("passkey", "multikey"):
        if entry.get(kind) is not None:
            low, high = entry[kind]["wilson95"]
            parts.append(f"{kind} {_found(entry[kind])} [{low:.0%}, {high:.0%}]")
    if entry.get("copy") is not None:
        parts.append(f"copy {entry['copy']:6.1%} (nll {entry['copy_nll']:.3f})")
    return "  ".join(parts)


def format_table(report: dict) -> str:
    """Perplexity (and passkey, multi-key and copy retrieval) per model and length, as a Markdown table."""
    lengths = report["lengths"]
    train = report.get("train_length")
    header = [f"{n} ({n / train:g}x)" if train else str(n) for n in lengths]
    rows = ["| model | " + " | ".join(header) + " |", "|---|" + "---:|" * len(lengths)]
    for label, record in report["models"].items():
        cells = []
        for n in lengths:
            entry = record["lengths"][str(n)]
            parts = [f"{entry['ppl']:.2f}"] if "ppl" in entry else []
            parts += [_found(entry[kind]) for kind in ("passkey", "multikey") if entry.get(kind) is not None]
            if entry.get("copy") is not None:
                parts.append(f"copy {entry['copy']:.1%}")
            cells.append(" / ".join(parts) or "-")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    names = ["perplexity"] if report.get("perplexity", True) else []
    names += [f"{kind} found/trials" for kind in ("passkey", "multikey") if report.get(f"{kind}_trials")]
    if report.get("copy_trials"):
        names.append(f"copy accuracy ({report['copy_span']}-token span)")
    return "\n".join(rows) + f"\n({' / '.join(names)}; {report['windowing']})"


def _finite_ppl(entry: dict) -> bool:
    return math.isfinite(entry.get("ppl", math.nan))


def run_eval(options: EvalOptions) -> dict:
    """Evaluate every model of `options`; print the table, write the JSON and the plot; returns the report."""
    from ..evaluation import plot_lengths, read_texts

    options.check()
    try:
        texts = read_texts(options.data, options.text_field)
    except (OSError, ValueError) as error:
        raise EvaluationError(f"--data: {error}") from error
    if not texts:
        raise EvaluationError(f"--data {' '.join(options.data)}: no non-empty documents")
    needle_texts = None
    if options.needle_data and _needles_wanted(options):
        try:
            needle_texts = read_texts(options.needle_data, options.text_field)
        except (OSError, ValueError) as error:
            raise EvaluationError(f"--needle-data: {error}") from error
        if not needle_texts:
            raise EvaluationError(f"--needle-data {' '.join(options.needle_data)}: no non-empty documents")
    configs = {spec.label: check_model(spec, options) for spec in options.models}
    cache: dict = {}
    tokens = {
        spec.label: prepare_tokens(spec, options, texts, configs[spec.label], cache, needle_texts)
        for spec in options.models
    }
    report = {
        "data": options.data,
        "max_tokens": options.max_tokens,
        "lengths": list(options.lengths),
        "windowing": f"sliding windows, stride {options.stride}" if options.stride else "non-overlapping windows",
        "stride": options.stride,
        "perplexity": options.perplexity,
        "passkey_trials": options.passkey_trials,
        "passkey_depths": list(options.passkey_depths),
        "haystacks": options.haystacks,
        "multikey_trials": options.multikey_trials,
        "multikey_keys": options.multikey_keys,
        "multikey_questions": options.multikey_questions,
        "needle_data": options.needle_data or options.data,
        "needle_templates": options.needle_templates,
        "greedy_check": options.greedy_check,
        "local_window": options.local_window,
        "copy_trials": options.copy_trials,
        "copy_span": options.copy_span,
        "seed": options.seed,
        "dtype": options.dtype,
        "models": {},
    }
    for spec in options.models:
        unscaled = next(
            (
                record
                for record in report["models"].values()
                if record["path"] == spec.path and record["rope_scaling"] is None
            ),
            None,
        )
        report["models"][spec.label] = evaluate_model(spec, options, tokens[spec.label], unscaled) | {
            "spec": asdict(spec)
        }
    report["train_length"] = common_train_length(report["models"].values())
    print(format_table(report))
    try:  # without --force, an output that another run made meanwhile is kept, and so are these results
        if options.output:
            with atomic_file(options.output, exclusive=not options.force) as tmp:
                tmp.write_text(json.dumps(report, indent=2) + "\n")
        if options.plot:
            ppl = {
                label: {int(n): entry["ppl"] for n, entry in record["lengths"].items() if _finite_ppl(entry)}
                for label, record in report["models"].items()
            }
            with atomic_file(options.plot, exclusive=not options.force) as tmp:
                plot_lengths(ppl, tmp, report["train_length"])
    except FileExistsError as error:
        raise EvaluationError(
            f"{error.filename} was written by another process while this evaluation ran; this one's is kept in "
            f"{error.filename2}: rename it, or pass --force to replace the file"
        ) from None
    return report


__all__ = [
    "EvalOptions",
    "ModelSpec",
    "common_train_length",
    "format_table",
    "parse_depths",
    "parse_lengths",
    "run_eval",
]
