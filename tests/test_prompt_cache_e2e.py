"""End to end: more conversations than slots take turns, and each returning turn is served from the prompt cache
(RAM while the server runs, disk after a restart); a corrupted cache file is ignored. Real server, real model, the
official openai client; speed-up shown as the prompt tokens not computed again (no timing assertions)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.test_server import MODEL, Server

WORDS = ("river", "stone", "lamp", "orbit", "garden", "copper", "violet", "harbor", "maple", "signal", "canyon",
         "ember", "falcon", "meadow", "quartz", "saddle", "timber", "velvet", "willow", "zephyr")


def system_prompt(seed: int, words: int = 250) -> str:
    rng = random.Random(seed)
    return f"Conversation {seed}. Remember these words: " + " ".join(rng.choice(WORDS) for _ in range(words))


class Chat:
    """One conversation: its messages so far, and what each turn reported."""

    def __init__(self, seed: int) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt(seed)}]
        self.usages: list[Any] = []

    def turn(self, client: openai.OpenAI, question: str) -> None:
        self.messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model=MODEL, messages=self.messages, temperature=0,  # type: ignore[arg-type]
                                               max_tokens=8)
        self.messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        self.usages.append(reply.usage)

    def cached(self, turn: int) -> int:
        details = self.usages[turn].prompt_tokens_details
        return int(details.cached_tokens or 0) if details is not None else 0


def take_turns(client: openai.OpenAI, chats: list[Chat], turns: int) -> None:
    for turn in range(turns):
        for chat in chats:
            chat.turn(client, f"Question {turn}: which word comes first?")


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of a /metrics series' samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_six_conversations_on_two_slots_return_to_their_cached_prefix() -> None:
    server = Server("-np", "2", "-c", "2048")
    try:
        chats = [Chat(seed) for seed in range(6)]
        with server.client() as client:
            take_turns(client, chats, turns=3)
        for chat in chats:
            assert chat.cached(0) < 50  # only the chat template's first tokens are shared between conversations
            for turn in (1, 2):
                previous = chat.usages[turn - 1]
                # the whole previous prompt (and the reply) was restored; only the new messages were computed
                assert chat.cached(turn) >= previous.prompt_tokens
                assert chat.usages[turn].prompt_tokens - chat.cached(turn) < 40
        assert metric(server.base_url, "lmserve_prompt_cache_hits_total", tier="ram") >= 8
        assert metric(server.base_url, "lmserve_prompt_cache_tokens_saved_total", tier="ram") > 8 * 300
        ps = httpx.get(server.base_url + "/api/ps").json()
        assert ps["prompt_cache"]["ram_bytes"] > 0 and ps["models"][0]["prompt_cache_bytes"] > 0
    finally:
        server.stop()


def test_a_conversation_returning_after_a_restart_skips_its_prefill_from_disk() -> None:
    first = Server("-np", "2")
    chats = [Chat(seed) for seed in (10, 11)]
    with first.client() as client:
        take_turns(client, chats, turns=1)
    first.stop()
    files = list(Path(first.models_dir, "prompt-cache").rglob("*.state"))
    assert len(files) == 2  # each slot's state was written when the server stopped
    again = Server("-np", "2", env={"LMSERVE_MODELS": first.models_dir})
    try:
        with again.client() as client:
            take_turns(client, chats, turns=1)
        for chat in chats:
            assert chat.cached(1) >= chat.usages[0].prompt_tokens
        assert metric(again.base_url, "lmserve_prompt_cache_hits_total", tier="disk") == 2
    finally:
        again.stop()


def test_a_corrupted_cache_file_is_ignored_and_the_answer_is_unchanged() -> None:
    first = Server("-np", "1")
    chat = Chat(20)
    with first.client() as client:
        take_turns(client, [chat], turns=1)
    first.stop()
    [state] = Path(first.models_dir, "prompt-cache").rglob("*.state")
    data = bytearray(state.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit deep in the saved KV cells
    state.write_bytes(bytes(data))
    again = Server("-np", "1", env={"LMSERVE_MODELS": first.models_dir})
    try:
        with again.client() as client:
            take_turns(client, [chat], turns=1)
        assert chat.cached(1) == 0  # nothing was restored from the corrupted file
        assert not state.exists()  # it was dropped
        assert metric(again.base_url, "lmserve_prompt_cache_hits_total", tier="disk") == 0
    finally:
        again.stop()
    clean = Server("-np", "1")  # no cache at all: the same turn computed from scratch
    try:
        with clean.client() as client:
            reply = client.chat.completions.create(model=MODEL, messages=chat.messages[:-1], temperature=0,  # type: ignore[arg-type]
                                                   max_tokens=8)
        assert chat.messages[-1]["content"] == reply.choices[0].message.content  # the corrupted file changed nothing
    finally:
        clean.stop()
