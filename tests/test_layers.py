"""The dependency direction of DESIGN.md, checked on every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lmserve"
BASE = {"lmserve.types", "lmserve.errors", "lmserve.config", "lmserve.options", "lmserve.parsing",
        "lmserve.option_table"}
SEAM = {"lmserve.engine.protocol", "lmserve.engine.factory"}
"""What the service may know of engines: the protocol, and the factory that picks one (and quantizes GGUFs)."""

DIALECT_NAMES = ("openai", "native", "anthropic", "responses")
DIALECT = BASE | {"lmserve.service", "lmserve.store", "lmserve.chat.structured", "lmserve.chat.media",
                  "lmserve.chat.audio", "lmserve.dialects.shared"}
"""What a dialect may import: the service, the store's records, structured output, images and audio, the shared
helpers."""

# module prefix → the lmserve modules it may import (besides itself and its own subpackage)
ALLOWED: dict[str, set[str]] = {
    "lmserve.types": set(),
    "lmserve.errors": set(),
    "lmserve.parsing": {"lmserve.errors", "lmserve.types"},
    "lmserve.options": {"lmserve.types", "lmserve.errors"},
    "lmserve.option_table": {"lmserve.parsing"},
    "lmserve.config": {"lmserve.types", "lmserve.errors", "lmserve.parsing", "lmserve.option_table",
                       "lmserve.engine.registry"},
    # an engine reads the files a request names (LoRA adapters) through the store's checked GGUF readers, never raw
    "lmserve.engine": BASE | {"lmserve.store.gguf_check", "lmserve.store.lora",
                       "lmserve.store.safetensors_header"},
    "lmserve.store": BASE,
    "lmserve.chat": {"lmserve.types", "lmserve.errors"},
    "lmserve.service": BASE | SEAM | {"lmserve.store", "lmserve.chat"},
    # a dialect: the service below it and what every dialect shares, never another dialect or an engine
    "lmserve.dialects.shared": BASE | {"lmserve.service", "lmserve.store", "lmserve.chat.media"},
    **{f"lmserve.dialects.{name}": DIALECT for name in DIALECT_NAMES},
    # the one table of dialects reads each of them
    "lmserve.dialects": set(),
    "lmserve.dialects.table": BASE | {f"lmserve.dialects.{name}" for name in DIALECT_NAMES}
                              | {"lmserve.dialects.shared"},
    # the routes that are no dialect may reuse a dialect's translators
    "lmserve.endpoints": DIALECT | {"lmserve.dialects"},
    # the HTTP layer wires the dialects and endpoints over the service (metrics read engines' numbers: the protocol)
    "lmserve.http": BASE | {"lmserve.dialects", "lmserve.endpoints", "lmserve.service", "lmserve.store",
                            "lmserve.chat.media", "lmserve.engine.protocol"},
    "lmserve.client": BASE,
    "lmserve.listening": set(),
    "lmserve.supervisor": BASE | {"lmserve.listening", "lmserve.store.load_crashes"},
    "lmserve.cli": BASE | {"lmserve.client", "lmserve.server", "lmserve.listening", "lmserve.supervisor",
                           "lmserve.replicas"},
    "lmserve.cli.repl": BASE | {"lmserve.client"},
    # `lmserve sign` signs a local model's files, no server involved
    "lmserve.cli.sign": BASE | {"lmserve.cli.command", "lmserve.store.signatures"},
    # `lmserve batch` runs the Batch API's lines, offline through `serve`'s app or over HTTP
    "lmserve.cli.batch": BASE | {"lmserve.cli.command", "lmserve.service.batch_lines", "lmserve.dialects.table",
                                 "lmserve.server", "lmserve.store.batches"},
    "lmserve.replicas": BASE | {"lmserve.http", "lmserve.dialects.table", "lmserve.server"},
    # the offline engine composes `serve`'s service and reuses the OpenAI dialect's translators (no second one)
    "lmserve.offline": BASE | {"lmserve.server", "lmserve.service", "lmserve.dialects.openai",
                               "lmserve.dialects.shared", "lmserve.chat.media"},
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


ENGINE_PACKAGES = sorted(p.name for p in (PACKAGE / "engine").iterdir() if (p / "__init__.py").is_file()
                         and p.name != "slots")
"""The engines' packages (engine/slots/ is the slot engine several engines may run on, not an engine)."""


@pytest.mark.parametrize("path", sorted((PACKAGE / "engine").rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_an_engine_imports_no_other_engine(path: Path) -> None:
    own = path.relative_to(PACKAGE / "engine").parts[0]
    for imported in imports(path):
        for engine in ENGINE_PACKAGES:
            if engine != own and imported.startswith(f"lmserve.engine.{engine}"):
                assert path.name in ("registry.py", "factory.py"), f"{path.name} imports {imported}"


def test_the_service_and_the_dialects_never_name_an_engine() -> None:
    """Which engine serves a model is the engine table's business (engine/registry.py): nothing above the seam
    compares with an engine's name."""
    from lmserve.engine.registry import ENGINES

    names = {spec.name for spec in ENGINES}
    for layer in ("service", "dialects", "endpoints", "http", "chat", "store"):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            found = {node.value for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and node.value in names}
            assert not found, f"{path.relative_to(PACKAGE)} names the engine(s) {sorted(found)}"


def test_only_the_replicas_package_imports_ray() -> None:
    """Ray Serve is lmserve's scale-out runtime, not a dependency of the server: one package runs on it."""
    for path in MODULES:
        if module_name(path).startswith("lmserve.replicas"):
            continue
        assert not {i for i in imports(path) if i.split(".")[0] == "ray"}, f"{module_name(path)} imports ray"
