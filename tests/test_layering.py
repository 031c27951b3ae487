"""DESIGN rules on who may import whom, read from the source with `ast` (function-level
imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlsched"


def _imported(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it, as absolute dotted names (for `from a
    import b` both `a` and `a.b`, since b may be a module)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_only_the_cli_imports_the_generate_command():
    command = "rlsched.executor.generate"
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in sorted(PACKAGE.rglob("*.py"))
                 if p != PACKAGE / "cli.py" and p != PACKAGE / "executor" / "generate.py"
                 and any(n == command or n.startswith(command + ".") for n in _imported(p))]
    assert not offenders, f"library modules import the `generate` command's module: {offenders}"
