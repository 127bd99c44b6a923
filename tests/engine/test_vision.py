"""Images through libmtmd inside the continuous-batching engine, with a tiny random LFM2-VL (text GGUF + mmproj)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.errors import EngineFailure, InvalidRequest
from lmserve.types import Bitmap, Chunk, LoadOptions, SamplingParams
from tests.tiny_lfm2 import write_tiny_lfm2
from tests.tiny_lfm2_vl import write_tiny_lfm2_vl

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def vl_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tiny-vl")
    model, projector = folder / "tiny-vl.gguf", folder / "mmproj-tiny-vl.gguf"
    write_tiny_lfm2_vl(model, projector)
    return model, projector


def load(files: tuple[Path, Path], **options: int) -> BatchingEngine:
    model, projector = files
    opts = LoadOptions(num_ctx=4096, num_parallel=4, num_batch=512, projector=str(projector))
    return BatchingEngine(LlamaCppBackend(model, opts, LlamaCppLaunch(**options)), max_batch_tokens=512,
                          max_prefill_tokens=64)


@pytest.fixture(scope="module")
def engine(vl_files: tuple[Path, Path]) -> Iterator[BatchingEngine]:
    eng = load(vl_files)
    yield eng
    eng.close()


def solid(width: int, height: int, rgb: tuple[int, int, int]) -> Bitmap:
    return Bitmap(width, height, bytes(rgb) * (width * height))


def noise(width: int, height: int, seed: int = 0) -> Bitmap:
    return Bitmap(width, height, random.Random(seed).randbytes(width * height * 3))


def user_turn(engine: BatchingEngine, text: str, num_images: int) -> str:
    marker = engine.info.image_marker
    assert marker is not None
    return f"<|startoftext|><|im_start|>user\n{marker * num_images}{text}<|im_end|>\n<|im_start|>assistant\n"


async def answer(engine: BatchingEngine, text: str, images: list[Bitmap], max_tokens: int = 8) -> tuple[str, Chunk]:
    prompt = user_turn(engine, text, len(images))
    if images:
        tokens, places = engine.tokenize_media(prompt, images)
    else:
        tokens, places = engine.tokenize(prompt), []
    chunks = [c async for c in engine.submit(tokens, SamplingParams(temperature=0, max_tokens=max_tokens),
                                             images=places)]
    assert chunks[-1].finish_reason in ("stop", "length")
    return "".join(c.text for c in chunks), chunks[-1]


def prompt_tokens(final: Chunk) -> int:
    assert final.usage is not None
    return final.usage.prompt_tokens


async def test_the_model_has_a_private_image_marker(engine: BatchingEngine) -> None:
    marker = engine.info.image_marker
    assert marker is not None and marker.startswith("<__lmserve_image_")
    assert marker != "<__media__>"  # user text holding llama.cpp's default marker stays text


async def test_image_tokens_count_in_the_prompt_and_grow_with_the_image(engine: BatchingEngine) -> None:
    _, text_only = await answer(engine, "What?", [])
    counts = []
    for width, height in [(64, 64), (300, 200), (1024, 768)]:
        _, final = await answer(engine, "What?", [solid(width, height, (200, 30, 30))])
        counts.append(prompt_tokens(final) - prompt_tokens(text_only))
    # 64 image tokens, 70, and a 3x2-tiled image with its thumbnail and tile markers (see tests/tiny_lfm2_vl.py).
    assert counts[0] >= 64 and counts[0] < counts[1] < counts[2]
    assert counts[2] > 6 * 256


async def test_the_answer_depends_on_the_image(engine: BatchingEngine) -> None:
    red, _ = await answer(engine, "What is this?", [solid(64, 64, (255, 0, 0))])
    red_again, _ = await answer(engine, "What is this?", [solid(64, 64, (255, 0, 0))])
    grainy, _ = await answer(engine, "What is this?", [noise(64, 64)])
    assert red == red_again
    assert red != grainy


async def test_several_images_in_one_prompt(engine: BatchingEngine) -> None:
    _, one = await answer(engine, "Compare.", [noise(64, 64, 1)])
    _, two = await answer(engine, "Compare.", [noise(64, 64, 1), solid(300, 200, (0, 0, 255))])
    assert prompt_tokens(two) - prompt_tokens(one) >= 70


async def test_image_and_text_requests_batched_together_answer_as_they_do_alone(engine: BatchingEngine) -> None:
    requests = [
        ("Describe.", [noise(64, 64, 2)]),
        ("Hello there, how are you?", []),
        ("Two of them.", [solid(64, 64, (0, 255, 0)), noise(96, 64, 3)]),
        ("Count to three.", []),
        ("Large one.", [noise(800, 800, 4)]),
        ("What is the time?", []),
    ]
    alone = [await answer(engine, text, images) for text, images in requests]
    together = await asyncio.gather(*(answer(engine, text, images) for text, images in requests))
    assert [text for text, _ in together] == [text for text, _ in alone]
    assert [prompt_tokens(f) for _, f in together] == [prompt_tokens(f) for _, f in alone]


async def test_markers_and_images_must_match(engine: BatchingEngine) -> None:
    prompt = user_turn(engine, "x", 2)
    with pytest.raises(InvalidRequest, match="media markers do not match"):
        engine.tokenize_media(prompt, [noise(32, 32)])


async def test_image_max_tokens_changes_how_many_tokens_an_image_takes(vl_files: tuple[Path, Path]) -> None:
    small = load(vl_files, image_min_tokens=16, image_max_tokens=64)
    try:
        _, base = await answer(small, "What?", [])
        _, final = await answer(small, "What?", [solid(64, 64, (10, 10, 10))])
        assert prompt_tokens(final) - prompt_tokens(base) < 64  # 16..64 instead of the projector's 64..256
    finally:
        small.close()


async def test_a_projector_that_is_not_one_fails_to_load(vl_files: tuple[Path, Path], tmp_path: Path) -> None:
    model, _ = vl_files
    text_model = write_tiny_lfm2(tmp_path / "mmproj-fake.gguf")
    with pytest.raises(EngineFailure, match="vision projector"):
        LlamaCppBackend(model, LoadOptions(num_ctx=512, num_parallel=1, projector=str(text_model)))
    with pytest.raises(EngineFailure, match="not found"):
        LlamaCppBackend(model, LoadOptions(num_ctx=512, num_parallel=1, projector=str(tmp_path / "missing.gguf")))


async def test_a_model_without_projector_has_no_image_marker(vl_files: tuple[Path, Path]) -> None:
    model, _ = vl_files
    backend = LlamaCppBackend(model, LoadOptions(num_ctx=512, num_parallel=1))
    try:
        assert backend.info.image_marker is None
        with pytest.raises(InvalidRequest, match="no projector"):
            backend.tokenize_media("x", [noise(8, 8)])
    finally:
        backend.close()


async def test_images_are_encoded_when_tokenized_off_the_engine_thread(engine: BatchingEngine) -> None:
    """The projector runs where the prompt is tokenized (a worker thread in the service), so the engine thread only
    decodes embeddings and text-only sequences are not held up by the vision encoder."""
    _, places = engine.tokenize_media(user_turn(engine, "x", 1), [noise(64, 64, 5)])
    (place,) = places
    embeddings = getattr(place.handle, "embeddings", None)
    assert embeddings is not None and embeddings.shape == (place.length * 64,)  # tiny LFM2: 64 wide
    assert bool((embeddings != 0).any())
