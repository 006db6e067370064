"""The import rules of docs/architecture.md, read off the code: the model files import only each other, imports inside
the package are relative, and the layers import downward only (model <- loading, evaluation <- conversion <- commands
<- recipes)."""

import ast
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
    "ops_recurrent",
}
# What each part may not import (a part is a sub-package, or a flat module of path_hf).
FORBIDDEN = {
    "loading": {"conversion", "evaluation", "recipes", "commands", "cli"},
    "evaluation": {"conversion", "recipes", "commands", "cli", "loading"},
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
    assert any(target == "path_hf.loading" for _, target, _ in imports(PACKAGE / "commands" / "eval.py"))


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
