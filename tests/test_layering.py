"""DESIGN rules on who may import whom, read from the source with `ast`. Every import counts,
those inside functions too: a lazy import still makes a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlsched"


def _module(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of the module at `path` in the package `root` (a package is its `__init__`)."""
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def _package_of(path: Path, root: Path = PACKAGE) -> str:
    """The package a module belongs to (a package's `__init__` belongs to the package itself)."""
    module = _module(path, root)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _add_import(node, package: str, names: set[str]) -> None:
    """The absolute names an import statement in `package` brings in, added to `names` (for
    `from a import b` both `a` and `a.b`, since b may be a module)."""
    if isinstance(node, ast.Import):
        names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        names.add(base)
        names.update(f"{base}.{a.name}" for a in node.names)


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(path: Path, root: Path = PACKAGE, *, type_checking: bool = True) -> set[str]:
    """Every module `path` imports, anywhere in it (function bodies included), as absolute
    dotted names; `if TYPE_CHECKING:` blocks only when `type_checking`."""
    package = _package_of(path, root)
    names: set[str] = set()

    def visit(node):
        if _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        _add_import(node, package, names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def _module_level_imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """What importing `path` imports at once: top-level import statements, including those
    in top-level try/if blocks, but not `if TYPE_CHECKING:` blocks or function bodies."""
    package = _package_of(path, root)
    names: set[str] = set()

    def visit(body):
        for node in body:
            if _is_type_checking(node):
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


def _files(root: Path = PACKAGE) -> dict[str, Path]:
    return {_module(p, root): p for p in sorted(root.rglob("*.py"))}


def _module_graph(root: Path = PACKAGE, *, lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports: at module level only, or (`lazy`) anywhere
    in it except `if TYPE_CHECKING:` blocks, which never run."""
    files = _files(root)

    def imports(p: Path) -> set[str]:
        return _imported(p, root, type_checking=False) if lazy else _module_level_imports(p, root)

    return {m: {n for n in imports(p) if n in files and n != m} for m, p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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


def cross_package_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """The import cycles, counting imports anywhere in a module (not `if TYPE_CHECKING:`),
    whose modules sit in more than one package. Two modules of one package may import each
    other lazily; packages may not."""
    files = _files(root)
    return [
        comp for comp in _cycles(_module_graph(root, lazy=True)) if len({_package_of(files[m], root) for m in comp}) > 1
    ]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _offenders(importers: str, banned: tuple[str, ...], exempt: tuple[str, ...] = ()) -> list[str]:
    """'module imports name' for each import, anywhere in a module of `importers` (and not in
    `exempt`), of a module within one of `banned`."""
    return sorted(
        f"{m} imports {n}"
        for m, p in _files().items()
        if _within(m, importers) and not any(_within(m, e) for e in exempt)
        for n in _imported(p)
        if any(_within(n, b) for b in banned)
    )


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_fails_on_a_planted_lazy_cycle(tmp_path):
    """Two packages whose modules import each other only inside functions: a cycle the
    module-level graph misses and the checker reports; the same within one package is allowed,
    and so is a cycle closed only under `if TYPE_CHECKING:`."""
    root = tmp_path / "fake"
    for folder in (root, root / "a", root / "b"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (root / "a" / "one.py").write_text("def f():\n    from fake.b import two\n\n    return two\n")
    (root / "b" / "two.py").write_text("def g():\n    from ..a.one import f\n\n    return f\n")
    (root / "a" / "three.py").write_text("def h():\n    from fake.a import four\n")
    (root / "a" / "four.py").write_text("def i():\n    from . import three\n")
    (root / "b" / "five.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from fake.a import six\n"
    )
    (root / "a" / "six.py").write_text("def j():\n    from fake.b import five\n")
    assert not _cycles(_module_graph(root))
    assert cross_package_cycles(root) == [["fake.a.one", "fake.b.two"]]


def test_no_import_cycle_between_packages():
    """No cycle through modules of different packages, lazy imports included (`if
    TYPE_CHECKING:` blocks excluded: they never run)."""
    assert not cross_package_cycles(), "import cycles across packages"


def test_no_module_level_import_cycles():
    """Importing any module never re-enters one half-initialised: no cycle among module-level
    imports (imports inside functions and `if TYPE_CHECKING:` blocks do not count)."""
    assert not _cycles(_module_graph())


def test_analysis_and_executor_never_import_each_other():
    assert not _offenders("rlsched.analysis", ("rlsched.executor",))
    assert not _offenders("rlsched.executor", ("rlsched.analysis",))


def test_nothing_imports_a_command_module():
    """Commands sit on top: no library module imports `rlsched.cli` (only the entry point
    `python -m rlsched` does), and only the CLI imports the `generate` command's module."""
    assert not _offenders("rlsched", ("rlsched.cli",), exempt=("rlsched.cli", "rlsched.__main__"))
    command = ("rlsched.executor.generate",)
    assert not _offenders("rlsched", command, exempt=("rlsched.cli", *command))


# package -> the packages it never imports (the simulator runs without analysis or the executor;
# cost models are priced alike by the simulator and the executor; policies are the shared contract)
NEVER_IMPORTS = {
    "rlsched.sim": ("rlsched.analysis", "rlsched.executor"),
    "rlsched.costs": ("rlsched.analysis", "rlsched.sim", "rlsched.executor"),
    "rlsched.policies": ("rlsched.sim", "rlsched.costs", "rlsched.analysis", "rlsched.executor"),
    "rlsched.plan": ("rlsched.executor",),  # plans without torch, from the simulator and its cost models
}


@pytest.mark.parametrize("package", sorted(NEVER_IMPORTS))
def test_no_upward_imports(package):
    assert any(_within(m, package) for m in _files()), f"no modules found for {package}"
    offenders = _offenders(package, NEVER_IMPORTS[package])
    assert not offenders, f"{package} imports a package it must not: {offenders}"


def test_importing_costs_loads_neither_torch_nor_matplotlib():
    code = (
        "import sys, rlsched.costs; "
        "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('torch', 'matplotlib'))[:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:] or out.stdout
