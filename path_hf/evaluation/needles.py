# Copyright 2026 The path-hf authors. Apache-2.0.
"""Needle retrieval in a haystack of real text: passkey (one key a prompt) and multi-key (several keys with distinct
names in one prompt, one of them asked for).

A prompt is a stretch of held-out text (the haystack) with the needle sentence(s) inserted where a sentence ends, then
a question; the answer is the key. A trial counts when every token of the answer is the most likely next token, as
greedy decoding would write it (teacher-forced: one forward pass to the end of the question, then one cached step per
answer token, the output head applied to those positions only). `score_trials` can also decode a sample of trials with
`generate` from scratch, a check that the teacher-forced verdict is what greedy decoding writes.

The needle and question templates come from a JSON file (`NeedleTemplates.from_file`); the default set
(`needle_templates.json` beside this module) is for evaluation only: the recipes train on templates of their own, and
a test keeps the two sets apart.

Cheap to run: trials that share the text before their needle (a passkey's haystack and depth, a multi-key haystack)
share its forward pass, a cache copied for each trial (`NeedleTrial.shared`).

```python
from path_hf.evaluation import passkey_trials, score_trials, summarize_trials

trials = passkey_trials(tokenizer, stream, length=16384, trials=40)  # 8 at each of 5 depths
results = score_trials(model, trials)
print(summarize_trials(results))  # found / trials, the 95% Wilson interval, by depth
```
"""

from __future__ import annotations

import bisect
import copy
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .scoring import eval_mode, output_head, progress_bar

# The depths of the passkey (the share of the haystack before the needle): five, from near the start to near the end.
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
KEY_DIGITS = 5
MULTIKEY_KEYS = 4
# Trials per haystack and depth share one forward pass over the text before their needle (`passkey_trials`).
HAYSTACKS = 2
# Questions asked of each multi-key haystack (each a trial, about another of its keys).
MULTIKEY_QUESTIONS = 2
# Tokens a continuation feeds one at a time (cached decode steps); a longer one goes in pieces (`_extend`).
STEP_BELOW = 64
# Tokens per piece of a long continuation of a model without PaTH layers (its causal mask is pieces x cache).
PIECE = 4096
PASSKEY, MULTIKEY = "passkey", "multikey"
# Where a needle may go: after a token that ends a sentence or a line.
_SENTENCE_ENDS = (".", "!", "?", "\n", '."', '?"', '!"')


@dataclass(frozen=True)
class NeedleTemplate:
    """A needle sentence and its question: `needle` holds `{key}` (and `{name}` for multi-key), `question` (with
    `{name}` for multi-key) is followed by a space and the key, the answer (`question_and_answer`)."""

    needle: str
    question: str


@dataclass(frozen=True)
class NeedleTemplates:
    """The templates of passkey and multi-key prompts, and the names of the multi-key keys."""

    passkey: tuple[NeedleTemplate, ...]
    multikey: tuple[NeedleTemplate, ...]
    names: tuple[str, ...]

    @classmethod
    def from_dict(cls, data: dict, source: str = "templates") -> NeedleTemplates:
        """From `{"passkey": [{"needle", "question"}, ...], "multikey": [...], "names": [...]}`; refuses a template
        without its placeholders, or too few names, with a message naming `source`."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object with 'passkey', 'multikey' and 'names'")
        sets = {}
        for kind, needs in ((PASSKEY, ("{key}",)), (MULTIKEY, ("{key}", "{name}"))):
            entries = data.get(kind)
            if not isinstance(entries, list) or not entries:
                raise ValueError(f"{source}: '{kind}' must be a non-empty list of {{'needle', 'question'}} objects")
            templates = []
            for index, entry in enumerate(entries):
                if not isinstance(entry, dict) or not {"needle", "question"} <= entry.keys():
                    raise ValueError(f"{source}: {kind}[{index}] must have a 'needle' and a 'question'")
                needle, question = str(entry["needle"]), str(entry["question"])
                for placeholder in needs:
                    if placeholder not in needle:
                        raise ValueError(f"{source}: {kind}[{index}]'s needle has no {placeholder}")
                if "{key}" in question:
                    raise ValueError(f"{source}: {kind}[{index}]'s question gives the key away ({{key}})")
                if kind == MULTIKEY and "{name}" not in question:
                    raise ValueError(f"{source}: {kind}[{index}]'s question must ask for a {{name}}")
                templates.append(NeedleTemplate(needle, question))
            sets[kind] = tuple(templates)
        names = data.get("names")
        if not isinstance(names, list) or len(set(map(str, names))) < 2:
            raise ValueError(f"{source}: 'names' must list at least two distinct names of multi-key keys")
        return cls(sets[PASSKEY], sets[MULTIKEY], tuple(dict.fromkeys(map(str, names))))

    @classmethod
    def from_file(cls, path: str | Path) -> NeedleTemplates:
        """Read a templates file (JSON, `from_dict`'s layout)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: cannot read needle templates ({error})") from error
        return cls.from_dict(data, str(path))

    @classmethod
    def default(cls) -> NeedleTemplates:
        """The evaluation templates shipped with path_hf (never used in training)."""
        text = resources.files(__package__).joinpath("needle_templates.json").read_text()
        return cls.from_dict(json.loads(text), "needle_templates.json")


@dataclass(frozen=True)
class NeedleTrial:
    """One prompt: `context` (token ids, to the end of the question) and the `answer` it must be followed by.

    `group` and `shared`: the trials of one group start with the same `shared` tokens (the text before the needle),
    computed once for all of them. `depth` is the share of the haystack before the asked needle (a passkey's: the depth
    asked for; its needle sits at the nearest sentence end), `distance` the tokens from the asked needle's first token
    to the end of the context."""

    kind: str
    length: int
    context: tuple[int, ...]
    answer: tuple[int, ...]
    group: int
    shared: int
    depth: float
    distance: int
    key: str
    name: str | None
    template: int


@dataclass(frozen=True)
class TrialResult:
    """A scored trial: `hits` of its `tokens` answer tokens were the most likely next token (`found` when all were),
    their summed negative log-likelihood `nll_sum` (nats), and, for the trials also decoded with `generate`, what
    greedy decoding wrote (`greedy`, token ids)."""

    trial: NeedleTrial
    hits: int
    tokens: int
    nll_sum: float
    greedy: tuple[int, ...] | None = None

    @property
    def found(self) -> bool:
        return self.hits == self.tokens

    @property
    def greedy_found(self) -> bool | None:
        return None if self.greedy is None else self.greedy == self.trial.answer


def wilson_interval(found: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a rate `found / trials` (95% for the default `z`); `(0, 1)` for no trials."""
    if trials <= 0:
        return 0.0, 1.0
    p = found / trials
    denominator = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def _token_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def question_and_answer(tokenizer, question: str, key: str) -> tuple[list[int], list[int]]:
    """The token ids of `question + " " + key` tokenised as one text, cut where the key starts: the answer is the
    tokens that hold a character of the key. With a tokenizer that writes the space as a token of its own before
    digits (SmolLM2's), the question ends with it and the answer is the digits, as greedy decoding would meet them;
    one that joins it to the first digits (" 588") puts that token in the answer."""
    text = question + " " + key
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    first = next(index for index, (_, end) in enumerate(offsets) if end > len(text) - len(key))
    return ids[:first], ids[first:]


def _sentence_ends(tokenizer, haystack: Sequence[int]) -> list[int]:
    """The indices i of `haystack` where a needle may go (before token i): after a token that ends a sentence or a
    line. Index 0 and len(haystack) always may."""
    ending = {token for token in set(haystack) if tokenizer.decode([token]).rstrip(" ").endswith(_SENTENCE_ENDS)}
    return sorted({0, len(haystack)} | {index + 1 for index, token in enumerate(haystack[:-1]) if token in ending})


def nearest_place(ends: list[int], target: float) -> int:
    """The allowed insertion index nearest to `target`."""
    at = bisect.bisect_left(ends, target)
    candidates = [ends[i] for i in (at - 1, at) if 0 <= i < len(ends)]
    return min(candidates, key=lambda index: (abs(index - target), index))


def _haystack_starts(stream_length: int, room: int, count: int, rng: random.Random) -> list[int]:
    """`count` distinct start indices of `room`-token haystacks in a stream of `stream_length` tokens."""
    places = stream_length - room + 1
    if places < 1:
        raise ValueError(
            f"the haystack text holds {stream_length} tokens, fewer than the {room} a prompt needs: give more text"
        )
    if count >= places:
        return [rng.randrange(places) for _ in range(count)]
    return rng.sample(range(places), count)


def _random_key(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def passkey_trials(
    tokenizer,
    stream: Sequence[int],
    length: int,
    trials: int,
    depths: Sequence[float] = DEPTHS,
    haystacks: int = HAYSTACKS,
    templates: NeedleTemplates | None = None,
    seed: int = 0,
    digits: int = KEY_DIGITS,
) -> list[NeedleTrial]:
    """Passkey prompts of exactly `length` tokens: a haystack of `stream` (held-out text, token ids) with one needle
    sentence holding a random key, then the question.

    Trial i puts its needle at `depths[i % len(depths)]` (the share of the haystack before it, at the nearest
    sentence end) of haystack `(i // len(depths)) % haystacks` (each a stretch of `stream` drawn from `seed`), with the
    passkey template `i % len(templates.passkey)` and its own key: the trials of one haystack and depth share the text
    before their needle (one group). The same prompts for every model with the same tokenizer, and the first trials
    the same whatever their number.

    Raises:
        ValueError: no trials, a depth outside [0, 1], `length` too short for a prompt, or too little text.
    """
    templates = templates or NeedleTemplates.default()
    depths = [float(depth) for depth in depths]
    if trials < 1 or not depths or haystacks < 1:
        raise ValueError("passkey trials need at least one trial, one depth and one haystack")
    if bad := [depth for depth in depths if not 0.0 <= depth <= 1.0]:
        raise ValueError(f"passkey depths must be in [0, 1], got {bad[0]}")
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]  # BOS, for tokenizers that add one
    rng = random.Random(f"passkey-{seed}-{length}")
    keys = [_random_key(rng, digits) for _ in range(trials)]
    pieces = []
    for index, key in enumerate(keys):
        template = templates.passkey[index % len(templates.passkey)]
        needle = _token_ids(tokenizer, " " + template.needle.format(key=key))
        question, answer = question_and_answer(tokenizer, template.question, key)
        room = length - len(prefix) - len(needle) - len(question) - len(answer)
        if room < 1:
            raise ValueError(f"context length {length} is too short for a passkey prompt: it needs more than "
                             f"{length - room} tokens with this tokenizer")  # fmt: skip
        pieces.append((needle, question, answer, room))
    # The haystack text each template leaves room for (with the longest key): the needle of a haystack and depth sits
    # at the same place whatever the template and key, so that the trials of the group share the text before it.
    widest = "9" * (digits + 1)
    rooms = [
        length - len(prefix) - len(_token_ids(tokenizer, " " + template.needle.format(key=widest)))
        - sum(map(len, question_and_answer(tokenizer, template.question, widest)))
        for template in templates.passkey
    ]  # fmt: skip
    shortest, largest = min(rooms), max(room for *_, room in pieces)
    if shortest < 1:
        raise ValueError(f"context length {length} is too short for a passkey prompt with these templates")
    starts = _haystack_starts(len(stream), largest, haystacks, random.Random(f"passkey-haystack-{seed}-{length}"))
    ends_of: dict[int, list[int]] = {}
    result = []
    for index, (key, (needle, question, answer, room)) in enumerate(zip(keys, pieces, strict=True)):
        depth_index, haystack_index = index % len(depths), (index // len(depths)) % haystacks
        start = starts[haystack_index]
        haystack = list(stream[start : start + largest])
        if haystack_index not in ends_of:
            ends_of[haystack_index] = _sentence_ends(tokenizer, haystack)
        at = nearest_place([end for end in ends_of[haystack_index] if end <= shortest], depths[depth_index] * shortest)
        context = prefix + haystack[:at] + needle + haystack[at:room] + question
        result.append(
            NeedleTrial(
                kind=PASSKEY,
                length=length,
                context=tuple(context),
                answer=tuple(answer),
                group=haystack_index * len(depths) + depth_index,
                shared=len(prefix) + at,
                depth=depths[depth_index],
                distance=len(context) - (len(prefix) + at),
                key=key,
                name=None,
                template=index % len(templates.passkey),
            )
        )
    return result


def multikey_trials(
    tokenizer,
    stream: Sequence[int],
    length: int,
    trials: int,
    keys: int = MULTIKEY_KEYS,
    questions: int = MULTIKEY_QUESTIONS,
    templates: NeedleTemplates | None = None,
    seed: int = 0,
    digits: int = KEY_DIGITS,
) -> list[NeedleTrial]:
    """Multi-key prompts of exactly `length` tokens: a haystack of `stream` holding `keys` needles, each a random key
    with a distinct name (one multi-key template a haystack), spread over the haystack (needle k at a random depth in
    the k-th of `keys` equal parts), then a question about one of them. Each haystack answers `questions` questions
    (about distinct keys chosen at random), each a trial, sharing the haystack's forward pass; `ceil(trials /
    questions)` haystacks. A model that copies the last key it read finds the asked one only when it is the last.

    Raises:
        ValueError: fewer than two keys, more keys than names, `length` too short, or too little text.
    """
    templates = templates or NeedleTemplates.default()
    if trials < 1 or questions < 1:
        raise ValueError("multi-key trials need at least one trial and one question a haystack")
    if not 2 <= keys <= len(templates.names):
        raise ValueError(f"multi-key prompts need 2 to {len(templates.names)} keys (the templates' names), got {keys}")
    questions = min(questions, keys)
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]
    count = math.ceil(trials / questions)
    rng = random.Random(f"multikey-{seed}-{length}")
    plans = []
    for haystack_index in range(count):
        template_index = haystack_index % len(templates.multikey)
        template = templates.multikey[template_index]
        names = rng.sample(templates.names, keys)
        values = [_random_key(rng, digits) for _ in range(keys)]
        needles = [
            _token_ids(tokenizer, " " + template.needle.format(key=value, name=name))
            for name, value in zip(names, values, strict=True)
        ]
        asked = rng.sample(range(keys), questions)
        asks = [(k, *question_and_answer(tokenizer, template.question.format(name=names[k]), values[k])) for k in asked]
        longest_ask = max(len(question) + len(answer) for _, question, answer in asks)
        room = length - len(prefix) - sum(map(len, needles)) - longest_ask
        if room < keys:
            raise ValueError(f"context length {length} is too short for a multi-key prompt with {keys} keys")
        spots = sorted((k + rng.uniform(0.1, 0.9)) / keys for k in range(keys))
        plans.append((template_index, names, values, needles, asks, room, spots))
    largest = max(plan[5] for plan in plans) + STEP_BELOW  # room, and the text a shorter question's prompt adds
    starts = _haystack_starts(len(stream), largest, count, random.Random(f"multikey-haystack-{seed}-{length}"))
    result = []
    for haystack_index, (template_index, names, values, needles, asks, room, spots) in enumerate(plans):
        start = starts[haystack_index]
        haystack = list(stream[start : start + largest])
        ends = [end for end in _sentence_ends(tokenizer, haystack) if end <= room]
        places = []
        for spot in spots:  # in order, each after the previous one
            place = nearest_place([end for end in ends if not places or end >= places[-1]], spot * room)
            places.append(place)
        body, needle_at, cursor = list(prefix), [], 0
        for place, needle in zip(places, needles, strict=True):
            body += haystack[cursor:place]
            needle_at.append(len(body))
            body += needle
            cursor = place
        shared = body + haystack[cursor:room]  # every question's context starts so (its prompt: `length` - longest)
        for k, question, answer in asks:
            # a shorter question sees a few more tokens of text after every needle: each prompt is `length` tokens
            context = shared + haystack[room : room + length - len(shared) - len(question) - len(answer)] + question
            result.append(
                NeedleTrial(
                    kind=MULTIKEY,
                    length=length,
                    context=tuple(context),
                    answer=tuple(answer),
                    group=haystack_index,
                    shared=len(shared),
                    depth=places[k] / room,
                    distance=len(context) - needle_at[k],
                    key=values[k],
                    name=names[k],
                    template=template_index,
                )
            )
    return result[:trials]


def _has_path_layers(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return "path_attention" in (getattr(config, "layer_types", None) or ())


def _extend(model: nn.Module, cache, ids: Sequence[int], device) -> torch.Tensor:
    """Feed `ids` after what `cache` holds (updating it); the last hidden state `[hidden]`. Short continuations go one
    token at a time (a cached decode step each, cheap for every layer type); long ones in pieces of `PIECE` tokens
    (a model without PaTH layers: its causal mask is a piece by the whole cache) or whole (a PaTH layer continues a
    cache over every cached token at once)."""
    decoder = model.get_decoder()
    ids = torch.tensor(list(ids), dtype=torch.long, device=device)[None]
    if ids.shape[1] <= STEP_BELOW:
        size = 1
    else:
        size = ids.shape[1] if _has_path_layers(model) else PIECE
    hidden = None
    for start in range(0, ids.shape[1], size):
        output = decoder(input_ids=ids[:, start : start + size], cache=cache, use_cache=True)
        hidden = output.last_hidden_state[0, -1]
    return hidden


def _new_cache(model: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.no_grad()
def score_trials(
    model: nn.Module, trials: Sequence[NeedleTrial], greedy_check: int = 0, progress: bool = False
) -> list[TrialResult]:
    """Score each trial teacher-forced: the context in one forward pass (the text its group shares computed once, its
    cache copied for each trial), then one cached step per answer token; the output head only at the positions that
    predict an answer token. The first `greedy_check` trials are also decoded greedily with `generate` from scratch
    (no shared cache), which must write the answer exactly when the teacher-forced verdict is found."""
    head = output_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} exposes no decoder and linear output head to score needles with")
    by_group: dict[int, list[int]] = {}
    for index, trial in enumerate(trials):
        by_group.setdefault((trial.kind, trial.length, trial.group), []).append(index)
    results: list[TrialResult | None] = [None] * len(trials)
    bar = progress_bar(range(len(trials)), len(trials), "needles", progress)
    ticks = iter(bar)
    with eval_mode(model) as device:
        for indices in by_group.values():
            shared = min(trials[i].shared for i in indices)
            if any(trials[i].context[:shared] != trials[indices[0]].context[:shared] for i in indices):
                raise ValueError("the trials of a group must share their first `shared` tokens")
            base = _new_cache(model)
            if shared:
                _extend(model, base, trials[indices[0]].context[:shared], device)
            for position, index in enumerate(indices):
                trial = trials[index]
                cache = base if position == len(indices) - 1 else copy.deepcopy(base)
                hidden = [_extend(model, cache, trial.context[shared:], device)]
                for token in trial.answer[:-1]:
                    hidden.append(_extend(model, cache, [token], device))
                logits = head(torch.stack(hidden)).float()
                targets = torch.tensor(trial.answer, device=logits.device)
                hits = int((logits.argmax(-1) == targets).sum())
                nll = float(F.cross_entropy(logits, targets, reduction="sum"))
                del cache
                results[index] = TrialResult(trial, hits, len(trial.answer), nll)
                next(ticks, None)
        for index in range(min(greedy_check, len(trials))):
            trial = trials[index]
            prompt = torch.tensor([trial.context], dtype=torch.long, device=device)
            written = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=len(trial.answer),
                min_new_tokens=len(trial.answer),
                do_sample=False,
                num_beams=1,
                pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0,
            )[0, prompt.shape[1] :]
            result = results[index]
            results[index] = TrialResult(trial, result.hits, result.tokens, result.nll_sum, tuple(written.tolist()))
    return results


def summarize_trials(results: Sequence[TrialResult]) -> dict:
    """found / trials, the rate with its 95% Wilson interval, the answer's mean negative log-likelihood per token, the
    same by depth (passkey) and the greedy check: `{"found", "trials", "rate", "wilson95", "nll", "by_depth",
    "greedy_checked", "greedy_agrees"}`."""
    found = sum(result.found for result in results)
    tokens = sum(result.tokens for result in results)
    summary = {
        "found": found,
        "trials": len(results),
        "rate": found / len(results) if results else math.nan,
        "wilson95": list(wilson_interval(found, len(results))),
        "nll": sum(result.nll_sum for result in results) / tokens if tokens else math.nan,
    }
    by_depth: dict[str, list[TrialResult]] = {}
    if results and all(result.trial.kind == PASSKEY for result in results):
        for result in results:
            by_depth.setdefault(f"{round(result.trial.depth, 1):g}", []).append(result)
        summary["by_depth"] = {
            depth: {"found": sum(r.found for r in group), "trials": len(group)}
            for depth, group in sorted(by_depth.items(), key=lambda item: float(item[0]))
        }
    checked = [result for result in results if result.greedy is not None]
    summary["greedy_checked"] = len(checked)
    summary["greedy_agrees"] = sum(result.greedy_found == result.found for result in checked)
    return summary


def trial_records(results: Sequence[TrialResult], tokenizer=None) -> list[dict]:
    """One JSON-ready record per trial: its key, name, depth, distance, template, and how it was scored."""
    records = []
    for result in results:
        trial = asdict(result.trial)
        del trial["context"], trial["answer"]
        record = trial | {"found": result.found, "hits": result.hits, "tokens": result.tokens}
        record["nll"] = result.nll_sum / result.tokens if result.tokens else math.nan
        if result.greedy is not None:
            record["greedy_found"] = result.greedy_found
            if tokenizer is not None:
                record["greedy"] = tokenizer.decode(list(result.greedy))
        records.append(record)
    return records


__all__ = [
    "DEPTHS",
    "HAYSTACKS",
    "KEY_DIGITS",
    "MULTIKEY_KEYS",
    "MULTIKEY_QUESTIONS",
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
]
