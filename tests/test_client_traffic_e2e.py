"""The client applications people point at a local server, as a new user runs them with their own documented
settings, through a recording proxy (tests/traffic.py) in front of one lmserve server (llama.cpp, the embedded
model, loaded at its trained context):

- `llm` 0.36 with the llm-ollama 0.19 plugin (OLLAMA_HOST) and aider 0.86 (litellm's `ollama_chat`,
  OLLAMA_API_BASE): their real releases, run as processes. `make clients` installs them into .venv/clients; where
  it could not (no registry), their tests are skipped, saying why. (opencode, whose ~7.6k-token prompt wants the
  long context of the agents' programmed model, is in tests/test_agents_e2e.py, through the same proxy.)
- Open WebUI 0.12.4: its requests as that release builds them (backend/open_webui/routers/ollama.py and
  utils/payload.py: `convert_payload_openai_to_ollama` and `apply_params_to_form_data` put a model's advanced
  params into `options` as they are), replayed through the proxy; the application itself (a web server with its
  own database and browser front-end) is not run here.

What is checked is what a user meets: every request is answered, or refused with a 4xx naming what it refuses;
none loads the model again (the load counter in /metrics), and a returning prompt finds its start in the prompt
cache (the native `prompt_eval_count` counts only the tokens evaluated).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.programs import run_program
from tests.test_context_e2e import loads
from tests.test_server import Server
from tests.traffic import Recorded, RecordingProxy

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ROOT / ".venv" / "clients"
MODEL = "smollm2:135m"
TRAINED = 8192
TIMEOUT = 300


def client_binary(name: str, binary: str) -> Path:
    """The client's executable in .venv/clients/NAME; skip, saying why, when `make clients` could not install it."""
    path = CLIENTS / name / "bin" / binary
    if path.exists():
        return path
    log = CLIENTS / name / "pip.log"
    why = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else ["`make clients` not run"]
    pytest.skip(f"{binary} is not installed in {CLIENTS / name} ({why[0] if why else 'pip failed'}): "
                "`make clients` installs it")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-c", str(TRAINED), "-np", "2")
    yield srv
    srv.stop()


@pytest.fixture
def proxy(server: Server) -> Iterator[RecordingProxy]:
    recording = RecordingProxy(server.base_url)
    yield recording
    recording.close()


def run(argv: list[str | Path], env: dict[str, str], cwd: Path) -> str:
    done = run_program(argv, env={"PATH": os.environ["PATH"], **env}, cwd=cwd, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def final(record: Recorded) -> dict[str, Any]:
    """The last JSON object of a native answer (whole, or the last line of a stream)."""
    lines = [line for line in record.answer.decode().splitlines() if line.strip()]
    return dict(json.loads(lines[-1]))


def prompt_tokens(server: Server, record: Recorded) -> int:
    """How many tokens the prompt of a recorded native chat has (lmserve's /tokenize renders its messages)."""
    body = {"model": MODEL, "messages": record.body["messages"]}
    return len(httpx.post(server.base_url + "/tokenize", json=body, timeout=60).json()["tokens"])


def chats(records: list[Recorded]) -> list[Recorded]:
    return [r for r in records if r.path == "/api/chat"]


def check_answered(records: list[Recorded]) -> None:
    assert records
    failed = [r.describe() + " " + r.answer.decode(errors="replace")[:300] for r in records if r.status >= 400]
    assert not failed, failed


# ---- llm with llm-ollama ---------------------------------------------------------------------------------------

PASSAGE = ("The harbour woke before the sun. Fishing boats slid out past the lighthouse, their lamps swinging, while "
           "gulls argued over the nets drying on the quay. By the time the bakery opened, the first boats were "
           "already coming back, low in the water, and the market filled with the smell of salt and bread. ") * 3


def test_llm_with_llm_ollama_lists_chats_continues_and_sets_options(server: Server, proxy: RecordingProxy,
                                                                    tmp_path: Path) -> None:
    llm = client_binary("llm", "llm")
    env = {"OLLAMA_HOST": proxy.base_url, "LLM_USER_PATH": str(tmp_path), "HOME": str(tmp_path)}
    before = loads(server.base_url, MODEL)
    assert f"ollama/{MODEL}" in run([llm, "models"], env, tmp_path)
    # every option llm-ollama offers, as a user sets them (draft_num_predict is the local runner's name of draft_max)
    run([llm, "-m", f"ollama/{MODEL}", "-o", "temperature", "0", "-o", "num_predict", "12", "-o", "num_ctx", "4096",
         "-o", "repeat_last_n", "32", "-o", "repeat_penalty", "1.1", "-o", "seed", "7", "-o", "top_k", "20",
         "-o", "top_p", "0.9", "-o", "min_p", "0.05", "-o", "draft_num_predict", "2",
         f"{PASSAGE}\nThe passage in one sentence:"], env, tmp_path)
    run([llm, "-c", "-o", "num_predict", "8", "And one about the mountains?"], env, tmp_path)  # the conversation
    run([llm, "-m", f"ollama/{MODEL}", "-o", "json_object", "1", "-o", "num_predict", "16",
         "A JSON object with a key named colour."], env, tmp_path)
    records = proxy.take()
    check_answered(records)
    first, returning, as_json = chats(records)
    assert first.body["options"]["draft_num_predict"] == 2 and first.body["options"]["num_ctx"] == 4096
    assert as_json.body["format"] == "json"
    assert final(returning)["prompt_eval_count"] < prompt_tokens(server, returning) / 2  # the first turn: cached
    assert loads(server.base_url, MODEL) == before


# ---- aider ------------------------------------------------------------------------------------------------------


def aider(binary: Path, proxy: RecordingProxy, home: Path, work: Path, message: str) -> str:
    """One aider turn, as `aider --model ollama_chat/NAME --message ...` runs it in a folder without git; a model
    setting caps its reply (aider sets no limit, and the 135M model would write until the context is full)."""
    (work / ".aider.model.settings.yml").write_text(
        f"- name: ollama_chat/{MODEL}\n  extra_params:\n    max_tokens: 24\n")
    env = {"OLLAMA_API_BASE": proxy.base_url, "HOME": str(home), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return run([binary, "--model", f"ollama_chat/{MODEL}", "--message", message, "--yes-always", "--no-git",
                "--no-check-update", "--analytics-disable", "--no-pretty", "--no-fancy-input"], env, work)


def test_aider_turns_reload_nothing_and_reuse_its_system_prompt(server: Server, proxy: RecordingProxy,
                                                               tmp_path: Path) -> None:
    """aider (through litellm) asks /api/show for the model's facts and sends num_ctx = 1.25 x its prompt + 8192
    with every turn: above the trained context, which serves it without loading anything."""
    binary = client_binary("aider", "aider")
    work = tmp_path / "project"
    work.mkdir()
    before = loads(server.base_url, MODEL)
    out = aider(binary, proxy, tmp_path, work, "Say hello.")
    assert f"Warning for ollama_chat/{MODEL}" not in out, out  # it knows the model's context from /api/show
    aider(binary, proxy, tmp_path, work, "Say goodbye.")
    records = proxy.take()
    check_answered(records)
    assert {r.path for r in records} == {"/api/show", "/api/chat"}
    first, second = chats(records)
    assert first.body["options"]["num_ctx"] > TRAINED
    prompt = final(first)["prompt_eval_count"]
    assert final(second)["prompt_eval_count"] < prompt / 2, (prompt, final(second))  # its system prompt was cached
    assert loads(server.base_url, MODEL) == before


# ---- Open WebUI 0.12.4, its requests replayed -------------------------------------------------------------------

WEBUI_HEADERS = {"Content-Type": "application/json", "X-OpenWebUI-User-Name": "Ann%20Lee",
                 "X-OpenWebUI-User-Id": "u-1", "X-OpenWebUI-User-Email": "ann@example.com",
                 "X-OpenWebUI-User-Role": "user", "X-OpenWebUI-Chat-Id": "chat-1"}
"""What it sends with every call (JSON content type on GETs too; the user headers with
ENABLE_FORWARD_USER_INFO_HEADERS)."""
TOOLS = [{"type": "function", "function": {"name": "get_current_timestamp", "description": "The current time.",
                                           "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "search_chats", "description": "Search earlier chats.",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}, "required": ["query"]}}}]
"""Its built-in tools, which it sends with every chat turn of a model it has not marked as lacking them."""
HISTORY = [{"role": "system", "content": "You are a helpful assistant for the Lee family."},
           {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "thinking": "Greet back."},
           {"role": "user", "content": "Name one planet."}]


def webui_requests() -> list[tuple[str, str, Any]]:
    """One user's session: the model list, a streamed turn with advanced params set in the chat controls (the
    params go into `options` as they are, `keep_alive`, `format` and `think` to the top), the title, tags and
    follow-up tasks after it (no options but num_predict), a turn after a tool call, embeddings for a document,
    and the admin's model actions (copy, delete, unload)."""
    turn = {"model": MODEL, "messages": HISTORY, "format": "json",
            "options": {"temperature": 0.7, "top_k": 40, "top_p": None, "num_ctx": TRAINED, "num_keep": 24,
                        "seed": 42, "stop": ["<|eot|>"], "num_gpu": 99, "num_predict": 16, "mirostat": 0,
                        "reasoning_effort": "medium", "tfs_z": 1},
            "stream": True, "keep_alive": "5m", "tools": TOOLS, "think": False}
    task = {"model": MODEL, "messages": [{"role": "user", "content": "### Task:\nGenerate a concise title.\n"
                                          "<chat_history>\nUSER: Name one planet.\nASSISTANT: Mars.\n</chat_history>"}],
            "options": {"num_predict": 12}, "stream": False}
    after_tool = {"model": MODEL, "stream": True, "tools": TOOLS, "options": {"num_predict": 8}, "messages": [
        *HISTORY, {"role": "assistant", "content": "", "tool_calls": [
            {"index": 0, "id": None, "function": {"name": "get_current_timestamp", "arguments": {}}}]},
        {"role": "tool", "content": "1764403200", "tool_call_id": "call_1"}]}
    return [("GET", "/api/tags", None), ("GET", "/api/ps", None), ("GET", "/api/version", None),
            ("POST", "/api/chat", turn), ("POST", "/api/chat", task),
            ("POST", "/api/chat", {**task, "options": {}, "keep_alive": -1}),
            ("POST", "/api/chat", {**turn, "keep_alive": "", "format": "", "think": "medium"}),
            ("POST", "/api/chat", after_tool),
            ("POST", "/api/embed", {"input": ["A document about planets.", "Mars is red."], "model": MODEL,
                                    "truncate": True}),
            ("POST", "/api/copy", {"source": MODEL, "destination": "webui-copy"}),
            ("DELETE", "/api/delete", {"model": "webui-copy"}),
            ("POST", "/api/generate", {"model": MODEL, "keep_alive": 0, "prompt": ""})]


def test_open_webui_requests_are_answered_and_reload_nothing(server: Server, proxy: RecordingProxy) -> None:
    before = loads(server.base_url, MODEL)
    with httpx.Client(base_url=proxy.base_url, headers=WEBUI_HEADERS, timeout=TIMEOUT) as webui:
        for method, path, body in webui_requests():
            webui.request(method, path, content=json.dumps(body) if body is not None else None)
            if path == "/api/generate":
                break
            assert loads(server.base_url, MODEL) == before, path  # num_gpu on a CPU-only build places nothing
        records = proxy.take()
        check_answered(records)
        turn, task, returning = (final(r) for r in chats(records)[:3])
        assert returning["prompt_eval_count"] < task["prompt_eval_count"]  # the task's own prompt, cached
        assert turn["done"] and records[-1].status == 200  # unloaded, as its admin page asks
        for options, param in (({"tfs_z": 0.9}, "tfs_z"), ({"logit_bias": ""}, "logit_bias"),
                               ({"reasoning_effort": "extreme"}, "reasoning_effort")):
            refused = webui.post("/api/chat", content=json.dumps({"model": MODEL, "messages": HISTORY,
                                                                  "options": options, "stream": False}))
            assert refused.status_code == 400 and param in refused.json()["error"], refused.text


def test_an_image_only_message_to_a_model_without_vision_is_a_400_naming_why(proxy: RecordingProxy) -> None:
    """Open WebUI sends an image-only message without `content`: the model must be one that sees."""
    image = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    with httpx.Client(base_url=proxy.base_url, headers=WEBUI_HEADERS, timeout=TIMEOUT) as webui:
        answer = webui.post("/api/chat", content=json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "images": [image]}], "stream": True}))
    assert answer.status_code == 400 and "vision" in answer.json()["error"], answer.text
