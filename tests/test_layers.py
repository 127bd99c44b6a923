"""The dependency direction of DESIGN.md, checked on every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lmserve"
BASE = {"lmserve.types", "lmserve.errors", "lmserve.config", "lmserve.options", "lmserve.parsing"}
SEAM = {"lmserve.engine.protocol", "lmserve.engine.factory"}
"""What the service may know of engines: the protocol, and the factory that picks one (and quantizes GGUFs)."""

# module prefix → the lmserve modules it may import (besides itself and its own subpackage)
ALLOWED: dict[str, set[str]] = {
    "lmserve.types": set(),
    "lmserve.errors": set(),
    "lmserve.parsing": {"lmserve.errors", "lmserve.types"},
    "lmserve.options": {"lmserve.types", "lmserve.errors"},
    "lmserve.config": {"lmserve.types", "lmserve.errors", "lmserve.parsing"},
    "lmserve.engine": BASE,
    "lmserve.store": BASE,
    "lmserve.chat": {"lmserve.types", "lmserve.errors"},
    "lmserve.service": BASE | SEAM | {"lmserve.store", "lmserve.chat"},
    "lmserve.api": BASE | {"lmserve.service", "lmserve.store", "lmserve.chat.structured", "lmserve.chat.media"},
    "lmserve.client": BASE,
    "lmserve.repl": BASE | {"lmserve.client"},
    "lmserve.listening": set(),
    "lmserve.supervisor": BASE | {"lmserve.listening", "lmserve.store.load_crashes"},
    "lmserve.cli": BASE | {"lmserve.client", "lmserve.repl", "lmserve.server", "lmserve.listening",
                           "lmserve.supervisor"},
}
"""lmserve.server (the composition root) and __main__ may import anything."""
FORBIDDEN_THIRD_PARTY = {"lmserve.engine": {"fastapi", "starlette", "pydantic", "uvicorn"},
                         "lmserve.store": {"fastapi", "starlette", "uvicorn"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def owner(module: str) -> str | None:
    return max((p for p in ALLOWED if module == p or module.startswith(p + ".")), key=len, default=None)


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_dependency_direction(path: Path) -> None:
    name = module_name(path)
    layer = owner(name)
    if layer is None:  # server, __main__: the composition roots may import anything
        assert name in ("lmserve.server", "lmserve.__main__", "lmserve"), f"{name} belongs to no layer"
        return
    for imported in imports(path):
        top = imported.split(".")[0]
        assert top not in FORBIDDEN_THIRD_PARTY.get(layer, set()), f"{name} imports {imported}"
        if top != "lmserve" or imported == "lmserve":  # the package root holds only __version__
            continue
        target = owner(imported) or imported
        allowed = ALLOWED[layer] | {layer}
        assert any(m == a or m.startswith(a + ".") for a in allowed for m in (target, imported)), (
            f"{name} must not import {imported}"
        )
