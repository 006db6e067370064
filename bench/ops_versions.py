"""path_hf.ops as it was at an earlier commit, for benchmarks that time it against the current one in the same run."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from types import ModuleType

from transformers.dynamic_module_utils import get_relative_imports

ROOT = Path(__file__).resolve().parents[1]


@cache
def load_ops_at(commit: str) -> ModuleType:
    """path_hf.ops as it was at `commit`: ops.py and the files it imports relatively, whichever that commit has (one
    file at older commits, several at newer ones), read with `git show`, written to a package of their own and imported
    from there."""
    package = "ops_at_" + re.sub(r"\W", "_", commit)
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory) / package
        folder.mkdir()
        (folder / "__init__.py").touch()
        pending = ["ops"]
        while pending:
            file = folder / f"{pending.pop()}.py"
            if not file.exists():
                show = ["git", "show", f"{commit}:path_hf/{file.name}"]
                file.write_text(subprocess.run(show, cwd=ROOT, check=True, capture_output=True, text=True).stdout)
                pending += get_relative_imports(file)
        # The package from its folder, not through sys.path; the files import all they need now: the folder may go.
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        sys.modules[package] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[package])
        return importlib.import_module(f"{package}.ops")
