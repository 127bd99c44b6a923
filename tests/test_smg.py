"""SMG (the SGLang model gateway, `smg` on PyPI) in cache_aware mode in front of two real `lmserve serve` processes:
chat completions (streamed and not) and completions through it with the official openai client, each conversation's
returning turn sent to the server that holds its prefix, and SMG polling each server's GET /v1/loads (and reading
it: its /workers shows the servers' loads)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import MODEL, Server, free_port

SMG = str(sys.executable).removesuffix("python") + "smg"
"""The `smg` command beside this Python (the test extra installs it)."""
SLOTS = 2
CONTEXT = 1024
LOAD_POLL_WAIT = 25.0
"""SMG polls each worker's /v1/loads every 10 s (--load-monitor-interval)."""


class Gateway:
    """A running `smg launch` over `workers`, on a free port (its own metrics on another)."""

    def __init__(self, workers: list[Server]) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [SMG, "launch", "--worker-urls", *(w.base_url for w in workers), "--policy", "cache_aware",
                   "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(free_port()), "--disable-tokenizer-autoload"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._wait_ready(len(workers))

    def _wait_ready(self, count: int, timeout: float = 60.0) -> None:
        """Return once SMG lists `count` ready workers; RuntimeError (with its log) when it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"smg exited: {self.stop()}")
            try:
                listed = httpx.get(self.base_url + "/workers", timeout=2).json().get("workers", [])
                if sum(1 for w in listed if w.get("status") == "ready" and w.get("is_healthy")) == count:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"smg did not get its workers ready: {self.stop()}")

    def workers(self) -> list[dict[str, object]]:
        return list(httpx.get(self.base_url + "/workers", timeout=5).json()["workers"])

    def client(self, *, strict: bool = True) -> openai.OpenAI:
        """The official client on the gateway; not `strict` for streamed completions, whose chunks carry
        finish_reason null, which the SDK's Completion type does not allow."""
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="placeholder", max_retries=0,
                             _strict_response_validation=strict)

    def stop(self) -> str:
        self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return out or ""


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        for _ in range(2):
            started.append(Server("-c", str(CONTEXT), "-np", str(SLOTS)))
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def gateway(workers: list[Server]) -> Iterator[Gateway]:
    smg = Gateway(workers)
    yield smg
    smg.stop()


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with gateway.client() as c:
        yield c


def requests_on(server: Server, route: str) -> float:
    """lmserve_requests_total of `route` with status 200 on `server`."""
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "lmserve_requests_total" and sample.labels == {"route": route, "status": "200"})


def test_a_chat_completion_goes_through(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                           temperature=0, max_tokens=8)
    assert reply.model == MODEL and reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens > 0


def test_a_streamed_chat_completion_goes_through(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                            temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_go_through_streamed_and_not(client: openai.OpenAI, gateway: Gateway) -> None:
    whole = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=6)
    assert whole.choices[0].text and whole.usage is not None
    with gateway.client(strict=False) as loose:
        streamed = list(loose.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=6,
                                                 stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_conversations_spread_over_both_servers_and_return_to_their_prefix(
    client: openai.OpenAI, workers: list[Server]
) -> None:
    """Distinct conversations go to both servers; each one's second turn goes where its first turn's prefix is
    cached (its prompt is served from that server's cache)."""
    before = [requests_on(server, "/v1/chat/completions") for server in workers]
    topics = ["volcanoes", "chess openings", "sourdough bread", "tide pools", "jazz harmony", "glaciers"]
    for topic in topics:
        messages: list[dict[str, str]] = [{"role": "user", "content": f"Tell me one short fact about {topic}. " * 6}]
        first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)  # type: ignore[arg-type]
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "And another one?"}]
        second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)  # type: ignore[arg-type]
        assert first.usage is not None and second.usage is not None
        details = second.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens is not None
        assert details.cached_tokens >= first.usage.prompt_tokens - 1, (topic, first.usage, second.usage)
    served = [requests_on(server, "/v1/chat/completions") - b for server, b in zip(workers, before, strict=True)]
    assert sum(served) == 2 * len(topics) and min(served) >= 2, served


def test_smg_polls_and_reads_each_servers_loads(gateway: Gateway, workers: list[Server]) -> None:
    deadline = time.monotonic() + LOAD_POLL_WAIT
    while time.monotonic() < deadline and min(requests_on(s, "/v1/loads") for s in workers) < 1:
        time.sleep(1)
    assert all(requests_on(server, "/v1/loads") >= 1 for server in workers)
    for listed in gateway.workers():
        load = listed["engine_load"]
        assert isinstance(load, dict) and load["dp_rank_count"] == 1, listed
        [rank] = load["loads"]
        assert rank["max_total_num_tokens"] == CONTEXT * SLOTS and rank["max_running_requests"] == SLOTS
