"""The Ray Serve application that deploy/kubernetes/rayservice.yaml runs, run by Ray's own `serve run` from the same
Serve config (its import path and argument names; the model and sizes swapped for the embedded model's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.cores import all_cores
from tests.test_server import free_port, wait_healthy

RAYSERVICE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "rayservice.yaml"


def test_the_rayservice_serve_config_runs_under_serve_run(tmp_path: Path) -> None:
    [service] = [doc for doc in yaml.safe_load_all(RAYSERVICE.read_text()) if doc and doc["kind"] == "RayService"]
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    [app] = config["applications"]
    assert app["import_path"] == "lmserve.replicas.app:build"
    app["args"].update(model="smollm2:135m", models_dir=str(tmp_path / "models"), ctx_size=1024, threads=1,
                       replica_cpus=0, replica_gpus=0, max_replicas=1)
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "serve.log").open("w")
    serve = Path(sys.executable).parent / "serve"
    with all_cores():  # Ray's processes on one core start several times slower (tests/cores.py)
        process = subprocess.Popen([str(serve), "run", str(tmp_path / "serve.yaml")], stdout=log,
                                   stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", timeout=240)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                           json={"model": "smollm2:135m", "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200 and reply.headers["lmserve-replica"]
    finally:
        process.send_signal(2)  # Ctrl-C: serve run tears the application and its Ray down
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
