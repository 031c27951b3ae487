"""The code's shape: short modules, small classes, short functions.

Walks every module of rlsched/ with `ast`; each failure lists the offenders.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "rlsched"
MAX_MODULE_LINES = 500
MAX_CLASS_METHODS = 25
MAX_FUNCTION_LINES = 80


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        yield path.relative_to(ROOT.parent), text, ast.parse(text)


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _classes(tree):
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def test_every_module_is_under_500_lines():
    offenders = [
        f"{path}: {len(text.splitlines())} lines"
        for path, text, _ in _modules()
        if len(text.splitlines()) >= MAX_MODULE_LINES
    ]
    assert not offenders, f"modules of {MAX_MODULE_LINES} lines or more:\n" + "\n".join(offenders)


def test_every_class_has_fewer_than_25_methods():
    offenders = []
    for path, _, tree in _modules():
        for cls in _classes(tree):
            methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            if len(methods) >= MAX_CLASS_METHODS:
                offenders.append(f"{path}:{cls.lineno} {cls.name}: {len(methods)} methods")
    assert not offenders, f"classes with {MAX_CLASS_METHODS} methods or more:\n" + "\n".join(offenders)


def test_every_function_is_at_most_80_lines():
    offenders = []
    for path, _, tree in _modules():
        for fn in _functions(tree):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                offenders.append(f"{path}:{fn.lineno} {fn.name}: {lines} lines")
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)
