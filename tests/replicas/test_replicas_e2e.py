"""`lmserve serve --replicas N` on a real Ray Serve: every dialect through one endpoint, conversations routed to the
replica that holds their prompt cache, state shared by the replicas, autoscaling, and a replica that dies.

One Ray (2 replicas of the embedded model) serves the module; the autoscaling test starts one of its own.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cores import all_cores
from tests.otlp_collector import Collector, attributes
from tests.test_server import Server

MODEL = "smollm2:135m"
REPLICA_HEADER = "lmserve-replica"


def replicas_server(*args: str, env: dict[str, str] | None = None) -> Server:
    """A server of replicas on Ray Serve, on every core of the run: Ray's own processes (its control store, node
    manager, proxy and one process per replica) on one core start several times slower (tests/cores.py)."""
    with all_cores():
        return Server("--replica-cpus", "0", "-t", "1", *args, env={"LMSERVE_SUPERVISOR": "0", **(env or {})})


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    """Where the deployment's traces go (its ingress's and its replicas' spans)."""
    found = Collector().start()
    yield found
    found.stop()


@pytest.fixture(scope="module")
def ray_server(collector: Collector) -> Iterator[Server]:
    server = replicas_server("--replicas", "2", "-np", "4", "--otlp-traces-endpoint", collector.url,
                             env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(ray_server: Server) -> Iterator[openai.OpenAI]:
    with ray_server.client() as c:
        yield c


def replica_ids(server: Server) -> set[str]:
    """The replicas the deployment's merged /metrics speaks for."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {sample.labels["replica"] for family in text_string_to_metric_families(text)
            for sample in family.samples if family.name == "lmserve_loaded_models"}


def test_the_banner_says_ray_serve_and_the_replicas(ray_server: Server) -> None:
    assert len(replica_ids(ray_server)) == 2


def test_openai_chat_whole_and_streamed(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == whole.choices[0].message.content


def test_a_replicas_span_continues_the_ingresss_which_continues_the_callers(
        ray_server: Server, collector: Collector) -> None:
    trace_id, caller = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    reply = httpx.post(ray_server.base_url + "/v1/chat/completions", timeout=120,
                       headers={"traceparent": f"00-{trace_id}-{caller}-01"},
                       json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 200, reply.text

    def ours(spans: list[Any]) -> list[Any]:
        return [span for span in spans if span.trace_id.hex() == trace_id]

    def ingress_of(spans: list[Any]) -> list[Any]:
        return [span for span in ours(spans) if attributes(span).get("lmserve.role") == "ingress"]

    spans = ours(collector.wait_for(lambda spans: len(ours(spans)) >= 4 and bool(ingress_of(spans))))
    [ingress] = ingress_of(spans)
    assert ingress.parent_span_id.hex() == caller and ingress.name == "POST /v1/chat/completions"
    [replica] = [span for span in spans if span.parent_span_id == ingress.span_id]
    assert replica.name == "POST /v1/chat/completions"
    assert attributes(replica)["gen_ai.request.model"] == MODEL
    assert attributes(replica)["gen_ai.usage.completion_tokens"] == 4
    assert {span.name for span in spans if span.parent_span_id == replica.span_id} >= {"prefill", "decode"}


def test_completions_and_responses(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6)
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=10)
    assert response.status in ("completed", "incomplete") and response.output_text


def test_native_and_anthropic_dialects(ray_server: Server) -> None:
    with ollama.Client(host=ray_server.base_url) as native:
        reply = native.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 8})
        assert reply.message.content
        pieces = list(native.generate(model=MODEL, prompt="Once upon", stream=True, options={"num_predict": 8}))
        assert pieces[-1].done and "".join(p.response for p in pieces)
        assert [m.model for m in native.ps().models] == [MODEL]
    with anthropic.Anthropic(base_url=ray_server.base_url, api_key="placeholder", max_retries=0) as claude:
        message = claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        assert message.content and message.content[0].type == "text"
        with claude.messages.stream(model=MODEL, max_tokens=8,
                                    messages=[{"role": "user", "content": "Hi"}]) as stream:
            assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")


def test_bad_input_is_the_dialects_own_4xx(ray_server: Server) -> None:
    openai_error = httpx.post(ray_server.base_url + "/v1/chat/completions", json={"model": MODEL}, timeout=30)
    assert openai_error.status_code == 400 and openai_error.json()["error"]["param"] == "messages"
    native_error = httpx.post(ray_server.base_url + "/api/chat", json={"model": "nope"}, timeout=30)
    assert native_error.status_code == 404 and isinstance(native_error.json()["error"], str)


def test_returning_turns_are_served_from_the_prompt_cache(client: openai.OpenAI) -> None:
    """8 conversations of 3 turns, at once: each returning turn goes to the replica that holds its earlier turns."""

    def converse(n: int) -> list[int]:
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "system", "content": f"You are assistant number {n}. " + "Answer briefly and kindly. " * 8}]
        cached = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Conversation {n}, question {turn}: what is {n} + {turn}?"})
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
            assert reply.usage is not None
            details = reply.usage.prompt_tokens_details
            cached.append(details.cached_tokens or 0 if details else 0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        return cached[1:]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        returning = [hit for turns in pool.map(converse, range(8)) for hit in turns]
    hits = sum(1 for cached in returning if cached > 0)
    assert hits >= 0.9 * len(returning), returning


def test_a_stored_response_is_read_chained_and_deleted_through_any_replica(ray_server: Server,
                                                                           client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Remember the word apple.", max_output_tokens=8, store=True)
    answered_by = set()
    for _ in range(40):
        got = httpx.get(f"{ray_server.base_url}/v1/responses/{first.id}", timeout=30)
        assert got.status_code == 200 and got.json()["id"] == first.id
        answered_by.add(got.headers[REPLICA_HEADER])
        if len(answered_by) == 2:
            break
    assert len(answered_by) == 2
    chained = client.responses.create(model=MODEL, input="Which word?", previous_response_id=first.id,
                                      max_output_tokens=8, store=True)
    assert chained.previous_response_id == first.id
    client.responses.delete(first.id)
    for _ in range(6):
        assert httpx.get(f"{ray_server.base_url}/v1/responses/{first.id}", timeout=30).status_code == 404


def test_a_model_created_through_one_replica_is_listed_by_all(ray_server: Server) -> None:
    with ollama.Client(host=ray_server.base_url) as native:
        native.copy(MODEL, "replicated:latest")
        for _ in range(6):
            names = [m["name"] for m in httpx.get(ray_server.base_url + "/api/tags", timeout=30).json()["models"]]
            assert "replicated:latest" in names
        native.delete("replicated:latest")


def test_deployment_routes_speak_for_every_replica(ray_server: Server) -> None:
    ps = httpx.get(ray_server.base_url + "/api/ps", timeout=30).json()["models"]
    assert [m["name"] for m in ps] == [MODEL]
    models = httpx.get(ray_server.base_url + "/v1/models", timeout=30).json()["data"]
    assert MODEL in [m["id"] for m in models]
    assert httpx.get(ray_server.base_url + "/health", timeout=30).json() == {"status": "ok"}
    text = httpx.get(ray_server.base_url + "/metrics", timeout=30).text
    requests = [s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "lmserve_requests_total"]
    assert {s.labels["replica"] for s in requests} == replica_ids(ray_server)
    kv = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:kv_cache_usage_perc"]
    assert {s.labels["replica"] for s in kv} == replica_ids(ray_server)
    loads = httpx.get(ray_server.base_url + "/v1/loads", timeout=30).json()
    assert loads["dp_rank_count"] == 2 and [entry["dp_rank"] for entry in loads["loads"]] == [0, 1]


def test_a_replica_that_dies_is_replaced_and_the_other_keeps_serving(ray_server: Server) -> None:
    """SIGKILL one replica's process while both stream: its streams end with an error event, the other's finish,
    and Ray starts a replica in its place."""
    before = replica_ids(ray_server)
    children = psutil.Process(ray_server.process.pid).children(recursive=True)
    replicas = [p for p in children if "ServeReplica:lmserve:Replica" in " ".join(p.cmdline())]
    assert len(replicas) == 2

    begun = [threading.Event() for _ in range(6)]

    def stream(n: int) -> str:
        body = {"model": MODEL, "stream": True, "max_tokens": 400, "temperature": 1,
                "messages": [{"role": "user", "content": f"Tell story number {n} about a distant land."}]}
        text = ""
        try:
            with httpx.stream("POST", ray_server.base_url + "/v1/chat/completions", json=body,
                              timeout=120) as response:
                for piece in response.iter_text():
                    text += piece
                    begun[n].set()
        finally:
            begun[n].set()  # (a stream that failed early must not hold the kill back)
        return "error" if '"error"' in text else "done" if "[DONE]" in text else text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream, n) for n in range(6)]
        for event in begun:  # every stream is being answered (a fixed wait was too short on a loaded machine)
            event.wait(120)
        os.kill(replicas[0].pid, signal.SIGKILL)
        outcomes = [s.result() for s in streams]
    assert set(outcomes) <= {"error", "done"}, outcomes
    assert "error" in outcomes and "done" in outcomes, outcomes
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = replica_ids(ray_server) if httpx.get(ray_server.base_url + "/health", timeout=30).status_code == 200 \
            else set()
        if len(now) == 2 and now != before:
            break
        time.sleep(1)
    assert len(now) == 2 and len(now & before) == 1, (before, now)
    reply = httpx.post(ray_server.base_url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 200


def test_autoscaling_adds_a_replica_under_load_and_removes_it_when_idle() -> None:
    server = replicas_server("--min-replicas", "1", "--max-replicas", "2", "-np", "1",
                             env={"LMSERVE_SCALE_UP_DELAY": "1s", "LMSERVE_SCALE_DOWN_DELAY": "3s",
                                  "LMSERVE_SCALE_WINDOW": "5s"})
    try:
        assert len(replica_ids(server)) == 1
        body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Tell a long story."}]}
        seen = {1}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and 2 not in seen:
                load = [pool.submit(httpx.post, server.base_url + "/v1/chat/completions", json=body, timeout=120)
                        for _ in range(6)]
                time.sleep(2)
                seen.add(len(replica_ids(server)))
                for done in load:
                    done.result()
        assert 2 in seen
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(replica_ids(server)) != 1:
            time.sleep(2)
        assert len(replica_ids(server)) == 1
    finally:
        server.stop()
