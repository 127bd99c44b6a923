"""The Ray Serve application that deploy/kubernetes/rayservice.yaml runs, run by Ray's own `serve run` from the same
Serve config (its import path and argument names; the model and sizes swapped for the embedded model's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.cores import all_cores
from tests.test_server import PORT_TAKEN, free_port, wait_healthy

RAYSERVICE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "rayservice.yaml"
SLOW_MACHINE = {**os.environ, "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
"""Ray Serve gives its HTTP proxy 5 s to say it is ready, then restarts it, and `serve run` gives up after 60 s: on
a loaded machine (the suite beside two busy loops) a proxy took longer every time, so it gets 60 s."""


def started(config: dict[str, Any], folder: Path) -> tuple[subprocess.Popen[str], int]:
    """`serve run` of `config` on a free port, healthy: (its process, the port). A port another process took
    before Ray's proxy bound it (the harness's race) is tried again on another; any other failure says what the
    log says."""
    serve = Path(sys.executable).parent / "serve"
    for attempt in range(3):
        port = free_port()
        config["http_options"] = {"host": "127.0.0.1", "port": port}
        (folder / "serve.yaml").write_text(yaml.safe_dump(config))
        with (folder / "serve.log").open("w") as log, all_cores():  # Ray on one core starts several times slower
            process = subprocess.Popen([str(serve), "run", str(folder / "serve.yaml")], stdout=log,
                                       stderr=subprocess.STDOUT, text=True, cwd=folder, env=SLOW_MACHINE)
        try:
            wait_healthy(process, f"http://127.0.0.1:{port}", timeout=240)
            return process, port
        except RuntimeError as error:
            stop(process)
            said = (folder / "serve.log").read_text(errors="replace")
            if attempt == 2 or not PORT_TAKEN.search(said):
                raise RuntimeError(f"{error}\n{said[-3000:]}") from None
    raise AssertionError("unreachable")


def stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(2)  # Ctrl-C: serve run tears the application and its Ray down
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_the_rayservice_serve_config_runs_under_serve_run(tmp_path: Path) -> None:
    [service] = [doc for doc in yaml.safe_load_all(RAYSERVICE.read_text()) if doc and doc["kind"] == "RayService"]
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    [app] = config["applications"]
    assert app["import_path"] == "lmserve.replicas.app:build"
    app["args"].update(model="smollm2:135m", models_dir=str(tmp_path / "models"), ctx_size=1024, threads=1,
                       replica_cpus=0, replica_gpus=0, max_replicas=1)
    process, port = started(config, tmp_path)
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                           json={"model": "smollm2:135m", "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200 and reply.headers["lmserve-replica"]
    finally:
        stop(process)
