"""The Batch API and `lmserve batch` end to end: a real `lmserve serve`, the default model, the official `openai`
client; a server SIGKILLed mid-batch and started again; the batch command offline, resumed, and against a server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.docs_pages import DOCS
from tests.test_server import MODEL, Server

QUESTIONS = ["What is the capital of France?", "Name a colour.", "What is 2 + 2?", "Say hello.", "Name a fruit."]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "4")
    yield srv
    srv.stop()


def chat_line(custom_id: str, question: str, max_tokens: int = 8) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                     "temperature": 0}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} did not end: {batch}")


def result_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def test_the_openai_client_runs_chat_completion_and_embedding_batches_to_completion(server: Server) -> None:
    lines = {
        "/v1/chat/completions": [chat_line(f"chat-{i}", q) for i, q in enumerate(QUESTIONS)],
        "/v1/completions": [{"custom_id": f"text-{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"model": MODEL, "prompt": q, "max_tokens": 6, "temperature": 0}}
                            for i, q in enumerate(QUESTIONS)],
        "/v1/embeddings": [{"custom_id": f"vec-{i}", "method": "POST", "url": "/v1/embeddings",
                            "body": {"model": MODEL, "input": q}} for i, q in enumerate(QUESTIONS)],
    }
    with server.client() as client:
        batches = {}
        for endpoint, requests in lines.items():
            upload = client.files.create(file=("requests.jsonl", jsonl(requests)), purpose="batch")
            batches[endpoint] = client.batches.create(input_file_id=upload.id, endpoint=endpoint,  # type: ignore[arg-type]
                                                      completion_window="24h", metadata={"kind": endpoint})
        listed = {batch.id for batch in client.batches.list(limit=10).data}
        assert listed == {batch.id for batch in batches.values()}
        for endpoint, batch in batches.items():
            done = wait_done(client, batch.id)
            assert done.status == "completed" and done.metadata == {"kind": endpoint}
            assert done.request_counts is not None
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 5, 0)
            out = {line["custom_id"]: line["response"] for line in result_lines(client, done.output_file_id)}
            assert set(out) == {line["custom_id"] for line in lines[endpoint]}
            assert all(response["status_code"] == 200 for response in out.values())
            if endpoint == "/v1/chat/completions":
                first = out["chat-0"]["body"]
                question = [{"role": "user", "content": QUESTIONS[0]}]
                alone = client.chat.completions.create(model=MODEL, messages=question,  # type: ignore[arg-type]
                                                       max_tokens=8, temperature=0)
                assert first["choices"][0]["message"]["content"] == alone.choices[0].message.content
            elif endpoint == "/v1/completions":
                assert all(response["body"]["object"] == "text_completion" for response in out.values())
            else:
                assert all(len(response["body"]["data"][0]["embedding"]) > 100 for response in out.values())


def preemptions(server: Server) -> float:
    metrics = httpx.get(server.base_url + "/metrics").text
    found = re.search(rf'^lmserve_preemptions_total{{model="{re.escape(MODEL)}"}} (\S+)$', metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_interactive_requests_go_before_a_running_batch(server: Server) -> None:
    with server.client() as client:
        upload = client.files.create(file=("big.jsonl", jsonl([chat_line(f"r{i}", QUESTIONS[i % 5], 48)
                                                                for i in range(40)])), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 2:  # type: ignore[union-attr]
            time.sleep(0.05)
        for _ in range(5):  # a chat that lands between two batch lines finds a slot free and preempts nothing
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                   max_tokens=8, temperature=0)
            assert reply.choices[0].message.content
            if preemptions(server) >= 1:
                break
        during = client.batches.retrieve(batch.id)
        assert during.status == "in_progress", "the interactive request waited for the batch"
        assert during.request_counts is not None and during.request_counts.completed < 40
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled")
        done = wait_done(client, batch.id, timeout=30)
        assert done.status == "cancelled"
        ids = [line["custom_id"] for line in result_lines(client, done.output_file_id)]
        assert len(ids) == len(set(ids)) == done.request_counts.completed
        assert len(ids) < 40
        assert preemptions(server) >= 1  # a batch line gave its slot to a chat

def test_a_batch_survives_sigterm_and_sigkill_restarts_with_no_line_lost_or_doubled(tmp_path: Path) -> None:
    models = tmp_path / "store"
    environment = {"LMSERVE_MODELS": str(models), "LMSERVE_SUPERVISOR": "0", "LMSERVE_BATCH_CONCURRENCY": "4"}
    lines = [chat_line(f"r{i}", QUESTIONS[i % 5], 16) for i in range(30)]
    log = models / "batches" / "runs"
    first = Server("-np", "4", env=environment)
    with first.client() as client:
        upload = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 4:  # type: ignore[union-attr]
            time.sleep(0.02)
    first.stop()  # SIGTERM: the lines in flight are dropped, not failed
    assert not (log / f"{batch.id}.errors.jsonl").read_bytes()
    second = Server("-np", "4", env=environment)
    with second.client() as client:
        while client.batches.retrieve(batch.id).request_counts.completed < 12:  # type: ignore[union-attr]
            time.sleep(0.02)
    second.process.send_signal(signal.SIGKILL)
    second.process.wait()
    written = (log / f"{batch.id}.output.jsonl").read_bytes().count(b"\n")
    assert 12 <= written < 30
    third = Server("-np", "4", env=environment)
    try:
        with third.client() as client:
            done = wait_done(client, batch.id)
            assert done.status == "completed"
            assert done.request_counts is not None
            assert (done.request_counts.completed, done.request_counts.failed) == (30, 0)
            ids = [line["custom_id"] for line in result_lines(client, done.output_file_id)]
            assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # every line once
    finally:
        third.stop()


# ---- lmserve batch -----------------------------------------------------------------------------------------------


def batch_command(*args: str, stdin: bytes | None = None, models: Path,
                  wait: bool = True) -> subprocess.CompletedProcess[bytes] | subprocess.Popen[bytes]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    environment["LMSERVE_MODELS"] = str(models)
    command = [sys.executable, "-m", "lmserve", "batch", *args]
    if not wait:
        return subprocess.Popen(command, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    return subprocess.run(command, env=environment, input=stdin, capture_output=True, timeout=600, check=False)


def test_lmserve_batch_runs_offline_resumes_after_an_interruption_and_reads_stdin(tmp_path: Path) -> None:
    lines = [chat_line(f"r{i}", QUESTIONS[i % 5], 16) for i in range(16)]
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(jsonl(lines))
    out = tmp_path / "results.jsonl"
    running = batch_command(str(requests), "-o", str(out), "--batch-concurrency", "2", models=tmp_path / "store",
                            wait=False)
    assert isinstance(running, subprocess.Popen)
    deadline = time.monotonic() + 300
    while (not out.exists() or out.read_bytes().count(b"\n") < 3) and time.monotonic() < deadline:
        assert running.poll() is None, running.communicate()
        time.sleep(0.05)
    running.send_signal(signal.SIGKILL)
    running.communicate()
    before = out.read_bytes().count(b"\n")
    assert 3 <= before < 16
    finished = batch_command(str(requests), "-o", str(out), models=tmp_path / "store")
    assert isinstance(finished, subprocess.CompletedProcess)
    assert finished.returncode == 0, finished.stderr.decode()
    assert f"{before} lines are in" in finished.stderr.decode()
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
    assert all(r["response"]["status_code"] == 200 for r in results)
    piped = batch_command("-", "-o", "-", stdin=jsonl(lines[:2]), models=tmp_path / "store")
    assert isinstance(piped, subprocess.CompletedProcess) and piped.returncode == 0
    replies = {json.loads(line)["custom_id"]: json.loads(line) for line in piped.stdout.decode().splitlines()}
    by_id = {r["custom_id"]: r for r in results}
    for custom_id in ("r0", "r1"):  # temperature 0: the same reply offline, resumed or piped
        assert replies[custom_id]["response"]["body"]["choices"] == by_id[custom_id]["response"]["body"]["choices"]


def test_lmserve_batch_against_a_running_server(server: Server, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    lines = [chat_line(f"r{i}", q) for i, q in enumerate(QUESTIONS)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": "not a list"}})
    requests.write_bytes(jsonl(lines) + b"{oops\n")
    out = tmp_path / "results.jsonl"
    done = batch_command(str(requests), "-o", str(out), "--url", server.base_url, models=tmp_path / "store")
    assert isinstance(done, subprocess.CompletedProcess)
    assert done.returncode == 1  # some lines failed
    assert "7 lines" in done.stderr.decode() and "5 succeeded, 2 failed" in done.stderr.decode()
    results = {json.loads(line)["custom_id"]: json.loads(line) for line in out.read_text().splitlines()}
    assert results["bad"]["response"]["status_code"] == 400
    assert results[None]["error"]["code"] == "invalid_json_line"
    assert all(results[f"r{i}"]["response"]["status_code"] == 200 for i in range(5))


def docs_block(marker: str) -> str:
    """The fenced block right after `<!-- batch example: MARKER -->` in docs/batches.md."""
    text = (DOCS / "batches.md").read_text()
    after = text.split(f"<!-- batch example: {marker} -->", 1)[1]
    return after.split("```", 2)[1].split("\n", 1)[1]


def test_the_docs_batch_example_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "requests.jsonl").write_text(docs_block("requests.jsonl"))
    [command] = [line.split("#")[0].split() for line in docs_block("command").splitlines()
                 if line.startswith("lmserve batch")]
    assert command[:2] == ["lmserve", "batch"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    environment["LMSERVE_MODELS"] = str(tmp_path / "store")
    done = subprocess.run([sys.executable, "-m", "lmserve", *command[1:]], cwd=tmp_path, env=environment,
                          capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert "3 succeeded, 0 failed" in done.stderr.decode()
    results = {json.loads(line)["custom_id"]: json.loads(line)
               for line in (tmp_path / "results.jsonl").read_text().splitlines()}
    assert {custom_id: r["response"]["body"]["object"] for custom_id, r in results.items()} == {
        "q1": "chat.completion", "q2": "text_completion", "q3": "list"}
    assert results["q1"]["response"]["body"]["choices"][0]["message"]["content"]
