"""End to end: images through a real `lmserve serve` with the tiny random LFM2-VL model (tests/tiny_lfm2_vl.py).

One server serves the model with its projector (`-m … --mmproj …`, `-c 4096` for tiled images) and lets image URLs
reach exactly one loopback `host:port`: a tiny HTTP server this module starts. A second one on another port serves
the same image and must never be contacted. The model writes gibberish, so the tests check structure and
relations (token counts, equal or different replies at temperature 0), never wording.

The server runs one thread (`-t 1`): the model is tiny, and llama.cpp's spinning worker threads stall for seconds
per request when the two cores are shared with other work.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pexpect
import pytest
from openai.types.chat import ChatCompletionContentPartParam, ChatCompletionMessageParam
from PIL import Image

from tests.test_server import MODEL as TEXT_MODEL
from tests.test_server import Server
from tests.tiny_lfm2_vl import write_tiny_lfm2_vl

VL_MODEL = "tiny-lfm2-vl:latest"  # the served file's stem
PROMPT = "What is in this picture?"
MAX_BYTES = 50_000  # LMSERVE_IMAGE_MAX_BYTES for the server: every good image here is smaller
TIMEOUT = 60.0


# ---- images --------------------------------------------------------------------------------------------------------


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def solid(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    return png(Image.new("RGB", size, colour))


def noise(size: tuple[int, int], seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return png(Image.fromarray(pixels, "RGB"))


def gradient(size: tuple[int, int]) -> bytes:
    return png(Image.linear_gradient("L").resize(size).convert("RGB"))


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


RED = solid((64, 64), (255, 0, 0))  # 64 image tokens
NOISE = noise((64, 64), seed=1)  # 64 image tokens, ~12 KB
BLUE_300x200 = solid((300, 200), (0, 0, 255))  # 70 image tokens
TILED_1024x768 = gradient((1024, 768))  # 3x2 tiles + thumbnail: 1770 image tokens
BIG_NOISE = noise((160, 160), seed=2)  # ~77 KB: over MAX_BYTES
TRUNCATED = NOISE[: len(NOISE) // 2]


# ---- the image hosts -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    status: int
    headers: dict[str, str]
    body: bytes = b""


class ImageHost:
    """A tiny HTTP server on 127.0.0.1 in a thread: GET answers from `routes`; `hits` lists every path asked for."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: list[str] = []
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host.hits.append(self.path)
                route = host.routes.get(self.path, Route(404, {"Content-Type": "text/plain"}, b"not found"))
                self.send_response(route.status)
                for name, value in route.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(route.body)))
                self.end_headers()
                self.wfile.write(route.body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.http.server_address[1])
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join()


@dataclass
class Hosts:
    allowed: ImageHost  # named by --image-allow-host 127.0.0.1:PORT
    forbidden: ImageHost  # the same address, another port: not on the allow-list


def png_route(data: bytes) -> Route:
    return Route(200, {"Content-Type": "image/png"}, data)


def redirect(location: str) -> Route:
    return Route(302, {"Location": location})


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    allowed, forbidden = ImageHost(), ImageHost()
    forbidden.routes["/noise.png"] = png_route(NOISE)
    allowed.routes.update({
        "/noise.png": png_route(NOISE),
        "/big.png": png_route(BIG_NOISE),
        "/page.html": Route(200, {"Content-Type": "text/html"}, b"<html>not an image</html>"),
        "/to-self": redirect("/noise.png"),
        "/to-forbidden": redirect(forbidden.url("/noise.png")),
        "/to-localhost": redirect(forbidden.url("/noise.png", host="localhost")),
        "/to-metadata": redirect("http://169.254.169.254/latest/meta-data"),
        "/to-file": redirect("file:///etc/passwd"),
    })
    yield Hosts(allowed, forbidden)
    allowed.close()
    forbidden.close()


# ---- the server ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionFiles:
    model: Path
    mmproj: Path


@pytest.fixture(scope="module")
def vl_files(tmp_path_factory: pytest.TempPathFactory) -> VisionFiles:
    directory = tmp_path_factory.mktemp("tiny-vl")
    files = VisionFiles(directory / "tiny-lfm2-vl.gguf", directory / "mmproj-tiny-lfm2-vl.gguf")
    write_tiny_lfm2_vl(files.model, files.mmproj)
    return files


@pytest.fixture(scope="module")
def server(vl_files: VisionFiles, hosts: Hosts) -> Iterator[Server]:
    srv = Server("-m", str(vl_files.model), "--mmproj", str(vl_files.mmproj), "-c", "4096", "-t", "1",
                 "--image-allow-host", f"127.0.0.1:{hosts.allowed.port}",
                 env={"LMSERVE_IMAGE_MAX_BYTES": str(MAX_BYTES)})
    yield srv
    log = srv.stop()
    assert "Traceback" not in log, log  # every refusal above is a handled 400, never a crash


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client().with_options(timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def native(server: Server) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url, timeout=TIMEOUT) as c:
        yield c


NATIVE_OPTIONS = {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}
"""Greedy, and without the native routes' default repeat penalty (1.1), so both dialects sample alike."""


@pytest.fixture(scope="module")
def short_model(native: ollama.Client) -> str:
    """The vision model with a short reply by default: `lmserve run` has no flag for it, and the random model
    would otherwise write until the context is full."""
    created = native.create(model="vl-short", from_=VL_MODEL, parameters=NATIVE_OPTIONS)
    assert created.status == "success"
    return "vl-short:latest"


@pytest.fixture(scope="module")
def image_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("images")
    paths = {"red": directory / "red.png", "noise": directory / "noise.png"}
    paths["red"].write_bytes(RED)
    paths["noise"].write_bytes(NOISE)
    return paths


# ---- helpers -------------------------------------------------------------------------------------------------------


def user(text: str, *urls: str) -> list[ChatCompletionMessageParam]:
    """One user message: the text part, then one image part per URL."""
    parts: list[ChatCompletionContentPartParam] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int


def ask(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int = 8) -> Answer:
    reply = client.chat.completions.create(model=VL_MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    assert reply.usage is not None
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    return Answer(reply.choices[0].message.content or "", reply.usage.prompt_tokens)


def image_tokens(client: openai.OpenAI, *urls: str) -> int:
    """How many more prompt tokens PROMPT has with these images than without."""
    return ask(client, user(PROMPT, *urls)).prompt_tokens - ask(client, user(PROMPT)).prompt_tokens


def post_chat(server: Server, url: str, model: str = VL_MODEL) -> httpx.Response:
    body = {"model": model, "messages": user(PROMPT, url), "max_tokens": 4, "temperature": 0}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)


def refusal(response: httpx.Response) -> str:
    """The lowercased message of a 400 in the OpenAI error shape."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return str(error["message"]).lower()


def native_refusal(response: httpx.Response) -> str:
    """The lowercased message of a 400 in the native error shape ({"error": "…"})."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert isinstance(error, str) and error
    return error.lower()


def cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}"}
    return subprocess.run([sys.executable, "-m", "lmserve", *args], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120, check=False)


# ---- OpenAI route --------------------------------------------------------------------------------------------------


def test_the_vision_model_is_listed_beside_the_text_model(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert VL_MODEL in ids
    assert TEXT_MODEL in ids


def test_one_image_by_data_uri(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=VL_MODEL, messages=user(PROMPT, data_uri(RED)), temperature=0,
                                           max_tokens=8)
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens - ask(client, user(PROMPT)).prompt_tokens >= 64


def test_the_reply_depends_on_the_image(client: openai.OpenAI) -> None:
    red = ask(client, user(PROMPT, data_uri(RED)))
    noisy = ask(client, user(PROMPT, data_uri(NOISE)))
    assert red.text != noisy.text
    assert red.prompt_tokens == noisy.prompt_tokens  # both 64x64
    assert ask(client, user(PROMPT, data_uri(RED))) == red
    assert ask(client, user(PROMPT, data_uri(NOISE))) == noisy


def test_a_streamed_image_reply_equals_the_whole_one(client: openai.OpenAI) -> None:
    whole = ask(client, user(PROMPT, data_uri(NOISE)))
    chunks = list(client.chat.completions.create(
        model=VL_MODEL, messages=user(PROMPT, data_uri(NOISE)), temperature=0, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == whole.prompt_tokens


def test_several_images_in_one_message_add_up(client: openai.OpenAI) -> None:
    red = image_tokens(client, data_uri(RED))
    blue = image_tokens(client, data_uri(BLUE_300x200))
    both = image_tokens(client, data_uri(RED), data_uri(BLUE_300x200))
    assert red >= 64 and blue >= 70
    assert abs(both - (red + blue)) <= 2
    three = image_tokens(client, data_uri(RED), data_uri(BLUE_300x200), data_uri(NOISE))
    assert abs(three - (both + red)) <= 2  # NOISE is 64x64, as RED


def test_prompt_tokens_grow_with_the_image_size(client: openai.OpenAI) -> None:
    small = image_tokens(client, data_uri(RED))  # 64x64: 64
    medium = image_tokens(client, data_uri(BLUE_300x200))  # 70
    tiled = image_tokens(client, data_uri(TILED_1024x768))  # 6 tiles + thumbnail: 1770
    assert 64 <= small < medium < tiled
    assert medium - small == 70 - 64  # single views: the same markers around them
    assert tiled - small >= 1770 - 64


def test_an_http_url_on_the_allowed_host_equals_the_data_uri(client: openai.OpenAI, hosts: Hosts) -> None:
    by_data = ask(client, user(PROMPT, data_uri(NOISE)))
    before = len(hosts.allowed.hits)
    assert ask(client, user(PROMPT, hosts.allowed.url("/noise.png"))) == by_data
    assert hosts.allowed.hits[before:] == ["/noise.png"]
    assert ask(client, user(PROMPT, hosts.allowed.url("/to-self"))) == by_data  # a redirect within the allowed host
    mixed = ask(client, user(PROMPT, hosts.allowed.url("/noise.png"), data_uri(RED)))
    assert mixed == ask(client, user(PROMPT, data_uri(NOISE), data_uri(RED)))


def test_text_and_image_requests_together_equal_each_alone(server: Server, hosts: Hosts) -> None:
    requests: list[list[ChatCompletionMessageParam]] = [
        user("Count from one to five."), user("Name three colours."), user("Say hello."), user("Tell a story."),
        user(PROMPT, data_uri(RED)), user("Describe it.", hosts.allowed.url("/noise.png")),
        user("What colour is this?", data_uri(BLUE_300x200)), user(PROMPT, data_uri(TILED_1024x768)),
    ]

    async def one(client: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam]) -> Answer:
        reply = await client.chat.completions.create(model=VL_MODEL, messages=messages, temperature=0, max_tokens=12)
        assert reply.usage is not None
        return Answer(reply.choices[0].message.content or "", reply.usage.prompt_tokens)

    async def run() -> tuple[list[Answer], list[Answer]]:
        async with server.async_client() as client:
            together = await asyncio.gather(*(one(client, m) for m in requests))
            alone = [await one(client, m) for m in requests]
        return list(together), alone

    together, alone = asyncio.run(run())
    assert together == alone
    assert all(a.text for a in alone)


# ---- native routes -------------------------------------------------------------------------------------------------

def test_native_chat_with_images_by_path_and_bytes(native: ollama.Client, client: openai.OpenAI,
                                                   image_files: dict[str, Path]) -> None:
    plain = native.chat(model=VL_MODEL, messages=[{"role": "user", "content": PROMPT}], options=NATIVE_OPTIONS)
    by_path = native.chat(model=VL_MODEL, options=NATIVE_OPTIONS, messages=[
        ollama.Message(role="user", content=PROMPT, images=[ollama.Image(value=image_files["noise"])])])
    by_bytes = native.chat(model=VL_MODEL, options=NATIVE_OPTIONS, messages=[
        ollama.Message(role="user", content=PROMPT, images=[ollama.Image(value=NOISE)])])
    assert by_path.done and by_path.message.content
    assert by_path.message.content == by_bytes.message.content
    assert by_path.prompt_eval_count is not None and plain.prompt_eval_count is not None
    assert by_path.prompt_eval_count - plain.prompt_eval_count >= 64
    assert by_path.prompt_eval_count == by_bytes.prompt_eval_count
    red = native.chat(model=VL_MODEL, options=NATIVE_OPTIONS, messages=[
        ollama.Message(role="user", content=PROMPT, images=[ollama.Image(value=image_files["red"])])])
    assert red.message.content != by_path.message.content
    # the same conversation through the OpenAI route (the image part first, where native images go): the same reply
    image_first: list[ChatCompletionMessageParam] = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(NOISE)}}, {"type": "text", "text": PROMPT}]}]
    assert ask(client, image_first) == Answer(by_path.message.content or "", by_path.prompt_eval_count)
    # where the image part stands matters: after the text it is another prompt (same length, another reply)
    after = ask(client, user(PROMPT, data_uri(NOISE)))
    assert after.prompt_tokens == by_path.prompt_eval_count and after.text != by_path.message.content


def test_native_generate_with_an_image(native: ollama.Client) -> None:
    plain = native.generate(model=VL_MODEL, prompt=PROMPT, options=NATIVE_OPTIONS)
    seen = native.generate(model=VL_MODEL, prompt=PROMPT, images=[NOISE], options=NATIVE_OPTIONS)
    two = native.generate(model=VL_MODEL, prompt=PROMPT, images=[NOISE, BLUE_300x200], options=NATIVE_OPTIONS)
    assert seen.done and seen.response
    assert plain.prompt_eval_count is not None and seen.prompt_eval_count is not None
    assert two.prompt_eval_count is not None
    assert seen.prompt_eval_count - plain.prompt_eval_count >= 64
    assert two.prompt_eval_count - seen.prompt_eval_count >= 70
    again = native.generate(model=VL_MODEL, prompt=PROMPT, images=[NOISE], options=NATIVE_OPTIONS)
    assert again.response == seen.response


def test_show_reports_vision_only_for_the_model_with_a_projector(native: ollama.Client) -> None:
    assert "vision" in (native.show(VL_MODEL).capabilities or [])
    assert "vision" not in (native.show(TEXT_MODEL).capabilities or [])


def test_native_images_for_the_text_model_are_refused(native: ollama.Client) -> None:
    for call in (
        lambda: native.chat(model=TEXT_MODEL, messages=[ollama.Message(role="user", content=PROMPT,
                                                                        images=[ollama.Image(value=RED)])]),
        lambda: native.generate(model=TEXT_MODEL, prompt=PROMPT, images=[RED]),
    ):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 400
        assert "vision" in info.value.error.lower()


@pytest.mark.parametrize(
    ("route", "image", "words"),
    [
        ("/api/chat", base64.b64encode(b"not an image at all").decode(), ("not a valid image",)),
        ("/api/chat", base64.b64encode(TRUNCATED).decode(), ("not a valid image",)),
        ("/api/chat", base64.b64encode(BIG_NOISE).decode(), ("too large",)),
        ("/api/generate", "@@not base64@@", ("base64",)),
        ("/api/generate", base64.b64encode(BIG_NOISE).decode(), ("too large",)),
    ],
    ids=["chat-not-an-image", "chat-truncated", "chat-too-large", "generate-bad-base64", "generate-too-large"],
)
def test_bad_native_images_are_refused(server: Server, route: str, image: str, words: tuple[str, ...]) -> None:
    if route == "/api/chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPT, "images": [image]}]}
    else:
        body = {"prompt": PROMPT, "images": [image]}
    body |= {"model": VL_MODEL, "stream": False, "options": NATIVE_OPTIONS}
    message = native_refusal(httpx.post(server.base_url + route, json=body, timeout=TIMEOUT))
    assert all(word in message for word in words), message


# ---- refusals on the OpenAI route ----------------------------------------------------------------------------------

REFUSED_URLS: dict[str, tuple[Callable[[Hosts], str], tuple[str, ...]]] = {
    "loopback-other-port": (lambda h: h.forbidden.url("/noise.png"), ("loopback", "not allowed")),
    "localhost-other-port": (lambda h: h.forbidden.url("/noise.png", host="localhost"), ("loopback",)),
    "localhost-allowed-port": (lambda h: h.allowed.url("/noise.png", host="localhost"), ("loopback",)),
    "ipv4-mapped-ipv6": (lambda h: h.forbidden.url("/noise.png", host="[::ffff:127.0.0.1]"), ("loopback",)),
    "decimal-ip": (lambda h: h.forbidden.url("/noise.png", host="2130706433"), ("loopback",)),
    "unspecified": (lambda h: h.forbidden.url("/noise.png", host="0.0.0.0"), ("not allowed",)),
    "private": (lambda h: "http://10.0.0.1/x.png", ("private",)),
    "metadata": (lambda h: "http://169.254.169.254/latest/meta-data", ("metadata",)),
    "redirect-to-loopback": (lambda h: h.allowed.url("/to-forbidden"), ("loopback",)),
    "redirect-to-localhost": (lambda h: h.allowed.url("/to-localhost"), ("loopback",)),
    "redirect-to-metadata": (lambda h: h.allowed.url("/to-metadata"), ("metadata",)),
    "redirect-to-file": (lambda h: h.allowed.url("/to-file"), ("scheme",)),
    "file": (lambda h: "file:///etc/passwd", ("scheme",)),
    "ftp": (lambda h: f"ftp://127.0.0.1:{h.forbidden.port}/noise.png", ("scheme",)),
    "too-large-download": (lambda h: h.allowed.url("/big.png"), ("too large",)),
    "not-an-image-download": (lambda h: h.allowed.url("/page.html"), ("not an image",)),
    "missing-download": (lambda h: h.allowed.url("/missing.png"), ("404",)),
}


@pytest.mark.parametrize("case", list(REFUSED_URLS))
def test_refused_image_urls(server: Server, hosts: Hosts, case: str) -> None:
    make_url, words = REFUSED_URLS[case]
    message = refusal(post_chat(server, make_url(hosts)))
    assert all(word in message for word in words), message
    assert hosts.forbidden.hits == []  # the port off the allow-list was never contacted


REFUSED_DATA: dict[str, tuple[str, tuple[str, ...]]] = {
    "not-an-image": (data_uri(b"these bytes are not an image"), ("not a valid image",)),
    "truncated-png": (data_uri(TRUNCATED), ("not a valid image",)),
    "too-large": (data_uri(BIG_NOISE), ("too large",)),
    "bad-base64": ("data:image/png;base64,@@@@", ("base64",)),
    "text-media-type": (data_uri(b"hello", mime="text/plain"), ("not an image",)),
    "not-base64-encoded": ("data:image/png,rawbytes", ("base64",)),
}


@pytest.mark.parametrize("case", list(REFUSED_DATA))
def test_bad_data_uris_are_refused(server: Server, case: str) -> None:
    assert len(BIG_NOISE) > MAX_BYTES > max(len(NOISE), len(TILED_1024x768), len(BLUE_300x200))
    url, words = REFUSED_DATA[case]
    message = refusal(post_chat(server, url))
    assert all(word in message for word in words), message


def test_an_image_for_the_text_model_is_refused(server: Server, hosts: Hosts) -> None:
    message = refusal(post_chat(server, data_uri(RED), model=TEXT_MODEL))
    assert "vision" in message
    before = len(hosts.allowed.hits)
    assert "vision" in refusal(post_chat(server, hosts.allowed.url("/noise.png"), model=TEXT_MODEL))
    assert len(hosts.allowed.hits) == before  # refused before anything was fetched


def test_the_server_still_serves_images_after_the_refusals(server: Server, client: openai.OpenAI) -> None:
    assert httpx.get(server.base_url + "/health", timeout=TIMEOUT).status_code == 200
    assert ask(client, user(PROMPT, data_uri(RED))).text


# ---- vision models in the store ------------------------------------------------------------------------------------


def test_cli_create_from_a_modelfile_with_model_and_projector(server: Server, native: ollama.Client,
                                                              vl_files: VisionFiles, tmp_path: Path) -> None:
    shutil.copyfile(vl_files.model, tmp_path / "model.gguf")
    shutil.copyfile(vl_files.mmproj, tmp_path / "mmproj-model.gguf")
    (tmp_path / "Modelfile").write_text("FROM ./model.gguf\nFROM ./mmproj-model.gguf\n")
    created = cli(server, "create", "vl-from-cli", "-f", str(tmp_path / "Modelfile"))
    assert created.returncode == 0, created.stderr
    shown = cli(server, "show", "vl-from-cli")
    assert shown.returncode == 0 and "vision" in shown.stdout, shown.stdout + shown.stderr
    assert "vision" in (native.show("vl-from-cli").capabilities or [])
    messages = [ollama.Message(role="user", content=PROMPT, images=[ollama.Image(value=NOISE)])]
    stored = native.chat(model="vl-from-cli", messages=messages, options=NATIVE_OPTIONS)
    served = native.chat(model=VL_MODEL, messages=messages, options=NATIVE_OPTIONS)
    assert stored.message.content and stored.message.content == served.message.content
    assert stored.prompt_eval_count == served.prompt_eval_count


def test_api_create_from_modelfile_text_projector_first(server: Server, native: ollama.Client,
                                                        vl_files: VisionFiles) -> None:
    body = {"model": "vl-from-api", "modelfile": f"FROM {vl_files.mmproj}\nFROM {vl_files.model}\n", "stream": False}
    response = httpx.post(server.base_url + "/api/create", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "success"
    assert "vision" in (native.show("vl-from-api").capabilities or [])
    plain = native.generate(model="vl-from-api", prompt=PROMPT, options=NATIVE_OPTIONS)
    seen = native.generate(model="vl-from-api", prompt=PROMPT, images=[RED], options=NATIVE_OPTIONS)
    assert seen.response
    assert (seen.prompt_eval_count or 0) - (plain.prompt_eval_count or 0) >= 64


def test_api_create_refuses_a_projector_that_is_not_one(server: Server, vl_files: VisionFiles,
                                                        tmp_path: Path) -> None:
    fake = tmp_path / "mmproj-fake.gguf"
    shutil.copyfile(vl_files.model, fake)  # a text model named like a projector
    body = {"model": "vl-fake", "modelfile": f"FROM {vl_files.model}\nFROM {fake}\n", "stream": False}
    message = native_refusal(httpx.post(server.base_url + "/api/create", json=body, timeout=TIMEOUT))
    assert "projector" in message


def test_create_from_uploaded_blobs_keeps_the_projector(native: ollama.Client, vl_files: VisionFiles) -> None:
    """As the local runner: `files` may hold the mmproj GGUF beside the model; it becomes the projector."""
    files = {"model.gguf": native.create_blob(vl_files.model),
             "mmproj-model.gguf": native.create_blob(vl_files.mmproj)}
    assert native.create(model="vl-from-blobs", files=files).status == "success"
    assert "vision" in (native.show("vl-from-blobs").capabilities or [])
    messages = [ollama.Message(role="user", content=PROMPT, images=[ollama.Image(value=NOISE)])]
    assert native.chat(model="vl-from-blobs", messages=messages, options=NATIVE_OPTIONS).message.content


# ---- the CLI -------------------------------------------------------------------------------------------------------


def test_a_model_created_from_the_vision_model_keeps_its_projector(native: ollama.Client, short_model: str) -> None:
    assert "vision" in (native.show(short_model).capabilities or [])
    messages = [ollama.Message(role="user", content=PROMPT, images=[ollama.Image(value=NOISE)])]
    derived = native.chat(model=short_model, messages=messages)
    assert derived.message.content == native.chat(model=VL_MODEL, messages=messages,
                                                  options=NATIVE_OPTIONS).message.content


def test_cli_run_with_an_image_path_in_the_prompt(server: Server, short_model: str,
                                                  image_files: dict[str, Path]) -> None:
    ran = cli(server, "run", short_model, f"describe {image_files['noise']}")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip()
    refused = cli(server, "run", TEXT_MODEL, f"describe {image_files['noise']}")
    assert refused.returncode == 1
    assert "Error:" in refused.stderr and "vision" in refused.stderr, refused.stderr


def test_repl_image_command_and_image_path(server: Server, short_model: str, image_files: dict[str, Path]) -> None:
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}", "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "lmserve", "run", short_model], env=env, encoding="utf-8",
                          timeout=TIMEOUT)
    try:
        child.expect_exact(">>> ")
        child.sendline(f"/image {image_files['red']} What is this?")
        child.expect_exact(f"Added image '{image_files['red']}'")
        child.expect_exact(">>> ")
        assert "Error" not in (child.before or "")
        child.sendline(f"/image {image_files['noise']}")
        child.expect_exact(f"Added image '{image_files['noise']}'")
        child.expect_exact(">>> ")
        child.sendline("And this one?")
        child.expect_exact(">>> ")
        assert "Error" not in (child.before or "")
        child.sendline(f"Compare with {image_files['red']}")
        child.expect_exact(f"Added image '{image_files['red']}'")
        child.expect_exact(">>> ")
        assert "Error" not in (child.before or "")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
