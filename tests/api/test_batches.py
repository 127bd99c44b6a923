"""`/v1/batches` in process through the official `openai` client, over a fake engine: a batch runs to completion
with OpenAI's output and error files, bad lines are refused line by line, an input that is no JSONL fails the batch,
cancel keeps what finished, and a server that stops mid-batch resumes it with no line lost or written twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import batch_runner as batches_module
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

BASE = "http://test"


@pytest.fixture
def engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=2, step_delay=0.001))
    yield engine
    engine.close()


@contextlib.asynccontextmanager
async def serving(engine: BatchingEngine, models: Path, **config: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    """The app over `engine`, its lifespan running (batches run and resume there), and an openai client of it."""
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))
    app: FastAPI = create_app(static_service([model]), ServerConfig(models_dir=str(models), **config))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url=BASE) as http:
        yield openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="x", http_client=http,  # type: ignore[arg-type]
                                 max_retries=0)


def chat_line(custom_id: str, text: str = "hello", max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}}


def jsonl(*lines: dict[str, Any] | str) -> bytes:
    return b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines)


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 30) -> Any:
    for _ in range(int(timeout / 0.02)):
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch {batch_id} is still {batch.status}")


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def test_a_chat_batch_runs_to_completion_with_openais_output_lines(engine: BatchingEngine,
                                                                          tmp_path: Path) -> None:
    async with serving(engine, tmp_path) as client:
        upload = await client.files.create(file=("in.jsonl", jsonl(*(chat_line(f"r{i}", f"q{i}") for i in range(9)))),
                                           purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"job": "nightly"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
        assert batch.expires_at == batch.created_at + 24 * 3600
        done = await finished(client, batch.id)
        assert done.status == "completed" and done.error_file_id is None
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (9, 9, 0)
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        assert done.completed_at >= done.in_progress_at >= done.created_at
        out = await lines_of(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in out) == sorted(f"r{i}" for i in range(9))
        for line in out:
            assert line["error"] is None and line["id"].startswith("batch_req_")
            response = line["response"]
            assert response["status_code"] == 200 and response["body"]["object"] == "chat.completion"
            assert response["body"]["usage"]["completion_tokens"] == 4
        assert done.usage is not None and done.usage.output_tokens == 9 * 4
        output = await client.files.retrieve(done.output_file_id)
        assert output.purpose == "batch_output" and output.filename == f"{batch.id}_output.jsonl"
        listed = await client.batches.list()
        assert [b.id for b in listed.data] == [batch.id]


async def test_bad_lines_go_to_the_error_file_with_their_custom_id_and_the_rest_run(engine: BatchingEngine,
                                                                                     tmp_path: Path) -> None:
    other_url = {**chat_line("wrong-url"), "url": "/v1/completions"}
    streaming = chat_line("streams")
    streaming["body"]["stream"] = True
    unknown_model = chat_line("no-such-model")
    unknown_model["body"]["model"] = "missing"
    data = jsonl(chat_line("ok1"), "{not json", {"method": "POST", "url": "/v1/chat/completions", "body": {}},
                 other_url, streaming, unknown_model, chat_line("ok2"))
    async with serving(engine, tmp_path) as client:
        upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        done = await finished(client, batch.id)
        assert done.status == "completed"
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 2, 5)
        assert sorted(line["custom_id"] for line in await lines_of(client, done.output_file_id)) == ["ok1", "ok2"]
        errors = {(line["custom_id"], line["error"]["code"] if line["error"] else line["response"]["status_code"]):
                  line for line in await lines_of(client, done.error_file_id)}
        assert set(errors) == {(None, "invalid_json_line"), (None, "invalid_request"), ("wrong-url", "invalid_request"),
                               ("streams", "invalid_request"), ("no-such-model", 404)}
        assert "endpoint /v1/chat/completions" in errors["wrong-url", "invalid_request"]["error"]["message"]
        assert errors["no-such-model", 404]["response"]["body"]["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (b"id,question\n1,what\n", "invalid_json_line", "JSONL"),
        (jsonl(chat_line("a"), chat_line("b"), chat_line("a")), "duplicate_custom_id", "line 3: custom_id 'a'"),
    ],
)
async def test_an_input_that_is_no_jsonl_or_repeats_a_custom_id_fails_the_batch(
    engine: BatchingEngine, tmp_path: Path, data: bytes, code: str, words: str,
) -> None:
    async with serving(engine, tmp_path) as client:
        upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        done = await finished(client, batch.id)
        assert done.status == "failed" and done.failed_at
        assert done.errors is not None and done.errors.data
        assert done.errors.data[0].code == code and words in (done.errors.data[0].message or "")
        assert done.output_file_id is None and engine.stats.step_ns == 0  # nothing ran


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/moderations"}, "endpoint"),
        ({"completion_window": "1 day"}, "completion_window"),
        ({"input_file_id": "file-nope"}, "input_file_id"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
async def test_a_create_that_cannot_run_is_a_400_naming_the_field(engine: BatchingEngine, tmp_path: Path,
                                                                   change: dict[str, Any], param: str) -> None:
    async with serving(engine, tmp_path) as client:
        upload = await client.files.create(file=("in.jsonl", jsonl(chat_line("a"))), purpose="batch")
        arguments: dict[str, Any] = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions",
                                     "completion_window": "24h", **change}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.batches.create(**arguments)
        body = caught.value.response.json()
        assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


async def test_a_file_uploaded_for_another_purpose_is_refused(engine: BatchingEngine, tmp_path: Path) -> None:
    async with serving(engine, tmp_path) as client:
        upload = await client.files.create(file=("in.jsonl", jsonl(chat_line("a"))), purpose="user_data")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")


async def test_unknown_batches_are_404_and_an_ended_one_cannot_be_cancelled(engine: BatchingEngine,
                                                                              tmp_path: Path) -> None:
    async with serving(engine, tmp_path) as client:
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_0000000000000000ffffffffffffffff")
        with pytest.raises(openai.NotFoundError):
            await client.batches.cancel("batch_nope")
        upload = await client.files.create(file=("in.jsonl", jsonl(chat_line("a"))), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        await finished(client, batch.id)
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(batch.id)


async def test_cancel_stops_the_batch_promptly_and_keeps_what_finished(tmp_path: Path) -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=2, step_delay=0.005))
    try:
        async with serving(engine, tmp_path, batch_concurrency=2) as client:
            data = jsonl(*(chat_line(f"r{i}", max_tokens=20) for i in range(200)))
            upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 3:  # type: ignore[union-attr]
                await asyncio.sleep(0.01)
            cancelling = await client.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
            done = await finished(client, batch.id)
            assert done.status == "cancelled" and done.cancelled_at
            out = await lines_of(client, done.output_file_id)
            ids = [line["custom_id"] for line in out]
            assert len(ids) == len(set(ids)) == done.request_counts.completed
            assert 3 <= len(ids) < 200
            for _ in range(1000):  # the engine thread applies aborts at its next turn
                if engine.num_running == 0 and engine.num_waiting == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.num_running == 0 and engine.num_waiting == 0  # the lines in flight were aborted
    finally:
        engine.close()


async def test_a_server_that_stops_mid_batch_resumes_it_with_no_line_lost_or_written_twice(tmp_path: Path) -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=2, step_delay=0.003))
    try:
        data = jsonl(*(chat_line(f"r{i}", max_tokens=8) for i in range(60)))
        async with serving(engine, tmp_path, batch_concurrency=4) as client:
            upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 10:  # type: ignore[union-attr]
                await asyncio.sleep(0.01)
        log = tmp_path / "batches" / "runs" / f"{batch.id}.output.jsonl"
        written = log.read_bytes().count(b"\n")
        assert 10 <= written < 60
        with open(log, "ab") as half:  # a crash in the middle of writing a line
            half.write(b'{"id": "batch_req_x", "custom_id": "r59", "resp')
        async with serving(engine, tmp_path) as client:
            done = await finished(client, batch.id)
            assert done.status == "completed"
            out = await lines_of(client, done.output_file_id)
            ids = [line["custom_id"] for line in out]
            assert sorted(ids) == sorted(f"r{i}" for i in range(60))  # each exactly once
            assert done.request_counts is not None and done.request_counts.completed == 60
            assert done.usage is not None and done.usage.output_tokens == 60 * 8
    finally:
        engine.close()


async def test_responses_and_completions_lines_run_as_their_routes_answer(engine: BatchingEngine,
                                                                          tmp_path: Path) -> None:
    responses = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "fake", "input": f"question {i}", "max_output_tokens": 3}} for i in range(3)]
    completions = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "fake", "prompt": f"text {i}", "max_tokens": 3}} for i in range(3)]
    async with serving(engine, tmp_path) as client:
        for endpoint, lines, kind in (("/v1/responses", responses, "response"),
                                      ("/v1/completions", completions, "text_completion")):
            upload = await client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint=endpoint,  # type: ignore[arg-type]
                                                completion_window="24h")
            done = await finished(client, batch.id)
            assert done.status == "completed" and done.request_counts.completed == 3
            out = await lines_of(client, done.output_file_id)
            assert {line["response"]["body"]["object"] for line in out} == {kind}


async def test_lines_not_run_when_the_window_passes_go_to_the_error_file_and_the_batch_expires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("lmserve.service.batch_runner.window_seconds", lambda window: 1)
    expire = batches_module._expire

    def expire_once_a_line_is_done(run: Any) -> None:
        # A loaded machine may not finish a line within the 1 s window; the window then waits for one, so the
        # batch always expires with some lines done and some not run.
        if run.record.completed == 0:
            asyncio.get_running_loop().call_later(0.05, expire_once_a_line_is_done, run)
        else:
            expire(run)

    monkeypatch.setattr(batches_module, "_expire", expire_once_a_line_is_done)
    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=2, step_delay=0.005))
    try:
        async with serving(engine, tmp_path, batch_concurrency=2) as client:
            data = jsonl(*(chat_line(f"r{i}", max_tokens=20) for i in range(300)))
            upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            done = await finished(client, batch.id)
            assert done.status == "expired" and done.expired_at
            counts = done.request_counts
            assert counts is not None and counts.total == 300 and counts.completed + counts.failed == 300
            assert 0 < counts.completed < 300
            errors = await lines_of(client, done.error_file_id)
            assert len(errors) == counts.failed and {e["error"]["code"] for e in errors} == {"batch_expired"}
            done_ids = {line["custom_id"] for line in await lines_of(client, done.output_file_id)}
            assert done_ids.isdisjoint(e["custom_id"] for e in errors)
    finally:
        engine.close()
