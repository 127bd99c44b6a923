"""One model over two machines: vLLM's multiprocessing multi-node (tensor parallel 2, one rank per node), across
two network namespaces joined by a veth pair (tests/netns.sh: 10.77.0.1 and 10.77.0.2; nothing else is reached).

Node 1 runs `lmserve serve … --node-rank 1 --headless` (workers only); node 0 serves HTTP. The answer matches
transformers token for token, and stopping node 0 ends node 1 too (it watches node 0's rendezvous port).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from tests.hf_repos import tiny_llama_repo
from tests.test_vllm_processes import transformers_greedy

NETNS = Path(__file__).with_name("netns.sh")
NODES = {0: ("lmsA", "10.77.0.1", "vlmsA"), 1: ("lmsB", "10.77.0.2", "vlmsB")}
PORT = 18434


def in_namespace(namespace: str, *command: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *command]


@pytest.fixture(scope="module")
def namespaces() -> Iterator[None]:
    if os.geteuid() != 0 or subprocess.run([str(NETNS), "up"], capture_output=True).returncode != 0:
        pytest.skip("network namespaces need root and iproute2 (`ip netns`)")
    try:
        yield
    finally:
        subprocess.run([str(NETNS), "down"], capture_output=True)


def start_node(rank: int, repo: Path, log: BinaryIO) -> subprocess.Popen[bytes]:
    namespace, address, device = NODES[rank]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    env.update(LMSERVE_MODELS=tempfile.mkdtemp(prefix=f"lmserve-node{rank}-"), GLOO_SOCKET_IFNAME=device)
    args = [str(repo), "--engine", "vllm", "--dtype", "float32", "-c", "1024", "--tensor-parallel-size", "2",
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", NODES[0][1]]
    args += ["--headless"] if rank else ["--host", address, "--port", str(PORT)]
    command = in_namespace(namespace, sys.executable, "-m", "lmserve", "serve", *args)
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def ask(body: dict[str, object], timeout: float = 5) -> dict[str, object] | None:
    """POST /api/generate to node 0 from inside its namespace; None while it is not up."""
    curl = in_namespace(NODES[0][0], "curl", "-sf", "--max-time", str(timeout), "-d", json.dumps(body),
                        f"http://{NODES[0][1]}:{PORT}/api/generate")
    done = subprocess.run(curl, capture_output=True)
    return json.loads(done.stdout) if done.returncode == 0 else None


def namespace_pids(namespace: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()


def test_tensor_parallel_over_two_nodes_answers_as_transformers_and_ends_with_node_0(
    namespaces: None, tmp_path: Path,
) -> None:
    repo = tiny_llama_repo()
    prompt = "The capital of France is"
    body = {"model": repo.name, "prompt": prompt, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 12}}
    with (tmp_path / "node1.log").open("wb") as log1, (tmp_path / "node0.log").open("wb") as log0:
        worker = start_node(1, repo, log1)
        head = start_node(0, repo, log0)
    try:
        deadline = time.monotonic() + 300
        reply = None
        while reply is None and time.monotonic() < deadline and head.poll() is None and worker.poll() is None:
            time.sleep(2)
            reply = ask(body, timeout=60)
        logs = {name: (tmp_path / name).read_text(errors="replace")[-3000:] for name in ("node0.log", "node1.log")}
        assert reply is not None, logs
        context = reply["context"]
        assert isinstance(context, list) and isinstance(reply["prompt_eval_count"], int)
        assert context[reply["prompt_eval_count"]:] == transformers_greedy(repo, prompt, 12)
    finally:
        head.terminate()
        head.wait(timeout=60)
    assert head.returncode == 0
    worker.wait(timeout=60)  # node 1 notices node 0 is gone and stops its workers
    deadline = time.monotonic() + 30
    while (namespace_pids("lmsA") or namespace_pids("lmsB")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert namespace_pids("lmsA") == [] and namespace_pids("lmsB") == []
