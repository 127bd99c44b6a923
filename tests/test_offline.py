"""The offline engine (`from lmserve import LLM`) on llama.cpp: the embedded SmolLM2 for text, the tiny random LFM2-VL
(tests/tiny_lfm2_vl.py) for images, and docs/batches.md's example run as it is written.

One LLM per model for the module. The text model has 2 slots and a queue of 1, so a batch of 8 conversations also
checks that the offline engine keeps within the engine's queue bound.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import math
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from PIL import Image

from lmserve import LLM, ChatOutput, CompletionOutput
from tests.docs_pages import section
from tests.tiny_lfm2_vl import write_tiny_lfm2_vl

pytestmark = pytest.mark.model  # llama.cpp runs behind LLM, which the lanes' module scan cannot see

GREEDY = {"temperature": 0, "max_tokens": 24}
QUESTIONS = ["What is 10 times 3?", "Name three animals.", "What is the capital of France?", "Say hello.",
             "Write a haiku about the sea.", "What is 2 + 2?", "Name a colour.", "What is water made of?"]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PERSON: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                          "required": ["name", "age"], "additionalProperties": False}


def ask(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh model store as LMSERVE_MODELS (the embedded model is registered in it), and no other LMSERVE_*."""
    path = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("LMSERVE_")]:
            patch.delenv(name)
        patch.setenv("LMSERVE_MODELS", str(path))
        yield path


@pytest.fixture(scope="module")
def llm(store: Path) -> Iterator[LLM]:
    with LLM("smollm2:135m", ctx_size=1024, parallel=2, max_queue=1) as opened:
        yield opened


# ---- text -----------------------------------------------------------------------------------------------------------


def test_a_batch_of_chats_equals_each_chat_alone(llm: LLM) -> None:
    together = llm.chat([ask(q) for q in QUESTIONS], GREEDY)  # 8 > 2 slots + a queue of 1
    alone = [llm.chat(ask(q), GREEDY) for q in QUESTIONS]
    assert [r.text for r in together] == [r.text for r in alone]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    first = together[0]
    assert isinstance(first, ChatOutput) and first.text == "10 times 3 is 30." and first.finish_reason == "stop"
    assert first.usage.prompt_tokens == len(first.prompt_token_ids) and first.usage.completion_tokens > 0
    assert len(first.token_ids) == first.usage.completion_tokens and first.logprobs is None


def test_sampling_may_differ_per_conversation(llm: LLM) -> None:
    short, long = llm.chat([ask(QUESTIONS[1]), ask(QUESTIONS[1])], [{**GREEDY, "max_tokens": 3}, GREEDY])
    assert (short.finish_reason, short.usage.completion_tokens, len(short.token_ids)) == ("length", 3, 3)
    assert long.finish_reason == "stop" and long.text.startswith(short.text)
    with pytest.raises(ValueError, match="2 sampling settings for 1 inputs"):
        llm.chat([ask("Hi")], [GREEDY, GREEDY])


def test_generate_continues_raw_prompts(llm: LLM) -> None:
    one = llm.generate("The capital of France is", {"temperature": 0, "max_tokens": 2})
    assert isinstance(one, CompletionOutput) and one.text == " Paris." and one.finish_reason == "length"
    assert one.prompt_token_ids and len(one.prompt_token_ids) == one.usage.prompt_tokens
    many = llm.generate(["The capital of France is", "One, two, three,"], {"temperature": 0, "max_tokens": 2})
    assert many[0].text == one.text and many[1].text.strip().startswith("four")


def test_logprobs_as_openai_or_as_a_count(llm: LLM) -> None:
    reply = llm.chat(ask("Say hello."), {**GREEDY, "logprobs": True, "top_logprobs": 2})
    counted = llm.chat(ask("Say hello."), {**GREEDY, "logprobs": 2})
    assert reply.logprobs is not None and counted.logprobs == reply.logprobs
    assert len(reply.logprobs) == reply.usage.completion_tokens
    assert [entry.token for entry in reply.logprobs] == reply.token_ids
    assert all(entry.logprob <= 0 and len(entry.top) == 2 and entry.top[0].logprob >= entry.top[1].logprob
               for entry in reply.logprobs)
    assert "".join(entry.text for entry in reply.logprobs) == reply.text
    completion = llm.generate("One, two,", {"temperature": 0, "max_tokens": 3, "logprobs": True})
    assert completion.logprobs is not None and len(completion.logprobs) == 3
    assert all(entry.top == [] or len(entry.top) == 1 for entry in completion.logprobs)


def test_json_schema_output_parses(llm: LLM) -> None:
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    replies = llm.chat([ask("Invent a person."), ask("Describe a famous scientist.")],
                       {"temperature": 0, "max_tokens": 40, "response_format": form})
    for reply in replies:
        jsonschema.validate(json.loads(reply.text), PERSON)
    completion = llm.generate("A person as JSON:", {"temperature": 0, "max_tokens": 40, "response_format": form})
    jsonschema.validate(json.loads(completion.text), PERSON)


def test_a_forced_tool_call_is_parsed(llm: LLM) -> None:
    reply = llm.chat(ask("What is the weather in Paris?"), {"temperature": 0, "max_tokens": 60},
                     tools=[WEATHER], tool_choice="required")
    [call] = reply.tool_calls
    assert reply.finish_reason == "tool_calls" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    follow_up = [*ask("What is the weather in Paris?"),
                 {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "call_1", "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]
    answer = llm.chat(follow_up, GREEDY, tools=[WEATHER])
    assert answer.text and answer.finish_reason in ("stop", "length")


def test_embeddings_are_unit_vectors_nearer_for_nearer_texts(llm: LLM) -> None:
    texts = ["The cat sat on the mat.", "A kitten is sitting on a rug.", "Interest rates rose again this quarter."]
    vectors = llm.embed(texts)
    assert len(vectors) == 3 and all(len(v) == 576 for v in vectors)
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0, abs_tol=1e-5) for v in vectors)

    def cos(a: list[float], b: list[float]) -> float:
        return math.fsum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2])
    assert llm.embed(texts[2]) == pytest.approx(vectors[2], abs=1e-6)
    assert len(llm.embed(texts[0], dimensions=8)) == 8


@pytest.mark.parametrize(("part", "named"), [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
    ({"type": "audio", "audio": b"RIFF"}, "audio"),
    ({"text": "no type"}, "None"),
])
def test_a_part_neither_text_nor_image_is_a_value_error_naming_its_type(llm: LLM, part: dict[str, Any],
                                                                        named: str) -> None:
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Listen."}, part]}]
    with pytest.raises(ValueError, match=f"conversation 1, message 0, part 1: a content part of type '?{named}'?"):
        llm.chat([ask("Hi"), conversation], GREEDY)


@pytest.mark.parametrize(("sampling", "message"), [
    ({"temprature": 0}, "unknown sampling option\\(s\\) temprature"),
    ({"n": 2}, "n > 1"),
    ({"num_ctx": 2048}, "unknown sampling option"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_sampling_is_refused_before_anything_runs(llm: LLM, sampling: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.chat(ask("Hi"), sampling)


def test_unknown_load_options_and_chat_fields_are_type_errors(store: Path, llm: LLM) -> None:
    with pytest.raises(TypeError, match="ctx_sise"):
        LLM("smollm2:135m", ctx_sise=1024)
    with pytest.raises(TypeError, match="unknown field\\(s\\) stream"):
        llm.chat(ask("Hi"), GREEDY, stream=True)
    assert llm.chat(ask("Hi"), {**GREEDY, "max_tokens": 2}, parallel_tool_calls=False).usage.completion_tokens == 2


def test_a_closed_llm_refuses_work(store: Path) -> None:
    opened = LLM("smollm2:135m", ctx_size=256, parallel=1, cache_disk=0)
    assert opened.generate("Hi", {"max_tokens": 1}).usage.completion_tokens == 1
    opened.close()
    opened.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        opened.generate("Hi")


def test_importing_lmserve_loads_no_web_framework_or_engine() -> None:
    import subprocess  # here, not at the top: the lanes read a module-level subprocess as a server test

    code = ("import sys, lmserve; heavy = {'fastapi', 'uvicorn', 'llama_cpp', 'vllm', 'torch', 'mlx'} & "
            "{name.split('.')[0] for name in sys.modules}; print(sorted(heavy)); lmserve.LLM")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_the_docs_example_runs_as_written(store: Path) -> None:
    [code] = re.findall(r"```python\n(.*?)```", section("batches.md", "Python: offline inference"), re.DOTALL)
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(code, "docs/batches.md", "exec"), {"__name__": "docs"})
    lines = out.getvalue().splitlines()
    assert lines[0] == "10 times 3 is 30. stop 10", lines
    assert json.loads(lines[-3])["age"] >= 0
    assert lines[-2:] == [" Paris.", "576"]


def test_mlx_answers_a_batch_as_each_alone(store: Path) -> None:
    """The same offline engine over MLX (its CPU build here; float32, so batch invariant)."""
    if importlib.util.find_spec("mlx_lm") is None:
        pytest.skip("the MLX engine needs mlx and mlx-lm (pip install 'lmserve[mlx]')")
    from tests.hf_repos import smollm2_repo  # here: a module-level import would put every test on vLLM's lane

    sampling = {"temperature": 0, "max_tokens": 12}
    with LLM(smollm2_repo(), engine="mlx", ctx_size=1024, parallel=2, max_queue=1) as mlx:
        together = mlx.chat([ask(q) for q in QUESTIONS[:4]], sampling)
        assert [r.token_ids for r in together] == [mlx.chat(ask(q), sampling).token_ids for q in QUESTIONS[:4]]
    assert together[0].text == "10 times 3 is 30." and together[0].finish_reason == "stop"


# ---- images ---------------------------------------------------------------------------------------------------------


def png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(out, "PNG")
    return out.getvalue()


RED = png((255, 0, 0))
BLUE = png((0, 0, 255))


@dataclass(frozen=True)
class ImageHost:
    """A tiny HTTP server on 127.0.0.1 serving RED at /red.png."""

    http: ThreadingHTTPServer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}/red.png"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http.server_address[1]}"


@pytest.fixture(scope="module")
def image_host() -> Iterator[ImageHost]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(RED)))
            self.end_headers()
            self.wfile.write(RED)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield ImageHost(http)
    http.shutdown()
    http.server_close()
    thread.join()


@pytest.fixture(scope="module")
def vision(store: Path, image_host: ImageHost, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    directory = tmp_path_factory.mktemp("tiny-vl")
    model, projector = directory / "tiny-lfm2-vl.gguf", directory / "mmproj-tiny-lfm2-vl.gguf"
    write_tiny_lfm2_vl(model, projector)
    with LLM(model, mmproj=str(projector), ctx_size=1024, parallel=4, threads=1,
             image_allow_hosts=(image_host.address,)) as opened:
        yield opened


def look(image_part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image_part]}]


def test_images_of_every_kind_and_text_alone_in_one_call(vision: LLM, image_host: ImageHost, tmp_path: Path) -> None:
    path = tmp_path / "red.png"
    path.write_bytes(RED)
    data_uri = "data:image/png;base64," + base64.b64encode(RED).decode()
    conversations = [
        look({"type": "image_url", "image_url": {"url": str(path)}}),
        [{"role": "user", "content": "What is in this picture?"}],
        look({"type": "image", "image": RED}),
        look({"type": "image_url", "image_url": {"url": data_uri}}),
        look({"type": "image", "image": Image.open(io.BytesIO(RED))}),
        look({"type": "image", "image": path}),
        look({"type": "image_url", "image_url": {"url": image_host.url}}),
        look({"type": "image", "image": BLUE}),
    ]
    replies = vision.chat(conversations, {"temperature": 0, "max_tokens": 6})
    text_only, blue = replies.pop(1), replies.pop()
    assert blue.text != replies[0].text and blue.usage.prompt_tokens == replies[0].usage.prompt_tokens
    assert {r.text for r in replies} == {replies[0].text}  # the same image, however it came
    assert {r.prompt_token_ids == replies[0].prompt_token_ids for r in replies} == {True}
    assert replies[0].usage.prompt_tokens - text_only.usage.prompt_tokens >= 64  # a 64x64 image: 64 tokens
    alone = vision.chat(conversations[0], {"temperature": 0, "max_tokens": 6})
    assert alone.text == replies[0].text


def test_a_missing_image_file_is_a_value_error(vision: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such image file"):
        vision.chat(look({"type": "image", "image": tmp_path / "absent.png"}))
