"""The house's shape (issue 42): no function over 60 lines, no module much over 500, so each stays one thing a
reader can hold. A function or module that outgrows these is split by concern, not squeezed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lmserve"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 510


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """("module.py:line name", lines) for every function and method of a module."""
    where = path.relative_to(PACKAGE)
    return [(f"{where}:{node.lineno} {node.name}", (node.end_lineno or node.lineno) - node.lineno + 1)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_function_is_over_60_lines() -> None:
    long = [(name, lines) for path in MODULES for name, lines in function_lengths(path) if lines > MAX_FUNCTION_LINES]
    assert long == []


def test_no_module_is_much_over_500_lines() -> None:
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in MODULES}
    assert {name: lines for name, lines in lengths.items() if lines > MAX_MODULE_LINES} == {}
