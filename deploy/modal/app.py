"""lmserve on Modal's serverless GPUs: the vLLM engine behind lmserve's whole HTTP app, kept warm.

    pip install modal && modal setup
    modal secret create huggingface-secret HF_TOKEN=hf_...     # the hub token (any value for open models)
    deploy/modal/deploy.sh                                       # MODEL_NAME=<org>/<repo> to pick the model

MODEL_NAME is read when the app is deployed (default LiquidAI/LFM2-8B-A1B, an 8B mixture-of-experts model). The
image installs this checkout with the `vllm` extra; the container serves lmserve's ASGI factory
(lmserve.server:asgi_app, the one `lmserve serve` uses), which pulls the model into the `lmserve-cache` volume on
the first start and loads it. A cold start takes over 2 minutes, so one container is always up and one more is
kept in reserve (GPUs on Modal can be preempted); deploy.sh sends a first request so the deployment is warm.
"""

from __future__ import annotations

import os
from pathlib import Path

import modal

PROJECT = Path(__file__).resolve().parents[2]
"""The lmserve checkout, copied into the image and installed as `.[vllm]`."""

MODEL_NAME = os.environ.get("MODEL_NAME", "LiquidAI/LFM2-8B-A1B")
"""The served model, read at deploy time: a hub repository id (or any model `lmserve serve` accepts)."""

GPU = "H100"
PARALLEL = 128
"""Sequences vLLM decodes together, and the requests one container takes at a time."""
CACHE = "/cache"
MINUTES = 60

cache = modal.Volume.from_name("lmserve-cache", create_if_missing=True)
hub_token = modal.Secret.from_name("huggingface-secret", required_keys=["HF_TOKEN"])

image = (
    modal.Image.from_registry("nvidia/cuda:12.8.1-devel-ubuntu24.04", add_python="3.11")
    .apt_install("build-essential", "cmake")  # llama-cpp-python, a core dependency, builds from source
    .add_local_dir(PROJECT, "/opt/lmserve", copy=True,
                   ignore=[".venv", ".git", "**/__pycache__", "tests", "bench", "deploy", "*.egg-info"])
    .run_commands("pip install '/opt/lmserve[vllm]'")
    .env({
        "LMSERVE_MODEL": MODEL_NAME,
        "LMSERVE_ENGINE": "vllm",
        "LMSERVE_PARALLEL": str(PARALLEL),
        "LMSERVE_CTX_SIZE": "32768",
        "LMSERVE_MODELS": f"{CACHE}/lmserve/models",  # the pulled weights stay on the volume between cold starts
        "HF_HOME": f"{CACHE}/huggingface",
    })
)

app = modal.App("lmserve")


@app.function(
    image=image,
    gpu=GPU,
    volumes={CACHE: cache},
    secrets=[hub_token],
    min_containers=1,  # always one up: a cold start is over 2 minutes
    buffer_containers=1,  # and one more in reserve, since GPUs can be preempted
    scaledown_window=15 * MINUTES,  # an idle extra container stays this long
    startup_timeout=30 * MINUTES,  # the first start downloads the weights
    timeout=20 * MINUTES,  # the longest request (a long streamed answer)
)
@modal.concurrent(max_inputs=PARALLEL)
@modal.asgi_app()
def serve() -> object:
    """lmserve's app over MODEL_NAME (the model is loaded when the container starts)."""
    from lmserve.server import asgi_app

    return asgi_app()
