# Copyright 2026 The path-hf authors. Apache-2.0.
"""The wheel holds every file the package reads: each non-Python file under path_hf/ is named by pyproject.toml's
package-data (setuptools leaves out what it does not name)."""

import fnmatch
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_data_file_of_the_package_is_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    tracked = subprocess.run(["git", "ls-files", "path_hf"], cwd=ROOT, capture_output=True, text=True, check=True)
    data_files = [Path(name) for name in tracked.stdout.split() if not name.endswith((".py", ".md"))]
    assert data_files, "path_hf holds no data file: this test checks nothing"
    missing = [
        str(path)
        for path in data_files
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in package_data.get(".".join(path.parent.parts), []))
    ]
    assert not missing, f"not in [tool.setuptools.package-data], so not in the wheel: {missing}"
