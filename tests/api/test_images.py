"""Images in both dialects over a fake vision model: loading, checking, counting, and each refusal as a 400."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import pytest_asyncio
from api_wire import assert_openai_error
from PIL import Image

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import PIXELS_PER_IMAGE_TOKEN, FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel


def png(width: int, height: int, color: str = "red") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class _Images(BaseHTTPRequestHandler):
    """Serves /a.png, /redirect (to the URL in the query) and /text."""

    def do_GET(self) -> None:
        if self.path == "/a.png":
            body = png(32, 32)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path.startswith("/redirect?"):
            self.send_response(302)
            self.send_header("Location", self.path.partition("?")[2])
            self.end_headers()
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html></html>")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def vision_engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=2048, num_parallel=4, vision=True))
    yield engine
    engine.close()


@pytest_asyncio.fixture
async def vision(
    vision_engine: BatchingEngine, engine: BatchingEngine, image_host: str
) -> AsyncIterator[httpx.AsyncClient]:
    """An app serving "seer" (vision) and "fake" (text only); image URLs may reach `image_host` only."""
    models = [LoadedModel(name="seer", engine=vision_engine, template=ChatTemplate(None)),
              LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))]
    config = ServerConfig(image_allow_hosts=(image_host,), image_max_bytes=200_000)
    app = create_app(static_service(models), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client


def image_chat(*urls: str, model: str = "seer", text: str = "what is it?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 3}


def assert_refused(response: httpx.Response, why: str) -> None:
    """A 400 in the OpenAI error shape, naming messages, whose message contains `why`."""
    assert response.status_code == 400, response.text
    error = assert_openai_error(response.json(), error_type="invalid_request_error")
    assert error["param"] == "messages"
    assert why in error["message"], error["message"]


async def prompt_tokens(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens"])


async def test_image_positions_count_as_prompt_tokens(vision: httpx.AsyncClient) -> None:
    without = await prompt_tokens(vision, image_chat())
    one = await prompt_tokens(vision, image_chat(data_uri(png(64, 32))))
    two = await prompt_tokens(vision, image_chat(data_uri(png(64, 32)), data_uri(png(64, 64))))
    per_image = 64 * 32 // PIXELS_PER_IMAGE_TOKEN
    assert one - without == per_image
    assert two - one == 64 * 64 // PIXELS_PER_IMAGE_TOKEN


async def test_an_allowed_http_url_is_fetched_like_a_data_uri(vision: httpx.AsyncClient, image_host: str) -> None:
    fetched = await prompt_tokens(vision, image_chat(f"http://{image_host}/a.png"))
    inline = await prompt_tokens(vision, image_chat(data_uri(png(32, 32))))
    assert fetched == inline


async def test_streamed_image_chat_works(vision: httpx.AsyncClient) -> None:
    body = {**image_chat(data_uri(png(16, 16))), "stream": True}
    async with vision.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        text = (await response.aread()).decode()
    assert text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "http(s) URL or a data: URI"),
        ("ftp://example.com/a.png", "http(s) URL or a data: URI"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://10.0.0.1/a.png", "private"),
        ("http://[::1]/a.png", "loopback"),
        ("data:image/png;base64,@@@", "base64"),
        ("data:text/plain;base64,aGk=", "not an image"),
        (data_uri(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10), "not a valid image"),
        (data_uri(png(64, 64)[:60]), "not a valid image"),
    ],
)
async def test_refused_images_are_400_saying_why(vision: httpx.AsyncClient, url: str, why: str) -> None:
    response = await vision.post("/v1/chat/completions", json=image_chat(url))
    assert_refused(response, why)
    assert "messages[0].content[1]" in response.json()["error"]["message"]


async def test_loopback_outside_the_allow_list_is_refused_directly_and_by_redirect(
    vision: httpx.AsyncClient, image_host: str
) -> None:
    host, _, port = image_host.partition(":")
    other_port = f"http://{host}:{int(port) + 1}/a.png" if int(port) < 65535 else f"http://{host}:1/a.png"
    response = await vision.post("/v1/chat/completions", json=image_chat(other_port))
    assert_refused(response, "loopback")
    redirect = f"http://{image_host}/redirect?http://localhost:{port}/a.png"  # allowed host → a name it does not allow
    response = await vision.post("/v1/chat/completions", json=image_chat(redirect))
    assert_refused(response, "loopback")


async def test_a_page_that_is_not_an_image_and_an_oversized_image_are_refused(
    vision: httpx.AsyncClient, image_host: str
) -> None:
    response = await vision.post("/v1/chat/completions", json=image_chat(f"http://{image_host}/text"))
    assert_refused(response, "not an image")
    big = Image.frombytes("RGB", (300, 300), bytes(range(256)) * (300 * 300 * 3 // 256) + b"\0" * (300 * 300 * 3 % 256))
    buf = io.BytesIO()
    big.save(buf, "BMP")  # uncompressed: 270 KB, over the 200 KB cap
    response = await vision.post("/v1/chat/completions", json=image_chat(data_uri(buf.getvalue())))
    assert_refused(response, "too large")


async def test_a_model_without_vision_refuses_images_before_fetching(vision: httpx.AsyncClient) -> None:
    response = await vision.post("/v1/chat/completions", json=image_chat("http://192.0.2.1/a.png", model="fake"))
    assert_refused(response, "no vision projector")


async def test_native_chat_and_generate_take_base64_images(vision: httpx.AsyncClient) -> None:
    image = base64.b64encode(png(64, 16)).decode()
    body = {"model": "seer", "messages": [{"role": "user", "content": "hi", "images": [image]}], "stream": False,
            "options": {"num_predict": 2}}
    with_image = (await vision.post("/api/chat", json=body)).json()
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # the fake tokenizes bytes; nothing cached yet
    assert with_image["prompt_eval_count"] == len(chatml) + 64 * 16 // PIXELS_PER_IMAGE_TOKEN
    generated = await vision.post("/api/generate", json={"model": "seer", "prompt": "hi", "stream": False,
                                                         "images": ["data:image/png;base64," + image],
                                                         "options": {"num_predict": 2}})
    assert generated.status_code == 200, generated.text
    assert "context" not in generated.json()  # image positions are no tokens to send back
    raw = await vision.post("/api/generate", json={"model": "seer", "prompt": "hi", "raw": True, "stream": False,
                                                   "images": [image], "options": {"num_predict": 2}})
    assert raw.status_code == 200, raw.text


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        ("/api/chat", {"model": "fake", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
         "no vision projector"),
        ("/api/generate", {"model": "fake", "prompt": "x", "images": ["aGk="]}, "no vision projector"),
        ("/api/chat", {"model": "seer", "messages": [{"role": "user", "content": "x", "images": ["@@"]}]},
         "messages[0].images[0]"),
        ("/api/generate", {"model": "seer", "prompt": "x", "images": ["aGk="]}, "images[0]: not a valid image"),
    ],
)
async def test_native_image_refusals_are_400(vision: httpx.AsyncClient, path: str, body: dict[str, Any],
                                             why: str) -> None:
    response = await vision.post(path, json=body)
    assert response.status_code == 400, response.text
    assert why in response.json()["error"]


async def test_show_lists_vision_only_for_the_vision_model(vision: httpx.AsyncClient) -> None:
    seer = (await vision.post("/api/show", json={"model": "seer"})).json()
    fake = (await vision.post("/api/show", json={"model": "fake"})).json()
    assert "vision" in seer["capabilities"] and "vision" not in fake["capabilities"]


async def test_more_images_than_the_server_accepts_is_400(
    vision: httpx.AsyncClient, vision_engine: BatchingEngine
) -> None:
    too_many = [data_uri(png(8, 8))] * 17  # the default limit is 16 (LMSERVE_MAX_IMAGES)
    assert_refused(await vision.post("/v1/chat/completions", json=image_chat(*too_many)), "more than this server")
    image = base64.b64encode(png(8, 8)).decode()
    response = await vision.post("/api/generate", json={"model": "seer", "prompt": "x", "images": [image] * 17})
    assert response.status_code == 400 and "more than this server" in response.json()["error"]
