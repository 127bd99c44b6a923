"""The coding agents, as a new user runs them: Claude Code (`claude -p`, the Anthropic Messages API), Codex
(`codex exec`, the OpenAI Responses API) and opencode (`opencode run`, chat completions; through a recording proxy,
tests/traffic.py), their real npm releases with their default settings, against a real lmserve server on the
llama.cpp engine.

Their prompts (Claude Code ~20k tokens, Codex ~6k, opencode ~7.6k) need a long trained context, so the model is the tiny
programmed one of tests/tiny_agent_model.py: with SmolLM2's tokenizer and template and a 64k-token context, it
answers a fixed text ("talk") or a fixed tool call ("tool": the call, then, once the call is in the context, the
end of the turn). What is tested is what a user sees: every request of the turn succeeds, the agent runs the tool
where the model calls one, and the agent exits 0. `make agents` (part of `make test`) installs the CLIs from npm
into .venv/agents; without them (npm unreachable) these tests are skipped, saying why. Model names are ones the
agents do not know, as a user's are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmserve.store.embedded import embedded_model_path
from tests.cores import all_cores
from tests.programs import run_program
from tests.test_server import Server
from tests.tiny_agent_model import write_agent_model
from tests.traffic import Recorded, RecordingProxy

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / ".venv" / "agents"
CLAUDE = AGENTS / "node_modules" / ".bin" / "claude"
CODEX = AGENTS / "node_modules" / ".bin" / "codex"
OPENCODE = AGENTS / "node_modules" / ".bin" / "opencode"
TIMEOUT = 300
NOTES = "The answer is forty-two."
MARKER = " alligator"
"""A word that is one token of SmolLM2's and in no agent's prompt: every programmed reply has it (see add_model)."""
TALK = f"Hello from the{MARKER}!"


def installed(binary: Path) -> None:
    """Skip, saying why, when `make agents` could not install the agent CLI `binary`."""
    if binary.exists():
        return
    log = AGENTS / "npm.log"
    why = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else ["`make agents` not run"]
    pytest.skip(f"{binary.name} is not installed in {AGENTS} ({why[0] if why else 'npm failed'}): "
                "`make agents` installs it from the npm registry")


# ---- the server and its programmed models ---------------------------------------------------------------------


def tokenize(server: Server, text: str) -> list[int]:
    body = {"model": "smollm2:135m", "content": text, "add_special": False}
    return [int(t) for t in httpx.post(server.base_url + "/tokenize", json=body, timeout=60).json()["tokens"]]


def generation_start(server: Server) -> int:
    """The last token of SmolLM2's generation prompt: where the programmed models start writing."""
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}]}
    return int(httpx.post(server.base_url + "/tokenize", json=body, timeout=60).json()["tokens"][-1])


def cli(server: Server, *args: str) -> None:
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}"}
    done = run_program([sys.executable, "-m", "lmserve", *args], env=env, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr


def add_model(server: Server, name: str, script: str, directory: Path) -> None:
    """Create `name` in the server's store: the programmed model writing `script`."""
    [marker] = tokenize(server, MARKER)
    path = write_agent_model(directory / f"{name}.gguf", embedded_model_path(), start=generation_start(server),
                             script=tokenize(server, script), marker=marker)
    modelfile = directory / f"Modelfile.{name}"
    modelfile.write_text(f"FROM {path}\n")
    cli(server, "create", name, "-f", str(modelfile))


NOTES_FILE = Path(f"/tmp/notes{MARKER}.txt")
"""The file the programmed Claude Code call reads (an absolute path, as its Read tool wants; one directory level, so
that no token of the path repeats; Claude Code runs there, where it may read without asking)."""
CLAUDE_CALL = '{"name":"Read","arguments" : {"file_path": "' + str(NOTES_FILE) + '"} }'
CODEX_CALL = '{"name":"exec_command","arguments" : {"cmd": "cat' + MARKER + '.txt"} }'
"""The programmed calls, in lmserve's JSON call format (SmolLM2's template has none of its own), spaced so that
no token repeats (a programmed reply's tokens must be distinct)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server (llama.cpp, two slots of 48k tokens) with the programmed models."""
    with all_cores():  # three agents' 20k-token prompts at once: the run's cores, as a user's machine gives them
        srv = Server("-c", "49152", "-np", "2")
    directory = tmp_path_factory.mktemp("agent-models")
    try:
        add_model(srv, "tiny-talk", TALK, directory)
        add_model(srv, "tiny-claude-tool", CLAUDE_CALL, directory)
        add_model(srv, "tiny-codex-tool", CODEX_CALL, directory)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The agent's working directory, with the file Codex's call reads; and NOTES_FILE, Claude Code's."""
    work = tmp_path / "work"
    work.mkdir()
    (work / f"{MARKER.strip()}.txt").write_text(NOTES + "\n")
    NOTES_FILE.write_text(NOTES + "\n")
    return work


# ---- Claude Code ----------------------------------------------------------------------------------------------


def claude(server: Server, model: str, prompt: str, home: Path, cwd: Path,
           *extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": server.base_url,
           "ANTHROPIC_API_KEY": "placeholder", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_TELEMETRY": "1"}
    return run_program([CLAUDE, "-p", prompt, "--model", model, *extra], env=env, cwd=cwd, timeout=TIMEOUT)


def check_claude_tool_turn(done: subprocess.CompletedProcess[str]) -> None:
    """The programmed Read call ran, its result (the file's text) went back, and the turn ended well."""
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    uses = [block for event in events if event.get("type") == "assistant"
            for block in event["message"]["content"] if block["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == [("Read", {"file_path": str(NOTES_FILE)})]
    results = [block for event in events if event.get("type") == "user"
               for block in event["message"]["content"] if isinstance(block, dict) and block["type"] == "tool_result"]
    assert len(results) == 1 and NOTES in json.dumps(results[0]) and not results[0].get("is_error"), results
    assert events[-1]["type"] == "result" and events[-1]["is_error"] is False, events[-1]


# ---- Codex ----------------------------------------------------------------------------------------------------


def codex(server: Server, model: str, prompt: str, home: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`codex exec` with lmserve as a custom provider on the Responses API (the way its docs add a provider)."""
    config = home / ".codex"
    config.mkdir(exist_ok=True)
    (config / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "lmserve"\n\n[model_providers.lmserve]\nname = "lmserve"\n'
        f'base_url = "{server.base_url}/v1"\nwire_api = "responses"\n')
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(config)}
    return run_program([CODEX, "exec", "--skip-git-repo-check", "--json", prompt], env=env, cwd=cwd, timeout=TIMEOUT)


def codex_events(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_codex_completes_a_turn(server: Server, tmp_path: Path, workdir: Path) -> None:
    installed(CODEX)
    done = codex(server, "tiny-talk", "hi", tmp_path, workdir)
    assert done.returncode == 0, done.stdout + done.stderr
    events = codex_events(done)
    assert not [e for e in events if e.get("type") in ("error", "turn.failed")], events
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages == [TALK], events


def check_codex_tool_turn(done: subprocess.CompletedProcess[str]) -> None:
    """The programmed exec_command ran `cat`, its output (the file's text) went back, and the turn ended well."""
    assert done.returncode == 0, done.stdout + done.stderr
    events = codex_events(done)
    assert not [e for e in events if e.get("type") in ("error", "turn.failed")], events
    commands = [e["item"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "command_execution"]
    assert len(commands) == 1 and f"cat{MARKER}.txt" in commands[0]["command"], done.stdout[-6000:] + done.stderr
    assert NOTES in commands[0]["aggregated_output"], commands


def test_three_agents_at_once_on_two_slots_each_call_a_tool_or_talk(server: Server, tmp_path: Path,
                                                                    workdir: Path) -> None:
    """Claude Code and Codex each call a tool while another Claude Code session talks: three conversations (each
    of two or more requests) on the server's two slots, as a team sharing one server."""
    installed(CLAUDE)
    installed(CODEX)
    homes = [tmp_path / name for name in ("claude-tool", "codex-tool", "claude-talk")]
    for home in homes:
        home.mkdir()
    with all_cores(), ThreadPoolExecutor(3) as pool:  # the agents' processes too (tests/cores.py)
        claude_tool = pool.submit(claude, server, "tiny-claude-tool", "What does notes.txt say?", homes[0],
                                  NOTES_FILE.parent, "--output-format", "stream-json", "--verbose")
        codex_tool = pool.submit(codex, server, "tiny-codex-tool", "What does notes.txt say?", homes[1], workdir)
        talk = pool.submit(claude, server, "tiny-talk", "hi", homes[2], workdir, "--output-format", "json")
    check_claude_tool_turn(claude_tool.result())
    check_codex_tool_turn(codex_tool.result())
    done = talk.result()  # Claude Code's plain turn: run once, here
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["result"] == TALK, result


# ---- opencode, through a recording proxy ---------------------------------------------------------------------


def opencode(base_url: str, home: Path, work: Path, message: str) -> None:
    """One `opencode run` turn with lmserve as a provider of its opencode.json (no models.dev catalogue: these
    machines have no internet)."""
    config = {"provider": {"lmserve": {"npm": "@ai-sdk/openai-compatible", "name": "lmserve",
                                       "options": {"baseURL": base_url + "/v1"},
                                       "models": {"tiny-talk": {"name": "tiny"}}}}}
    (work / "opencode.json").write_text(json.dumps(config))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    done = run_program([OPENCODE, "run", "-m", "lmserve/tiny-talk", message], env=env, cwd=work, timeout=TIMEOUT)
    assert done.returncode == 0 and TALK in done.stdout, done.stdout + done.stderr


def streamed_usage(record: Recorded) -> dict[str, Any]:
    """The usage of a streamed chat completion (its last chunk with one: `stream_options.include_usage`)."""
    chunks = [json.loads(line[5:]) for line in record.answer.decode().splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    return dict(next(chunk["usage"] for chunk in reversed(chunks) if chunk.get("usage")))


def test_opencode_turns_are_answered_and_reuse_its_system_prompt(server: Server, tmp_path: Path,
                                                                  workdir: Path) -> None:
    """opencode 1.18 (an `@ai-sdk/openai-compatible` provider) sends its ten tools with `tool_choice: auto`,
    `max_tokens: 32000`, usage in the stream and session headers; each run titles its session in a request of its
    own. Every request is answered, and the second run's ~7.6k-token prompt comes from the prompt cache."""
    installed(OPENCODE)
    proxy = RecordingProxy(server.base_url)
    try:
        opencode(proxy.base_url, tmp_path, workdir, "hi")
        opencode(proxy.base_url, tmp_path, workdir, "hello")
    finally:
        proxy.close()
    records = proxy.take()
    assert records and all(r.status == 200 for r in records), [r.describe() for r in records]
    turns = [r for r in records if r.path == "/v1/chat/completions" and r.body.get("tools")]
    assert len(turns) == 2 and turns[0].body["tool_choice"] == "auto", [r.describe() for r in records]
    assert turns[0].headers.get("x-session-id"), turns[0].headers
    usage = streamed_usage(turns[1])
    assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] / 2, usage


# ---- a model whose trained context cannot hold the agent's prompt -----------------------------------------------


def test_claude_code_shows_plainly_that_smollm2_cannot_take_its_prompt(server: Server, tmp_path: Path,
                                                                        workdir: Path) -> None:
    installed(CLAUDE)
    done = claude(server, "smollm2:135m", "hi", tmp_path, workdir)
    assert done.returncode != 0
    shown = done.stdout + done.stderr
    # Claude Code reads the numbers from lmserve's Anthropic-worded 400: "Prompt is too long · the request is
    # ~22686 tokens (limit 8192) …"
    assert "prompt is too long" in shown.lower() and "limit 8192" in shown, shown


def test_codex_shows_plainly_that_smollm2_cannot_take_its_prompt(server: Server, tmp_path: Path,
                                                                  workdir: Path) -> None:
    installed(CODEX)
    done = codex(server, "smollm2:135m", "hi", tmp_path, workdir)
    assert done.returncode != 0
    failures = [json.dumps(e) for e in codex_events(done) if e.get("type") in ("error", "turn.failed")]
    # Codex 0.171.0 knows lmserve's error code (context_length_exceeded) and says it in its own words
    assert failures and all("context window" in failure for failure in failures), done.stdout + done.stderr
