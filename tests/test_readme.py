# Copyright 2026 The path-hf authors. Apache-2.0.
"""The README is a user's page: short, its demo table made from docs/demo/demo.json, and every relative link in it, in
BENCHMARKS.md and in the Markdown under docs/, lab/, examples/, recipes/, bench/ and conversion/ leads to a file of the
repository (a study's raw data moved between docs/ and lab/ without its links rewritten fails here)."""

import json
import re
from pathlib import Path

import pytest

from path_hf.evaluation import format_table

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short_and_its_demo_table_is_the_published_one():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    table, caption = format_table(json.loads((ROOT / "docs" / "demo" / "demo.json").read_text())["evaluation"]).rsplit(
        "\n", 1
    )
    assert f"{table}\n\n{caption}" in readme


FOLDERS = ("docs", "lab", "examples", "recipes", "bench", "conversion")
IGNORED = ("lab/gpu/wheels", "lab/gpu/carry", "bench/out")  # .gitignore'd outputs


def pages() -> list[str]:
    found = {str(p.relative_to(ROOT)) for folder in FOLDERS for p in (ROOT / folder).rglob("*.md")}
    return ["README.md", "BENCHMARKS.md", *sorted(p for p in found if not p.startswith(IGNORED))]


def missing_links(path: Path) -> list[str]:
    targets = [t for t in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", t)]
    return [t for t in targets if not (path.parent / t).exists()]


def test_the_link_check_reaches_docs_and_lab_and_finds_a_broken_link(tmp_path):
    found = pages()
    for page in ("docs/results.md", "docs/smollm2/long-context/README.md", "lab/README.md"):
        assert page in found
    assert any(p.startswith("lab/smollm2/") for p in found)
    page = tmp_path / "docs" / "report.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "kept.json").write_text("{}")
    page.write_text("[kept](kept.json), [a section](#x), [web](https://x.org/a.json), [moved](screens/moved.json#x)\n")
    assert missing_links(page) == ["screens/moved.json"]


@pytest.mark.parametrize("page", pages())
def test_relative_links_lead_to_files_of_the_repository(page):
    missing = missing_links(ROOT / page)
    assert not missing, f"{page} links to missing files: {missing}"
