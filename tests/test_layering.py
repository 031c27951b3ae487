"""DESIGN rules on who may import whom, read from the source with `ast` (function-level
imports included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlsched"


def _imported(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it, as absolute dotted names (for `from a
    import b` both `a` and `a.b`, since b may be a module)."""
    package = _package_of(path)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        _add_import(node, package, names)
    return names


def _package_of(path: Path) -> str:
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _add_import(node, package: str, names: set[str]) -> None:
    """The absolute names an import statement in `package` brings in, added to `names`."""
    if isinstance(node, ast.Import):
        names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        names.add(base)
        names.update(f"{base}.{a.name}" for a in node.names)


def test_only_the_cli_imports_the_generate_command():
    command = "rlsched.executor.generate"
    offenders = [
        str(p.relative_to(PACKAGE.parent))
        for p in sorted(PACKAGE.rglob("*.py"))
        if not _within(_module(p), "rlsched.cli")
        and p != PACKAGE / "executor" / "generate.py"
        and any(n == command or n.startswith(command + ".") for n in _imported(p))
    ]
    assert not offenders, f"library modules import the `generate` command's module: {offenders}"


# package -> the packages it never imports (the simulator runs without analysis or the executor;
# cost models are priced alike by the simulator and the executor; policies are the shared contract)
NEVER_IMPORTS = {
    "rlsched.sim": ("rlsched.analysis", "rlsched.executor"),
    "rlsched.costs": ("rlsched.analysis", "rlsched.sim", "rlsched.executor"),
    "rlsched.policies": ("rlsched.sim", "rlsched.costs", "rlsched.analysis", "rlsched.executor"),
    "rlsched.plan": ("rlsched.executor",),  # plans without torch, from the simulator and its cost models
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package", sorted(NEVER_IMPORTS))
def test_no_upward_imports(package):
    files = [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if _within(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts), package)
    ]
    assert files, f"no modules found for {package}"
    offenders = sorted(
        f"{p.relative_to(PACKAGE.parent)} imports {n}"
        for p in files
        for n in _imported(p)
        if any(_within(n, banned) for banned in NEVER_IMPORTS[package])
    )
    assert not offenders, f"{package} imports a package it must not: {offenders}"


def test_importing_costs_loads_neither_torch_nor_matplotlib():
    code = (
        "import sys, rlsched.costs; "
        "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('torch', 'matplotlib'))[:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:] or out.stdout


def _module_level_imports(path: Path) -> set[str]:
    """What importing `path` imports at once: top-level import statements, including those
    in top-level try/if blocks, but not `if TYPE_CHECKING:` blocks or function bodies."""
    package = _package_of(path)
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
            else:
                _add_import(node, package, names)

    visit(ast.parse(path.read_text(), str(path)).body)
    return names


def _module_graph() -> dict[str, set[str]]:
    files = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    return {m: {n for n in _module_level_imports(p) if n in files and n != m} for m, p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycles():
    """Importing any module never re-enters one half-initialised: no cycle among module-level
    imports (imports inside functions and `if TYPE_CHECKING:` blocks do not count)."""
    assert not _cycles(_module_graph())


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
