"""Build the local-file lm-eval-harness tasks of a held-out text: their data (`data/NAME_*.jsonl`) and their task
configs (`NAME_*.yaml`), for `lm_eval --include_path examples/lm_eval`.

The text is a `.jsonl` or `.jsonl.xz` file of documents, one JSON record per line with a `text` field (the held-out
splits in `examples/default_model/data/` and `examples/data/` are such files). Three tasks come out of it, each
tagged `NAME`:

- `NAME_perplexity` (`loglikelihood_rolling`, like wikitext): passages of whole blocks (paragraphs, code examples) of
  the documents, verbatim, of up to `--passage-chars` characters; word_perplexity, byte_perplexity, bits_per_byte.
- `NAME_lastword` (`loglikelihood`, like LAMBADA): the last word of a prose sentence after up to
  `--lastword-context-chars` characters of the prose before it, starting at a sentence; only words that already
  occur in that context and are no English function word; acc (every token of the word is the greedy choice) and
  perplexity.
- `NAME_nextsentence` (`multiple_choice`): the sentence that follows a context of up to
  `--nextsentence-context-chars` characters of prose, among four: the true one and three sentences of other paragraphs
  of the same document; acc and acc_norm.

Prose paragraphs have their line breaks replaced by spaces; a paragraph ends at a blank line. Items are drawn with a
seeded generator and written in a shuffled order, so `lm_eval --limit N` evaluates a random subset. The output is
byte-for-byte deterministic.

    python examples/lm_eval/build_tasks.py                                      # rebuild every text in TEXTS
    python examples/lm_eval/build_tasks.py --source held_out.jsonl.xz --name mytext   # a new text (add it to TEXTS)
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# The held-out texts whose tasks ship in this folder: task-name prefix -> the .jsonl[.xz] file, relative to the repo.
TEXTS = {
    "pydocs": "examples/default_model/data/eval.jsonl.xz",  # the Python docs, held out
    "austen": "examples/data/austen/eval.jsonl.xz",  # Persuasion, held out from the Austen training text
    "copyright_does_not_exist": "examples/data/copyright_does_not_exist/eval.jsonl.xz",  # never trained on
}

BLOCK_SEPARATOR = re.compile(r"\n[ \t]*\n")
# A sentence ends at . ! or ? (and perhaps a closing quote or bracket) followed by space and an upper-case letter
# or an opening quote or bracket.
SENTENCE_BREAK = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')]))\s+(?=[A-Z\"'(])")
ENUMERATOR = re.compile(r"\(?[0-9]+[.)]")  # "3." opening a numbered item or footnote is no sentence
SENTENCE_END = re.compile(r"[.!?][\"')]?$")
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.", "Mr.", "Dr.", "No.")
# Not lastword targets: pronouns, determiners, prepositions, conjunctions, auxiliaries.
FUNCTION_WORDS = set(
    """a about above after again against all also am an and any are as at be been before being below between both but
    by can could did do does doing down during each either few for from further had has have having he her here hers
    herself him himself his how i if in into is it its itself just me more most my myself neither no nor not now of
    off on once only or other our ours ourselves out over own same she should so some such than that the their theirs
    them themselves then there these they this those through to too under until up upon us very was we were what when
    where which while who whom whose why will with would yet you your yours yourself yourselves""".split()
)
LAST_WORD = re.compile(r" ([A-Za-z][A-Za-z'-]*[A-Za-z])[.!?][\"')]?$")


@dataclass(frozen=True)
class Options:
    seed: int = 0
    perplexity_passages: int = 32
    passage_chars: int = 2048
    lastword_items: int = 256
    lastword_context_chars: int = 512
    nextsentence_items: int = 256
    nextsentence_context_chars: int = 256
    min_context_chars: int = 100
    sentence_chars: tuple[int, int] = (30, 160)


def read_documents(source: Path) -> list[str]:
    """The `text` field of each record of a `.jsonl` / `.jsonl.xz` file, stripped; empty documents dropped."""
    if not source.is_file():
        raise FileNotFoundError(f"no such file: {source}")
    opener = lzma.open if source.suffix == ".xz" else open
    texts = []
    with opener(source, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{source}, line {number}: expected a JSON object with a string field 'text'")
            if record["text"].strip():
                texts.append(record["text"].strip())
    if not texts:
        raise ValueError(f"{source} holds no non-empty 'text'")
    return texts


def blocks(text: str) -> list[str]:
    """The blocks of a document (paragraphs, code examples, list items), verbatim: text between blank lines."""
    return [block.strip("\n") for block in BLOCK_SEPARATOR.split(text) if block.strip()]


def prose(block: str) -> str | None:
    """A prose paragraph (a list item without its bullet) with its whitespace runs turned into single spaces, or None
    for code, tables, headings and the like: a block counts as prose if it does not open like a prompt or a table, has
    at least eight words, ends a sentence, and letters and spaces make at least 85% of it."""
    if any(line.lstrip().startswith(("* ", "- ")) for line in block.split("\n")[1:]):
        return None  # a nested list
    text = " ".join(block.split())
    if text.startswith(("* ", "- ")):
        text = text[2:]
    if text.startswith((">>>", "$", "...", "#", "|", "+", "/*")):
        return None
    if len(text.split()) < 8 or SENTENCE_END.search(text) is None:
        return None
    if sum(char.isalpha() or char == " " for char in text) < 0.85 * len(text):
        return None
    return text


def sentences(paragraph: str) -> list[str]:
    """A prose paragraph cut into sentences (not after the common abbreviations, nor after a number opening it)."""
    result: list[str] = []
    for piece in SENTENCE_BREAK.split(paragraph):
        if result and (result[-1].endswith(ABBREVIATIONS) or ENUMERATOR.fullmatch(result[-1])):
            result[-1] += " " + piece
        else:
            result.append(piece)
    return result


def prose_runs(document: str) -> list[list[list[str]]]:
    """The runs of consecutive prose paragraphs of a document, each paragraph as its sentences."""
    runs: list[list[list[str]]] = [[]]
    for block in blocks(document):
        paragraph = prose(block)
        if paragraph is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(sentences(paragraph))
    return [run for run in runs if run]


def context_before(run: list[list[str]], paragraph: int, sentence: int, max_chars: int, tail: str = "") -> str:
    """The prose of `run` before sentence `sentence` of paragraph `paragraph`, then `tail` (the beginning of that
    sentence) if given, from the earliest sentence start that keeps it within `max_chars` characters (`tail` alone if
    nothing else fits); paragraphs are separated by a blank line."""
    parts = [(paragraph, tail)] if tail else []
    for p in range(paragraph, -1, -1):
        end = sentence if p == paragraph else len(run[p])
        for s in range(end - 1, -1, -1):
            longer = [(p, run[p][s]), *parts]
            if len(_join(longer)) > max_chars:
                return _join(parts)
            parts = longer
    return _join(parts)


def _join(parts: list[tuple[int, str]]) -> str:
    """(paragraph index, sentence) pairs as text: a space within a paragraph, a blank line between paragraphs."""
    return "".join(
        ("" if i == 0 else " " if paragraph == parts[i - 1][0] else "\n\n") + sentence
        for i, (paragraph, sentence) in enumerate(parts)
    )


def perplexity_items(documents: list[str], options: Options) -> list[dict]:
    """Passages of consecutive whole blocks, verbatim, of at most `passage_chars` characters (a longer block is a
    passage of its own), at least 200 characters long; `perplexity_passages` of them."""
    passages = []
    for document in documents:
        current = ""
        for block in blocks(document):
            if current and len(current) + 2 + len(block) > options.passage_chars:
                passages.append(current)
                current = ""
            current = f"{current}\n\n{block}" if current else block
        passages.append(current)
    passages = [passage for passage in passages if len(passage) >= 200]
    random.Random(options.seed).shuffle(passages)
    return [{"text": passage} for passage in passages[: options.perplexity_passages]]


def lastword_items(documents: list[str], options: Options) -> list[dict]:
    """The last word of a prose sentence, after the prose before it, if it already occurs (case-insensitively, as a
    word) in that context and is no English function word ("it", "them", "this", ...: guessable without it)."""
    items = []
    for document in documents:
        for run in prose_runs(document):
            for p, paragraph in enumerate(run):
                for s, sentence in enumerate(paragraph):
                    match = LAST_WORD.search(sentence)
                    if match is None:
                        continue
                    word = match.group(1)
                    if word.lower() in FUNCTION_WORDS:
                        continue
                    context = context_before(run, p, s, options.lastword_context_chars, sentence[: match.start()])
                    if len(context) < options.min_context_chars or len(context) > options.lastword_context_chars:
                        continue
                    if re.search(rf"\b{re.escape(word)}\b", context, re.IGNORECASE) is None:
                        continue
                    items.append({"context": context, "word": word})
    random.Random(options.seed).shuffle(items)
    return items[: options.lastword_items]


def nextsentence_items(documents: list[str], options: Options) -> list[dict]:
    """One item per prose paragraph of two sentences or more: a random sentence of it but the first, after the
    context before it, among three sentences drawn from the other paragraphs of the same document."""
    rng = random.Random(options.seed)
    low, high = options.sentence_chars
    items = []
    for document in documents:
        runs = prose_runs(document)
        pool = sorted(
            {sentence for run in runs for paragraph in run for sentence in paragraph if low <= len(sentence) <= high}
        )
        for run in runs:
            for p, paragraph in enumerate(run):
                candidates = [s for s in range(1, len(paragraph)) if low <= len(paragraph[s]) <= high]
                if not candidates:
                    continue
                s = rng.choice(candidates)
                target = paragraph[s]
                context = context_before(run, p, s, options.nextsentence_context_chars)
                if len(context) < options.min_context_chars:
                    continue
                others = [other for other in pool if other not in paragraph and other not in context]
                if len(others) < 3:
                    continue
                choices = [target, *rng.sample(others, 3)]
                rng.shuffle(choices)
                items.append({"context": context, "choices": choices, "label": choices.index(target)})
    rng.shuffle(items)
    return items[: options.nextsentence_items]


TASKS = {
    "perplexity": (
        perplexity_items,
        """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
process_results: !function utils.perplexity_results
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
""",
    ),
    "lastword": (
        lastword_items,
        """output_type: loglikelihood
doc_to_text: context
doc_to_target: "{{' ' + word}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    ),
    "nextsentence": (
        nextsentence_items,
        """output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""",
    ),
}


def task_config(name: str, task: str, source: str, command: str) -> str:
    """The lm-eval task config of `NAME_task`: its data through `utils.load`, then the task's own fields."""
    return f"""# Built from {source} by:
#   {command}
# (examples/lm_eval/build_tasks.py; do not edit by hand: rebuild)
tag:
  - {name}
task: {name}_{task}
dataset_path: ""
custom_dataset: !function utils.load
dataset_kwargs:
  data_file: data/{name}_{task}.jsonl
test_split: test
{TASKS[task][1]}metadata:
  version: 1.0
"""


def build(source: Path, name: str, out: Path = HERE, options: Options = Options()) -> dict[str, int]:
    """Write `out/data/NAME_TASK.jsonl` and `out/NAME_TASK.yaml` for each task; returns the number of items of each."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"--name {name!r}: use lower-case letters, digits and underscores, starting with a letter")
    documents = read_documents(source)
    try:
        shown = source.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        shown = str(source)
    command = f"python examples/lm_eval/build_tasks.py --source {shown} --name {name}"
    command += "".join(
        f" --{field.replace('_', '-')} {value}"
        for field, value in vars(options).items()
        if value != getattr(Options, field) and field != "sentence_chars"
    )
    written = {}
    outputs = {}
    for task, (make_items, _) in TASKS.items():
        items = make_items(documents, options)
        if not items:
            raise ValueError(f"{source}: no {task} items (is it prose, with paragraphs separated by blank lines?)")
        outputs[out / "data" / f"{name}_{task}.jsonl"] = "".join(
            json.dumps(item, ensure_ascii=False) + "\n" for item in items
        )
        outputs[out / f"{name}_{task}.yaml"] = task_config(name, task, shown, command)
        written[task] = len(items)
    (out / "data").mkdir(parents=True, exist_ok=True)
    for path, content in outputs.items():
        path.write_text(content, encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help="a .jsonl or .jsonl.xz file of held-out documents ('text' field)")
    parser.add_argument("--name", help="task-name prefix and tag, e.g. pydocs (required with --source)")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the task configs and data/ (default: here)")
    for field, default in vars(Options()).items():
        if field != "sentence_chars":
            parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default, help=f"(default: {default})")
    args = parser.parse_args(argv)
    options = Options(**{field: getattr(args, field) for field in vars(Options()) if field != "sentence_chars"})
    if (args.source is None) != (args.name is None):
        parser.error("give --source and --name together, or neither (to rebuild every text in TEXTS)")
    texts = {args.name: args.source} if args.source else {name: ROOT / path for name, path in TEXTS.items()}
    try:
        for name, source in texts.items():
            counts = build(Path(source), name, args.out, options)
            print(f"{name}: " + ", ".join(f"{name}_{task} {count} items" for task, count in counts.items()))
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
