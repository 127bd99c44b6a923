"""lmserve on fal's serverless GPUs: the vLLM engine behind lmserve's whole HTTP app, private to your API keys.

    pip install -r deploy/fal/requirements.txt            # the fal SDK, in its own virtual environment
    fal secrets set HF_TOKEN=hf_...                        # only for gated models
    LMSERVE_MODEL=LiquidAI/LFM2-1.2B fal run deploy/fal/app.py::serve                     # a one-off server
    LMSERVE_MODEL=LiquidAI/LFM2-1.2B fal deploy deploy/fal/app.py::serve --app-name lmserve --auth private

Requests go to https://fal.run/<org_id>/lmserve/v1/... with `Authorization: Key <FAL_KEY>`: fal checks the key of a
private app; lmserve, started without LMSERVE_API_KEY, ignores the header. The model is read when the app is
deployed (LMSERVE_MODEL, default LiquidAI/LFM2-1.2B); lmserve pulls it into fal's persistent /data at the first
start, which is why the first run is slow (the environment is built and the weights downloaded).

fal runs the function below on a GPU machine with this checkout installed with the `vllm` extra (an sdist of the
project is built and uploaded at deploy); the function starts uvicorn on lmserve's ASGI factory
(lmserve.server:asgi_app, the one `lmserve serve` uses) on the port fal forwards requests to.
"""

from __future__ import annotations

import os
from pathlib import Path

import fal

PROJECT = Path(__file__).resolve().parents[2]
"""The lmserve checkout, installed on the worker as `.[vllm]` (so the deployment runs this very version)."""

MODEL = os.environ.get("LMSERVE_MODEL", "LiquidAI/LFM2-1.2B")
"""The served model: a hub repository id (or any model `lmserve serve` accepts), read at deploy time."""

PORT = 8000
PARALLEL = 128
"""Sequences vLLM decodes together, and the requests fal sends one runner at a time."""

SERVER_ENV = {
    "LMSERVE_MODEL": MODEL,
    "LMSERVE_ENGINE": "vllm",
    "LMSERVE_PARALLEL": str(PARALLEL),
    "LMSERVE_CTX_SIZE": "32768",
    "LMSERVE_MODELS": "/data/lmserve/models",  # fal's persistent storage: the weights survive cold starts
    "HF_HOME": "/data/huggingface",
}
"""lmserve's configuration on the worker (its LMSERVE_* variables; HF_TOKEN comes from the fal secret)."""


@fal.function(
    "virtualenv",
    requirements=[".[vllm]"],
    requirements_context_dir=str(PROJECT),
    machine_type="GPU-H100",
    num_gpus=1,
    exposed_port=PORT,
    keep_alive=600,  # seconds an idle runner stays up
    min_concurrency=1,  # one runner always warm: a cold start takes minutes
    max_multiplexing=PARALLEL,
    startup_timeout=1800,  # the first start downloads the weights and starts vLLM
    request_timeout=1200,  # a long streamed answer
)
def serve() -> None:
    """Serve lmserve's app on PORT until fal stops the runner (uvicorn loads the model at startup)."""
    import uvicorn

    os.environ.update(SERVER_ENV)
    uvicorn.run("lmserve.server:asgi_app", factory=True, host="0.0.0.0", port=PORT, timeout_graceful_shutdown=30)
