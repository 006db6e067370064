"""The import rules of docs/architecture.md, read off the code: the model files import only each other, imports inside
the package are relative, and the layers import downward only (model <- loading <- evaluation <- conversion <- commands
<- recipes); and nothing outside a file of the PaTH math (`ops*.py`) reaches its private names."""

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


# The files of the PaTH math, whose knobs are explicit arguments: no other file imports, reads, assigns or
# monkeypatches their private names (`_name`).
OPS_FILES = {name for name in MODEL_FILES if name == "ops" or name.startswith("ops_")}
ROOT = PACKAGE.parent
CHECKED = sorted(
    path
    for folder in ("path_hf", "tests", "lab", "bench", "examples")
    for path in (ROOT / folder).rglob("*.py")
    if "wheels" not in path.parts and path.stem not in OPS_FILES
)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def ops_private_uses(path: Path) -> list[str]:
    """Where `path` reaches a private name of an ops file: `from ...ops_x import _name`, `ops_x._name` (read or
    assigned) and `setattr(ops_x, "_name", ...)` (monkeypatch's too) on a name bound to the module, or
    "path_hf.ops_x._name" in a string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            last = module.rpartition(".")[2]
            if last in OPS_FILES and (node.level or module.startswith("path_hf.")):
                found += [f"{path.name}:{node.lineno} imports {last}.{a.name}" for a in node.names if private(a.name)]
            elif module in ("path_hf", "") or (node.level and not module):
                modules |= {a.asname or a.name for a in node.names if a.name in OPS_FILES}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("path_hf.") and alias.name.rpartition(".")[2] in OPS_FILES and alias.asname:
                    modules.add(alias.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{path.name}:{node.lineno} reaches {base.id}.{node.attr}")
            elif isinstance(base, ast.Attribute) and base.attr in OPS_FILES:
                found.append(f"{path.name}:{node.lineno} reaches {base.attr}.{node.attr}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            target, name = node.args[:2]
            is_setattr = (isinstance(node.func, ast.Name) and node.func.id == "setattr") or (
                isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
            )
            if (
                is_setattr
                and isinstance(target, ast.Name)
                and target.id in modules
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and private(name.value)
            ):
                found.append(f"{path.name}:{node.lineno} sets {target.id}.{name.value}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in re.finditer(r"path_hf\.(ops\w*)\.(_\w+)", node.value):
                if match[1] in OPS_FILES and private(match[2]):
                    found.append(f"{path.name}:{node.lineno} names {match[0]}")
    return found


def test_the_ops_files_are_checked(tmp_path):
    assert {"ops_chunk", "ops_walk", "ops_recurrent"} <= OPS_FILES
    assert {"test_path_attention.py", "passkey_probe.py", "modeling_path_llama.py"} <= {p.name for p in CHECKED}
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from path_hf import ops_walk\nfrom path_hf.ops_chunk import _x, chunk_path_attention\n\n\n"
        "def test(monkeypatch):\n    monkeypatch.setattr(ops_walk, '_y', 0)\n    ops_walk._z = ops_walk.inter_chunk\n"
    )
    assert sorted(ops_private_uses(planted)) == [
        "planted.py:2 imports ops_chunk._x",
        "planted.py:6 sets ops_walk._y",
        "planted.py:7 reaches ops_walk._z",
    ]


@pytest.mark.parametrize("path", CHECKED, ids=lambda path: str(path.relative_to(ROOT)))
def test_nothing_reaches_private_names_of_the_ops_files(path):
    """The torch backend's knobs are keyword arguments with public defaults, and what other files use of the ops files
    is public: no private name of theirs is imported, read, assigned or monkeypatched from outside."""
    assert ops_private_uses(path) == []
