"""Batch lines: each input line checked on its own (a bad one refused with its custom_id and the reason), a repeated
custom_id fatal; lines sent at the lowest priority, a bounded number at a time, "not now" answers retried, and a stop
that cancels what is in flight."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from lmserve.dialects.table import batch_endpoints
from lmserve.service.batch_lines import BatchLine, check_lines, run_lines
from lmserve.types import BATCH_PRIORITY

CHAT = "/v1/chat/completions"


def raw(line: dict[str, Any] | str) -> bytes:
    return (line if isinstance(line, str) else json.dumps(line)).encode()


def request(custom_id: str = "a", url: str = CHAT, **more: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", "messages": []}, **more}


@pytest.mark.parametrize(
    ("line", "custom_id", "code", "words"),
    [
        ("{oops", None, "invalid_json_line", "line 1 is not a JSON object"),
        ("[1, 2]", None, "invalid_json_line", "not a JSON object"),
        ({"method": "POST", "url": CHAT, "body": {}}, None, "invalid_request", "custom_id must be a non-empty string"),
        (request(custom_id=""), None, "invalid_request", "custom_id"),
        (request(method="GET"), "a", "invalid_request", "method must be POST"),
        (request(url="/v1/completions"), "a", "invalid_request", "the batch's endpoint /v1/chat/completions"),
        ({**request(), "body": "text"}, "a", "invalid_request", "body must be a JSON object"),
        ({**request(), "body": {"stream": True}}, "a", "invalid_request", "cannot stream"),
    ],
)
def test_a_bad_line_is_refused_with_its_custom_id_and_why(line: dict[str, Any] | str, custom_id: str | None,
                                                           code: str, words: str) -> None:
    checked = check_lines([raw(line), raw(request("ok"))], (CHAT,))
    [refused] = checked.refused
    assert refused["custom_id"] == custom_id and refused["response"] is None
    assert refused["error"]["code"] == code and words in refused["error"]["message"]
    assert [line.custom_id for line in checked.lines] == ["ok"]
    assert checked.fatal is None


def test_any_endpoint_is_taken_without_a_batch_endpoint_but_not_others() -> None:
    checked = check_lines([raw(request("a")), raw(request("b", "/v1/embeddings")), raw(request("c", "/v1/files"))],
                          batch_endpoints())
    assert [(line.custom_id, line.url) for line in checked.lines] == [("a", CHAT), ("b", "/v1/embeddings")]
    assert "must be one of" in checked.refused[0]["error"]["message"]


def test_a_repeated_custom_id_makes_the_input_fatal_and_blank_lines_are_skipped() -> None:
    checked = check_lines([raw(request("a")), b"", b"  ", raw(request("a"))], (CHAT,))
    assert checked.fatal is not None and "line 4: custom_id 'a'" in checked.fatal


@pytest.mark.parametrize(("lines", "is_jsonl"), [([b"a,b", b"1,2"], False), ([b"a,b", raw(request())], True),
                                                 ([raw({"no": "id"})], True)])
def test_an_input_with_no_json_object_is_no_jsonl(lines: list[bytes], is_jsonl: bool) -> None:
    assert check_lines(lines, (CHAT,)).is_jsonl is is_jsonl


def test_the_model_of_the_first_line_that_names_one_is_the_batchs() -> None:
    nameless = {**request("a"), "body": {"messages": []}}
    assert check_lines([raw(nameless), raw(request("b"))], (CHAT,)).model == "m"


def lines(count: int, url: str = CHAT) -> list[BatchLine]:
    return [BatchLine(i + 1, f"r{i}", url, {"model": "m"}) for i in range(count)]


async def test_lines_run_at_the_lowest_priority_at_most_concurrency_at_a_time() -> None:
    running, most, seen = 0, 0, []

    async def send(url: str, body: dict[str, Any]) -> tuple[int, Any]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        seen.append((url, body.get("priority")))
        await asyncio.sleep(0.01)
        running -= 1
        return 200, {"ok": True}

    results: list[dict[str, Any]] = []
    await run_lines([*lines(10), *lines(2, "/v1/embeddings")], send, lambda _, result: results.append(result),
                    concurrency=3)
    assert most == 3
    assert len(results) == 12 and all(r["response"]["status_code"] == 200 for r in results)
    assert [priority for url, priority in seen if url == CHAT] == [BATCH_PRIORITY] * 10
    assert [priority for url, priority in seen if url != CHAT] == [None, None]  # embeddings take no priority


async def test_a_busy_answer_is_retried_and_other_errors_are_results() -> None:
    answers = {"r0": [503, 429, 200], "r1": [400]}

    async def send(url: str, body: dict[str, Any]) -> tuple[int, Any]:
        return answers[body["id"]].pop(0), {}

    batch = [BatchLine(1, "r0", CHAT, {"id": "r0"}), BatchLine(2, "r1", CHAT, {"id": "r1"})]
    results: dict[str, int] = {}
    await run_lines(batch, send, lambda line, r: results.update({line.custom_id: r["response"]["status_code"]}),
                    concurrency=2, retry_delay=0.001)
    assert results == {"r0": 200, "r1": 400}


async def test_stop_cancels_the_lines_in_flight_and_sends_no_more() -> None:
    stop = asyncio.Event()
    started: list[str] = []
    cancelled: list[str] = []

    async def send(url: str, body: dict[str, Any]) -> tuple[int, Any]:
        started.append(body["id"])
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(body["id"])
            raise
        return 200, {}

    batch = [BatchLine(i, f"r{i}", CHAT, {"id": f"r{i}"}) for i in range(10)]
    run = asyncio.create_task(run_lines(batch, send, lambda *_: pytest.fail("no result"), concurrency=2, stop=stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(run, timeout=2)
    assert started == ["r0", "r1"] and sorted(cancelled) == ["r0", "r1"]
