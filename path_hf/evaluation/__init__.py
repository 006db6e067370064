# Copyright 2026 The path-hf authors. Apache-2.0.
"""Length-extrapolation evaluation of any causal language model: perplexity over fixed-length windows, passkey
retrieval, and RoPE scaling (YaRN, dynamic NTK) applied to a loaded model.

One implementation for the recipes' recovery tracking, `path-hf eval` and the demo.

- Perplexity: the text is cut into windows of `context_length` tokens (non-overlapping, or sliding by `stride` with
  each token scored once, with as much context as the window holds); the model scores every token of a window but the
  first from the tokens before it in the same window, and the negative log-likelihoods are summed in float32, also
  per position in the window (`PerplexityResult.ppl_between`).
- Passkey retrieval: a five-digit key hidden at a random depth in filler text of about `context_length` tokens; a
  trial counts when greedy decoding after "The pass key is" would write every token of the key.
- `rope_scaling(model, "yarn", factor=4)`: swaps the model's rotary embedding for one built with transformers' own
  `rope_parameters` of that type, for the duration of a `with` block.

```python
from path_hf.evaluation import passkey_accuracy, perplexity, read_texts, tokenize_stream

stream = tokenize_stream(read_texts(["eval.jsonl"]), tokenizer, max_tokens=65536)
result = perplexity(model, stream, context_length=2048)  # one long stream, or a list of documents
print(result.ppl, result.tokens, passkey_accuracy(model, tokenizer, context_length=2048))
```
"""

from __future__ import annotations

import bz2
import contextlib
import copy
import gzip
import lzma
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Window:
    """One model input: `input_ids` `[T]`, and `labels` `[T]` holding the ids of the tokens scored in this window and
    `IGNORE_INDEX` elsewhere (context scored by an earlier window; the first token, which has no context)."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def scored(self) -> int:
        """How many tokens this window scores: its labels, but the first, which nothing predicts."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class PerplexityResult:
    """Summed negative log-likelihood (nats) and the number of tokens it is over; `ppl = exp(nll_sum / tokens)`.

    `position_nll` / `position_tokens` hold the same sums per position in the window (index p: the token at position p
    of its window), so that `ppl_between(start, end)` gives the perplexity of the tokens read with `start` to `end - 1`
    tokens before them in the window, e.g. those beyond a model's training length.
    """

    nll_sum: float
    tokens: int
    position_nll: tuple[float, ...] = field(default=(), repr=False)
    position_tokens: tuple[int, ...] = field(default=(), repr=False)

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per token (nats)."""
        return self.nll_sum / self.tokens if self.tokens else math.nan

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def ppl_between(self, start: int, end: int | None = None) -> float:
        """Perplexity of the tokens at positions `[start, end)` of their windows (`nan` if there are none)."""
        nll, tokens = sum(self.position_nll[start:end]), sum(self.position_tokens[start:end])
        return math.exp(nll / tokens) if tokens else math.nan

    def __add__(self, other: PerplexityResult) -> PerplexityResult:
        def add(a: tuple, b: tuple) -> tuple:
            longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
            return tuple(x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer))

        return PerplexityResult(
            self.nll_sum + other.nll_sum,
            self.tokens + other.tokens,
            add(self.position_nll, other.position_nll),
            add(self.position_tokens, other.position_tokens),
        )


def _documents(token_ids) -> list[torch.Tensor]:
    """One stream (a 1-D tensor or a list of ints) or a list of documents -> a list of 1-D LongTensors."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D (one stream) or a list of documents, got shape {token_ids.shape}")
        return [token_ids.long()]
    token_ids = list(token_ids)
    if token_ids and all(isinstance(token, int) for token in token_ids):
        return [torch.tensor(token_ids, dtype=torch.long)]
    return [torch.as_tensor(document, dtype=torch.long) for document in token_ids]


def make_windows(token_ids, context_length: int, stride: int | None = None) -> list[Window]:
    """Cut `token_ids` (one stream, or a list of documents, each cut on its own) into windows of at most
    `context_length` tokens.

    `stride=None` (or `context_length`): non-overlapping windows; the first token of each window is not scored. A
    smaller `stride` slides the window by `stride` tokens and scores only the tokens no earlier window scored, so each
    token after a document's first is scored exactly once, with up to `context_length - 1` tokens of context (the
    sliding-window evaluation of transformers' perplexity guide).
    """
    stride = context_length if stride is None else stride
    if context_length < 2:
        raise ValueError(f"context_length must be at least 2 (one token of context, one scored), got {context_length}")
    if not 1 <= stride <= context_length:
        raise ValueError(f"stride must be in [1, context_length={context_length}], got {stride}")
    windows = []
    for document in _documents(token_ids):
        scored_until = 0  # tokens [0, scored_until) of the document have been scored (or are its first token)
        for begin in range(0, len(document), stride):
            end = min(begin + context_length, len(document))
            input_ids = document[begin:end]
            labels = input_ids.clone()
            labels[: max(scored_until - begin, 0)] = IGNORE_INDEX
            window = Window(input_ids, labels)
            if window.scored:
                windows.append(window)
            scored_until = end
            if end == len(document):
                break
    return windows


def _batches(windows: Sequence[Window], batch_size: int) -> Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded `(input_ids, attention_mask, labels)` batches of `windows`."""
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        length = max(len(window.input_ids) for window in batch)
        input_ids = torch.zeros(len(batch), length, dtype=torch.long)
        labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), length, dtype=torch.long)
        for row, window in enumerate(batch):
            n = len(window.input_ids)
            input_ids[row, :n], labels[row, :n], attention_mask[row, :n] = window.input_ids, window.labels, 1
        yield input_ids, attention_mask, labels


def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, disable=None)  # None: only on a terminal


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[torch.device]:
    """`model` in eval mode for the block (restored after); yields the device of its parameters."""
    was_training = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(was_training)


# Positions whose logits are formed at once when scoring: a 32k-token window of a 128k vocabulary would otherwise hold
# 16 GB of float32 logits.
_LOGITS_CHUNK = 2048


def _has_plain_head(model: nn.Module) -> bool:
    """Whether `model`'s logits are `lm_head(decoder output)`, with no soft-capping or scaling after the head, so that
    they can be formed a chunk of positions at a time."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return False
    try:
        return model.get_decoder() is not None and isinstance(model.get_output_embeddings(), nn.Linear)
    except (AttributeError, NotImplementedError):
        return False


def _forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, device) -> torch.Tensor:
    """Logits of a right-padded batch; full batches of equal length get no mask."""
    mask = None if bool(attention_mask.all()) else attention_mask.to(device)
    return model(input_ids=input_ids.to(device), attention_mask=mask, use_cache=False).logits


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood `[B, T]` of `targets` `[B, T]` under `logits` `[B, T, V]` (0 where a target is
    `IGNORE_INDEX`), in at least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")


def _token_nll(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor, device
) -> torch.Tensor:
    """Negative log-likelihood `[B, T - 1]` of `targets` (the next token at each position, `IGNORE_INDEX` where not
    scored) for a right-padded batch; full batches of equal length get no mask. Where the head allows it, the logits
    are formed `_LOGITS_CHUNK` positions at a time (memory O(chunk x vocab), not O(T x vocab))."""
    mask = None if bool(attention_mask.all()) else attention_mask.to(device)
    input_ids, targets = input_ids.to(device), targets.to(device)
    nll = token_nll
    if not _has_plain_head(model):
        return nll(model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits[:, :-1], targets)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    head = model.get_output_embeddings()
    return torch.cat(
        [
            nll(head(hidden[:, start : start + _LOGITS_CHUNK]), targets[:, start : start + _LOGITS_CHUNK])
            for start in range(0, hidden.shape[1], _LOGITS_CHUNK)
        ],
        dim=1,
    )


@torch.no_grad()
def score_windows(
    model: nn.Module, windows: Sequence[Window], batch_size: int = 8, progress: bool = False
) -> PerplexityResult:
    """Summed negative log-likelihood of the scored tokens of `windows` under `model` (any causal LM whose forward
    takes `input_ids`, `attention_mask` and returns `.logits`), in batches of `batch_size` windows, in total and per
    position in the window.

    The model is put in eval mode for the call and restored after. Windows of different lengths in one batch are
    right-padded (with an attention mask); full batches of equal length get no mask.
    """
    longest = max((len(window.input_ids) for window in windows), default=1)
    position_nll = torch.zeros(longest, dtype=torch.float64)
    position_tokens = torch.zeros(longest, dtype=torch.long)
    batches = _progress(_batches(windows, batch_size), math.ceil(len(windows) / batch_size), "perplexity", progress)
    with _eval_mode(model) as device:
        for input_ids, attention_mask, labels in batches:
            targets = labels[:, 1:]
            nll = _token_nll(model, input_ids, attention_mask, targets, device)  # [B, T-1]: position t+1's token
            width = nll.shape[1]
            position_nll[1 : width + 1] += nll.sum(0).double().cpu()
            position_tokens[1 : width + 1] += (targets != IGNORE_INDEX).sum(0).cpu()
    return PerplexityResult(
        position_nll.sum().item(),
        int(position_tokens.sum()),
        tuple(position_nll.tolist()),
        tuple(position_tokens.tolist()),
    )


def perplexity(
    model: nn.Module,
    token_ids,
    context_length: int,
    stride: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity of `model` on `token_ids` (a 1-D tensor or list of ints: one stream; a list of those: documents,
    never attending across each other) over windows of `context_length` tokens.

    Args:
        model: a causal LM (`AutoModelForCausalLM.from_pretrained(...)` or any module returning `.logits`).
        token_ids: the text, tokenised.
        context_length: tokens per window.
        stride: `None` for non-overlapping windows; smaller for sliding windows (see `make_windows`).
        batch_size: windows per forward pass.
        progress: show a progress bar.

    Returns:
        A `PerplexityResult` (`nll_sum`, `tokens`, `nll`, `ppl`).
    """
    return score_windows(model, make_windows(token_ids, context_length, stride), batch_size, progress)


@torch.no_grad()
def attends_causally(model: nn.Module, length: int = 16, seed: int = 0) -> bool:
    """Whether each position's logits depend only on the tokens up to it, as a causal LM's do. Works for any
    architecture, at the cost of one forward of three `length`-token sequences: random token ids twice, and once with
    their second half changed. The first half's logits must not change by more than the two identical rows differ
    (float noise of the kernels; none on CPU) plus 1e-5 of their size. A bidirectional encoder with an LM head (BERT
    loaded as `BertLMHeadModel`) fails: even a tiny random one moves them by 1e-3 of their size, a trained one by far
    more."""
    generator = torch.Generator().manual_seed(seed)
    vocab, half = model.get_input_embeddings().num_embeddings, length // 2
    input_ids = torch.randint(vocab, (length,), generator=generator).repeat(3, 1)
    input_ids[2, half:] = (input_ids[2, half:] + torch.randint(1, vocab, (length - half,), generator=generator)) % vocab
    with _eval_mode(model) as device:
        logits = model(input_ids=input_ids.to(device), use_cache=False).logits[:, :half].float()
    noise, change = (logits[0] - logits[1]).abs().max(), (logits[0] - logits[2]).abs().max()
    return bool(change <= 10 * noise + 1e-5 * logits[0].abs().max())


# Text: files -> documents -> one token stream


COMPRESSED_SUFFIXES = (".gz", ".xz", ".bz2", ".zst")
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_DECOMPRESSORS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}


def _data_suffix(file: Path) -> str:
    """The suffix that says how to read `file`: `.jsonl` for `a.jsonl` and `a.jsonl.gz`."""
    return Path(file.stem).suffix if file.suffix in COMPRESSED_SUFFIXES else file.suffix


def _expand_directory(file: str) -> list[str]:
    """`[file]`, or for a directory the data files directly in it (hidden files left out), sorted by name."""
    if not Path(file).is_dir():
        return [file]
    found = sorted(
        str(path)
        for path in Path(file).iterdir()
        if path.is_file() and not path.name.startswith(".") and _data_suffix(path) in _BUILDERS
    )
    if not found:
        raise ValueError(
            f"{file} is a directory with no data files (looked for {', '.join('*' + s for s in _BUILDERS)}, each "
            f"optionally compressed with {', '.join(COMPRESSED_SUFFIXES)})"
        )
    return found


def data_files(files: Sequence[str | Path]) -> tuple[str, dict]:
    """The `datasets` builder and its keyword arguments that read local `files`, all of one kind: `.txt` (a document
    ends at a blank line), `.jsonl` / `.json` or `.parquet`, each optionally compressed (`.gz`, `.xz`, `.bz2`, `.zst`,
    which `datasets` decompresses itself). A directory stands for the data files directly in it, sorted by name.
    Raises `FileNotFoundError` / `ValueError` naming the files at fault."""
    files = [expanded for file in files for expanded in _expand_directory(str(file))]
    if not files:
        raise ValueError("no data files given")
    missing = [file for file in files if not Path(file).is_file()]
    if missing:
        raise FileNotFoundError(f"no such file(s): {', '.join(missing)}")
    suffixes = {_data_suffix(Path(file)) for file in files}
    if len(suffixes) != 1 or next(iter(suffixes)) not in _BUILDERS:
        raise ValueError(
            f"data files must all be .txt, .jsonl/.json or .parquet (optionally compressed with "
            f"{', '.join(COMPRESSED_SUFFIXES)}), got {sorted(suffixes)}"
        )
    builder = _BUILDERS[suffixes.pop()]
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    return builder, {"data_files": files, **kwargs}


def _blank(file: str, builder: str) -> bool:
    """Whether `file` holds nothing but whitespace (once decompressed): no documents, and nothing `datasets` reads (it
    fails on an empty file). Only its first non-blank bytes are read."""
    if Path(file).stat().st_size == 0:
        return True
    suffix = Path(file).suffix
    if builder == "parquet" or (suffix in COMPRESSED_SUFFIXES and suffix not in _DECOMPRESSORS):
        return False  # a parquet file has a schema; zstandard is not in the standard library
    try:
        with _DECOMPRESSORS.get(suffix, open)(file, "rb") as stream:
            while chunk := stream.read(1 << 16):
                if chunk.strip():
                    return False
    except (OSError, EOFError, lzma.LZMAError):  # a damaged file: `datasets` says what is wrong with it
        return False
    return True


def load_texts(files: Sequence[str | Path], text_field: str = "text", streaming: bool = False):
    """The documents of local `files` (see `data_files`) as a `datasets` dataset (an `IterableDataset` if
    `streaming`) with the one column `text_field`, empty documents left out, in file order. Each file is read on its
    own, so files whose records carry different other fields mix; files holding only whitespace add nothing. Raises
    `ValueError` naming a file without the column."""
    from datasets import Dataset, Features, Value, concatenate_datasets, load_dataset

    builder, kwargs = data_files(files)
    parts = []
    for file in kwargs.pop("data_files"):
        if _blank(file, builder):
            continue
        dataset = load_dataset(builder, data_files=[file], split="train", streaming=streaming, **kwargs)
        parts.append(text_documents(dataset, text_field, file))
    if not parts:
        empty = Dataset.from_dict({text_field: []}, features=Features({text_field: Value("string")}))
        return empty.to_iterable_dataset() if streaming else empty
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def text_documents(dataset, text_field: str, source: str):
    """The non-empty documents of a `datasets` dataset (or `IterableDataset`), as its one column `text_field`. Raises
    `ValueError` naming `source` when it has no such column."""
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(f"{source} has no column {text_field!r} (columns: {columns}): set the text field")
    return dataset.select_columns([text_field]).filter(lambda row: bool(row[text_field] and row[text_field].strip()))


def read_texts(files: Sequence[str | Path], text_field: str = "text") -> list[str]:
    """The non-empty documents of local `files` (see `load_texts`), in order; `text_field` names the column of
    JSON / parquet records."""
    return list(load_texts(files, text_field)[text_field])


def tokenize_documents(texts: Sequence[str], tokenizer) -> list[list[int]]:
    """The token ids of each of `texts` as the models read a document: with the tokenizer's special tokens (BOS) and
    followed by EOS."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [ids + eos for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]


def tokenize_stream(texts: Iterable[str], tokenizer, max_tokens: int | None = None) -> list[int]:
    """`texts` tokenised as one stream of documents (`tokenize_documents`), cut to at most `max_tokens` tokens."""
    stream: list[int] = []
    for text in texts:
        stream += tokenize_documents([text], tokenizer)[0]
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    return stream if max_tokens is None else stream[:max_tokens]


# Passkey retrieval


PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about it.\n"
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_windows(tokenizer, context_length: int, trials: int = 20, seed: int = 0) -> list[Window]:
    """`trials` passkey prompts of at most `context_length` tokens, each a `Window` whose labels are the key's tokens
    (the answer after "The pass key is") and `IGNORE_INDEX` elsewhere.

    Each prompt is the intro, filler sentences with the needle (a random five-digit key, stated twice) at a uniformly
    random depth, and the question; the pieces are tokenised apart and joined as ids, so no token crosses a piece.
    Trial i draws its key and depth from `random.Random(seed + i)`: the same prompts for every model with the same
    tokenizer.
    """

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix = tokenizer("", add_special_tokens=True)["input_ids"]  # BOS, for tokenizers that add one
    intro, filler, question = ids(PASSKEY_INTRO), ids(PASSKEY_FILLER), ids(PASSKEY_QUESTION)
    windows = []
    for trial in range(trials):
        rng = random.Random(seed + trial)
        key = str(rng.randint(10_000, 99_999))
        needle, answer = ids(PASSKEY_NEEDLE.format(key=key)), ids(" " + key)
        room = context_length - len(prefix) - len(intro) - len(needle) - len(question) - len(answer)
        repeats = room // len(filler)
        if repeats < 1:
            raise ValueError(
                f"context_length {context_length} is too short for a passkey prompt: it needs at least "
                f"{context_length - room + len(filler)} tokens with this tokenizer"
            )
        before = rng.randint(0, repeats)
        prompt = prefix + intro + filler * before + needle + filler * (repeats - before) + question
        input_ids = torch.tensor(prompt + answer, dtype=torch.long)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[len(prompt) :] = input_ids[len(prompt) :]
        windows.append(Window(input_ids, labels))
    return windows


@torch.no_grad()
def answer_accuracy(
    model: nn.Module, windows: Sequence[Window], batch_size: int = 8, progress: bool = False
) -> list[bool]:
    """For each window: does greedy decoding from the tokens before its first label write every labelled token?

    Teacher forcing gives the same verdict in one forward pass: greedy decoding writes the answer exactly when, at
    each answer position, the most likely next token is the answer's (the labels must be one contiguous run at the
    end of the window, as `passkey_windows` makes them).
    """
    correct: list[bool] = []
    batches = _progress(_batches(windows, batch_size), math.ceil(len(windows) / batch_size), "passkey", progress)
    with _eval_mode(model) as device:
        for input_ids, attention_mask, labels in batches:
            predicted = _forward(model, input_ids, attention_mask, device)[:, :-1].argmax(-1).cpu()
            targets = labels[:, 1:]
            scored = targets != IGNORE_INDEX
            correct += ((predicted == targets) | ~scored).all(1).tolist()
    return correct


def passkey_accuracy(
    model: nn.Module,
    tokenizer,
    context_length: int,
    trials: int = 20,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = False,
) -> float:
    """Fraction of `trials` passkey prompts of about `context_length` tokens whose key `model` retrieves (see
    `passkey_windows` and `answer_accuracy`)."""
    correct = answer_accuracy(model, passkey_windows(tokenizer, context_length, trials, seed), batch_size, progress)
    return sum(correct) / len(correct)


# RoPE scaling of a loaded model


ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn")


def rope_parameters_for(config, rope_type: str, factor: float, original_length: int | None = None) -> dict:
    """transformers' `rope_parameters` of `rope_type` ("linear", "dynamic" or "yarn") with `factor`, on the model's
    own `rope_theta`; `original_length` (the training context) defaults to the model's `max_position_embeddings`.

    Dynamic NTK rescales the base only for sequences longer than `max_position_embeddings`, so that must be the
    training context; YaRN and linear interpolation apply `factor` at every length."""
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(f"unknown RoPE scaling {rope_type!r}: use one of {', '.join(ROPE_SCALING_TYPES)}")
    if factor < 1:
        raise ValueError(f"the RoPE scaling factor must be at least 1, got {factor}")
    current = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "rope_mode", None) == "drop" and all(map(config.is_path_layer, range(config.num_hidden_layers))):
        raise ValueError(f"{type(config).__name__} has rope_mode='drop' in every layer: the model uses no RoPE")
    if "rope_theta" not in current:
        raise ValueError(f"{type(config).__name__} has no rope_parameters with a rope_theta: the model uses no RoPE")
    original_length = original_length or config.max_position_embeddings
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
    NTK / linear implementation; the originals come back after. Raises `ValueError` for a model without RoPE."""
    config = copy.deepcopy(model.config)
    config.rope_parameters = rope_parameters_for(config, rope_type, factor, original_length)
    if rope_type == "dynamic":
        config.max_position_embeddings = original_length or config.max_position_embeddings
    swapped = []
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] == "rotary_emb":
            parent = model.get_submodule(name.rpartition(".")[0])
            device = next(iter(module.buffers()), torch.empty(0)).device
            parent.rotary_emb = type(module)(config).to(device)
            swapped.append((parent, module))
    if not swapped:
        raise ValueError(f"{type(model).__name__} has no rotary embedding (rotary_emb) to rescale: it uses no RoPE")
    try:
        yield model
    finally:
        for parent, module in swapped:
            parent.rotary_emb = module


from .plots import plot_lengths, plot_recovery  # noqa: E402

__all__ = [
    "IGNORE_INDEX",
    "PerplexityResult",
    "Window",
    "answer_accuracy",
    "attends_causally",
    "data_files",
    "make_windows",
    "passkey_accuracy",
    "passkey_windows",
    "perplexity",
    "plot_lengths",
    "plot_recovery",
    "read_texts",
    "rope_parameters_for",
    "rope_scaling",
    "score_windows",
    "text_documents",
    "token_nll",
    "tokenize_documents",
    "tokenize_stream",
]
