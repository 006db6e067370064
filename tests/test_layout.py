"""The import rules of docs/architecture.md, read off the code: the model files import only each other, imports inside
the package are relative, and the layers import downward only (model <- loading <- evaluation <- conversion <- commands
<- recipes); and nothing outside a module of path_hf (another module, a test, a benchmark, the lab, an example)
reaches its private names."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "path_hf"
MODEL_FILES = {
    "configuration_path_llama",
    "modeling_path_llama",
    "cache_path_llama",
    "local_attention",
    "ops",
    "ops_chunk",
    "ops_inputs",
    "ops_transform",
    "ops_walk",
    "ops_superblock",
    "ops_key_cache",
    "ops_recurrent",
}
# What each part may not import (a part is a sub-package, or a flat module of path_hf).
FORBIDDEN = {
    "loading": {"conversion", "evaluation", "recipes", "commands", "cli"},
    "evaluation": {"conversion", "recipes", "commands", "cli"},
    "conversion": {"recipes", "commands", "cli"},
    "commands": {"recipes", "cli"},
    "arguments": {"conversion", "evaluation", "recipes", "commands", "cli", "loading"},
    "errors": {"conversion", "evaluation", "recipes", "commands", "cli", "loading"},
    "atomic": {"conversion", "evaluation", "recipes", "commands", "cli", "loading"},
    "serving": {"conversion", "evaluation", "recipes", "commands", "cli"},
}


def part_of(module: str) -> str:
    """`path_hf.conversion.plan` -> `conversion`; `path_hf.ops` -> `ops`; `path_hf` -> `path_hf`."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """The path_hf modules that `path` imports: (line, absolute module name, written relatively)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [target] if node.module else [f"{target}.{alias.name}" for alias in node.names]
                found += [(node.lineno, t, True) for t in targets]
            elif node.module and node.module.split(".")[0] == "path_hf":
                found.append((node.lineno, node.module, False))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, False) for a in node.names if a.name.split(".")[0] == "path_hf"]
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_read():
    assert {"loading.py", "cli.py", "modeling_path_llama.py"} <= {path.name for path in SOURCES}
    assert any(target == "path_hf.loading" for _, target, _ in imports(PACKAGE / "evaluation" / "run.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_imports_follow_the_layout(path):
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    part = part_of(name)
    for line, target, relative in imports(path):
        where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        # `import path_hf` registers the model with the Auto classes: the package itself, nothing inside it.
        assert relative or target == "path_hf", f"{where}: inside the package, imports are relative"
        if part in MODEL_FILES:
            assert part_of(target) in MODEL_FILES, f"{where}: a model file imports only the model files"
        assert part_of(target) not in FORBIDDEN.get(part, ()), f"{where}: {part} may not import it"


# No file reaches another module's private names (`_name`): what a module of path_hf offers the other modules, the
# tests, the benchmarks, the lab and the examples is public, and a knob a test or a benchmark turns is an explicit
# argument or a public setting. A module's own private names are its own; third-party private names are out of scope.
ROOT = PACKAGE.parent
CHECKED = sorted(
    path
    for folder in ("path_hf", "tests", "lab", "bench", "examples")
    for path in (ROOT / folder).rglob("*.py")
    if "wheels" not in path.parts and path != Path(__file__).resolve()  # this file plants violations to find
)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_module(name: str) -> bool:
    """Whether `name` (`path_hf.evaluation.scoring`) is a module or a package of path_hf."""
    parts = name.split(".")
    if parts[0] != "path_hf" or not all(part.isidentifier() for part in parts):
        return False
    where = ROOT.joinpath(*parts)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def module_of(path: Path) -> str | None:
    """`path_hf/evaluation/scoring.py` -> `path_hf.evaluation.scoring`; `path_hf/evaluation/__init__.py` ->
    `path_hf.evaluation`; None outside the package."""
    if PACKAGE not in path.parents:
        return None
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if path.name == "__init__.py" else parts)


def dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None for anything but a name and its attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else [*base, node.attr]
    return None


def private_uses(path: Path, text: str | None = None, script_line: int | None = None) -> list[str]:
    """Where `path` reaches a private name of another path_hf module: `from ...x import _name`, `x._name` (read or
    assigned) and `setattr(x, "_name", ...)` (monkeypatch's too) on a name or an attribute chain bound to the module
    (`import path_hf.x as x`, `from path_hf import x`, `from . import x`, `import path_hf.x`), or "path_hf.x._name" in
    a string. A string that is a script importing path_hf (one a test runs in a subprocess) is read the same way, as
    `text` found at `script_line` of `path`. `text` is what `path` holds unless given. A module's own private names
    are its own."""
    own = module_of(path)
    package = None if own is None else (own if path.name == "__init__.py" else own.rpartition(".")[0])
    tree = ast.parse(path.read_text() if text is None else text, filename=str(path))
    at = f"{path.name}:" if script_line is None else f"{path.name}:{script_line} script:"
    modules, found = {}, []

    def imported(node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        if package is None or script_line is not None:  # a script is not in the package
            return None
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def bound(node: ast.expr) -> str | None:
        """The path_hf module that a name or an attribute chain is bound to, if any."""
        names = dotted(node)
        if not names or names[0] not in modules:
            return None
        name = ".".join([modules[names[0]], *names[1:]])
        return name if is_module(name) and name != own else None

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = imported(node)
            if target is None or not is_module(target):
                continue
            for alias in node.names:
                if is_module(f"{target}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{target}.{alias.name}"
                if private(alias.name) and target != own:
                    found.append(f"{at}{node.lineno} imports {target}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if is_module(alias.name):
                    name = alias.name if alias.asname else alias.name.partition(".")[0]
                    modules[alias.asname or name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and (module := bound(node.value)):
            found.append(f"{at}{node.lineno} reaches {module}.{node.attr}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            target, name = node.args[:2]
            is_setattr = (isinstance(node.func, ast.Name) and node.func.id == "setattr") or (
                isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
            )
            if (
                is_setattr
                and (module := bound(target))
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and private(name.value)
            ):
                found.append(f"{at}{node.lineno} sets {module}.{name.value}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in re.finditer(r"\bpath_hf((?:\.\w+)*)\.(_\w+)", node.value):
                module = f"path_hf{match[1]}"
                if private(match[2]) and is_module(module) and module != own:
                    found.append(f"{at}{node.lineno} names {match[0]}")
            if "\n" in node.value and re.search(r"^\s*(from|import) path_hf\b", node.value, re.MULTILINE):
                try:
                    ast.parse(node.value)
                except SyntaxError:
                    continue
                found += private_uses(path, node.value, node.lineno)
    return found


PLANTED = '''import path_hf.conversion.verify
import path_hf.local_attention as local
from path_hf import ops_walk
from path_hf.ops_chunk import _x, chunk_path_attention
from path_hf.evaluation import scoring
from path_hf.evaluation.needles import _place, passkey_trials


def test(monkeypatch):
    monkeypatch.setattr(ops_walk, "_y", 0)
    ops_walk._z = ops_walk.inter_chunk
    local._w = scoring._v(path_hf.conversion.verify._u)
    monkeypatch.setattr(scoring, "_t", 1)
    monkeypatch.setattr("path_hf.recipes.checkpoints._s", 2)
    return scoring.__doc__, passkey_trials._r, chunk_path_attention, _x, _place


SCRIPT = """
from path_hf.recipes import checkpoints

checkpoints._q = None
"""
'''


def test_private_names_are_checked(tmp_path):
    """The rule finds each way of reaching a private name, of an ops file and of any other module, inside the
    package (relative imports) as outside it, and leaves a module's own names alone."""
    assert {"test_path_attention.py", "passkey_probe.py", "modeling_path_llama.py", "scoring.py", "ops_walk.py"} <= {
        path.name for path in CHECKED
    }
    assert module_of(PACKAGE / "evaluation" / "__init__.py") == "path_hf.evaluation"
    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED)
    assert sorted(private_uses(planted)) == [
        "planted.py:10 sets path_hf.ops_walk._y",
        "planted.py:11 reaches path_hf.ops_walk._z",
        "planted.py:12 reaches path_hf.conversion.verify._u",
        "planted.py:12 reaches path_hf.evaluation.scoring._v",
        "planted.py:12 reaches path_hf.local_attention._w",
        "planted.py:13 sets path_hf.evaluation.scoring._t",
        "planted.py:14 names path_hf.recipes.checkpoints._s",
        "planted.py:18 script:4 reaches path_hf.recipes.checkpoints._q",
        "planted.py:4 imports path_hf.ops_chunk._x",
        "planted.py:6 imports path_hf.evaluation.needles._place",
    ]
    # A module of the package, planted in place of needles.py: relative imports resolve from where it lies, and its own
    # private names are its own.
    inside = (
        "from . import scoring\nfrom .scoring import _head, eval_mode\nfrom ..recipes import checkpoints\n"
        "from .needles import _own\nfrom .. import local_attention as local\n\n"
        "print(scoring._a, checkpoints._b, local._c, _own, _head, eval_mode)\n"
    )
    assert sorted(private_uses(PACKAGE / "evaluation" / "needles.py", inside)) == [
        "needles.py:2 imports path_hf.evaluation.scoring._head",
        "needles.py:7 reaches path_hf.evaluation.scoring._a",
        "needles.py:7 reaches path_hf.local_attention._c",
        "needles.py:7 reaches path_hf.recipes.checkpoints._b",
    ]
    assert private_uses(PACKAGE / "evaluation" / "scoring.py", "from . import scoring\n\nscoring._own\n") == []


@pytest.mark.parametrize("path", CHECKED, ids=lambda path: str(path.relative_to(ROOT)))
def test_nothing_reaches_private_names_of_another_module(path):
    """The torch backend's knobs are keyword arguments with public defaults, and what a file uses of a path_hf module
    other than itself is public: no private name of another module is imported, read, assigned or monkeypatched."""
    assert private_uses(path) == []
