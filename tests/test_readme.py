# Copyright 2026 The path-hf authors. Apache-2.0.
"""The README is a user's page: short, its demo table made from docs/demo/demo.json, and every link in it and in
docs/ leads to a file of the repository."""

import json
import re
from pathlib import Path

import pytest

from path_hf.commands.eval import format_table

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short_and_its_demo_table_is_the_published_one():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    table, caption = format_table(json.loads((ROOT / "docs" / "demo" / "demo.json").read_text())["evaluation"]).rsplit(
        "\n", 1
    )
    assert f"{table}\n\n{caption}" in readme


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_lead_to_files_of_the_repository(page):
    path = ROOT / page
    targets = [t for t in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", t)]
    missing = [t for t in targets if not (path.parent / t).exists()]
    assert not missing, f"{page} links to missing files: {missing}"
