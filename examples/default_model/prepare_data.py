"""Build the default model's corpus from the Python documentation's reStructuredText sources.

Source: Debian's ``python3.11-doc`` package (``apt-get install python3.11-doc``), the files
``/usr/share/doc/python3.11-doc/html/_sources/**/*.rst.txt``, under the PSF licence (copied next to the data).

Each file becomes one document. A light cleanup turns the markup into plain text: labels, comments, index
entries, toctrees and other non-prose directives are dropped, roles (``:func:`len```) and inline literals keep
their text, section under/overlines go, and a directive such as ``.. function:: len(s)`` keeps its signature.
Code examples stay. Documents go to the held-out eval split when the SHA-256 of their relative path, modulo 100,
is below ``--eval-percent`` (5 by default), so the split does not depend on the order of the files.

Writes ``data/train.jsonl.xz`` and ``data/eval.jsonl.xz`` (one ``{"path", "text"}`` record per line, sorted by
path), ``data/LICENSE-PSF.txt`` and ``data/SOURCE.txt``. The output is byte-for-byte deterministic.

    python examples/default_model/prepare_data.py
"""

import argparse
import hashlib
import json
import lzma
import re
import shutil
import subprocess
from pathlib import Path

DOC_DIR = Path("/usr/share/doc/python3.11-doc")
HERE = Path(__file__).resolve().parent

# Directives whose line and indented body are dropped: navigation, metadata, tables of grammar, test scaffolding.
DROP_DIRECTIVES = {
    "index",
    "toctree",
    "highlight",
    "sectionauthor",
    "moduleauthor",
    "currentmodule",
    "include",
    "literalinclude",
    "image",
    "figure",
    "raw",
    "tabularcolumns",
    "productionlist",
    "testsetup",
    "testcleanup",
    "contents",
    "only",
    "audit-event",
    "program",
    "csv-table",
}
DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
LABEL = re.compile(r"^\s*\.\.\s+_[^:]*:.*$")
SUBSTITUTION_DEF = re.compile(r"^\s*\.\.\s+\|[^|]+\|\s+\S+::.*$")
COMMENT = re.compile(r"^(\s*)\.\.(\s.*)?$")
OPTION = re.compile(r"^\s+:[\w-]+:(\s.*)?$")
ADORNMENT = re.compile(r"^([=\-`:'\"~^_*+#<>.])\1{2,}\s*$")
ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
TARGET = re.compile(r"^(.*?)\s*<[^<>]+>$")
LITERAL = re.compile(r"``([^`]+)``")
STRONG = re.compile(r"\*\*([^*]+)\*\*")
LINK = re.compile(r"`([^`<]*?)\s*<[^`>]+>`_{1,2}")
REFERENCE = re.compile(r"`([^`]+)`_{1,2}")
VERSION_NOTES = {
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}.",
    "deprecated": "Deprecated since version {}.",
    "deprecated-removed": "Deprecated since version {}.",
}


def role_text(match: re.Match) -> str:
    """The visible text of a role: ``:func:`len``` -> ``len``, ``:ref:`title <label>``` -> ``title``."""
    text = match.group(1)
    target = TARGET.match(text)
    if target and target.group(1):
        text = target.group(1)
    return text.lstrip("!~")


def inline(line: str) -> str:
    """Strip inline markup from one line."""
    line = ROLE.sub(role_text, line)
    line = LINK.sub(lambda m: m.group(1), line)
    line = REFERENCE.sub(lambda m: m.group(1), line)
    line = LITERAL.sub(lambda m: m.group(1), line)
    line = STRONG.sub(lambda m: m.group(1), line)
    line = line.replace("|version|", "3.11").replace("|release|", "3.11")
    if line.rstrip().endswith("::"):
        line = line.rstrip()[:-1]
        line = "" if line.strip() == ":" else line
    return line


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def clean_rst(source: str) -> str:
    """Turn one reStructuredText file into plain text (see the module docstring)."""
    lines = source.expandtabs(8).splitlines()
    out: list[str] = []
    skip_deeper_than: int | None = None  # drop lines indented more than this (a dropped block's body)
    in_options = False  # just after a directive line: its ":option:" lines follow
    for line in lines:
        if skip_deeper_than is not None:
            if not line.strip() or indent_of(line) > skip_deeper_than:
                continue
            skip_deeper_than = None
        if in_options and OPTION.match(line):
            continue
        in_options = False
        if LABEL.match(line) or SUBSTITUTION_DEF.match(line) or ADORNMENT.match(line):
            continue
        directive = DIRECTIVE.match(line)
        if directive:
            indent, name, args = directive.groups()
            name = name.split(":")[-1]
            if name in DROP_DIRECTIVES:
                skip_deeper_than = len(indent)
                continue
            in_options = True
            if name in VERSION_NOTES and args:
                out.append(indent + VERSION_NOTES[name].format(args.split()[0]))
            elif args and name not in {"code-block", "sourcecode", "doctest", "testcode", "testoutput"}:
                out.append(indent + inline(args))
            continue
        if COMMENT.match(line):
            skip_deeper_than = indent_of(line)
            continue
        out.append(inline(line).rstrip())
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def is_eval(relative_path: str, eval_percent: int) -> bool:
    """The split, fixed by the path: SHA-256 of the relative path modulo 100 below ``eval_percent``."""
    return int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100 < eval_percent


def write_jsonl_xz(path: Path, records: list[dict[str, str]]) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    path.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))


def package_version() -> str:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", "python3.11-doc"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc-dir", type=Path, default=DOC_DIR, help="installed python3.11-doc")
    parser.add_argument("--out-dir", type=Path, default=HERE / "data")
    parser.add_argument("--eval-percent", type=int, default=5)
    args = parser.parse_args()

    sources = args.doc_dir / "html" / "_sources"
    if not sources.is_dir():
        raise SystemExit(f"{sources} not found: apt-get install python3.11-doc")
    files = sorted(sources.rglob("*.rst.txt"))
    splits: dict[str, list[dict[str, str]]] = {"train": [], "eval": []}
    for file in files:
        relative = file.relative_to(sources).as_posix()
        text = clean_rst(file.read_text(encoding="utf-8"))
        if len(text) < 200:  # stubs: a title and a toctree
            continue
        splits["eval" if is_eval(relative, args.eval_percent) else "train"].append({"path": relative, "text": text})

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in splits.items():
        write_jsonl_xz(args.out_dir / f"{name}.jsonl.xz", records)
        chars = sum(len(r["text"]) for r in records)
        print(f"{name}: {len(records)} documents, {chars:,} characters")
    shutil.copyfile(args.doc_dir / "copyright", args.out_dir / "LICENSE-PSF.txt")
    (args.out_dir / "SOURCE.txt").write_text(
        f"Source: Debian package python3.11-doc, version {package_version()}\n"
        f"Files: {sources}/**/*.rst.txt ({len(files)} files)\n"
        "Licence: PSF License Agreement and the other notices in LICENSE-PSF.txt (the package's copyright file)\n"
        "Built by: python examples/default_model/prepare_data.py "
        f"(cleanup of the markup, split by SHA-256 of the path, {args.eval_percent}% held out)\n"
    )


if __name__ == "__main__":
    main()
