"""End to end: a real `lmserve serve` subprocess on a free port, the real model, the official `openai` client."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import httpx
import openai
import pytest

from lmserve.engine.lifeline import descendants
from tests import scratch

MODEL = "smollm2:135m"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(process: subprocess.Popen[str], base_url: str, timeout: float = 600.0,
                 output: Callable[[], str] | None = None) -> None:
    """Return once the server `process` answers GET /health with 200; RuntimeError with its output when it exits
    first, or when `timeout` passes (it is killed then; only a guard against a hang: a vLLM or Ray server can take
    minutes to start on a loaded machine). A failed process is reaped and its pipe closed, so nothing
    is left for the garbage collector to warn about in a later test. `output`: where its output is read from when
    another thread drains the pipe (`Output`); else the pipe is read here."""
    read = output or (lambda: process.communicate()[0] or "")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {read()}")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    process.wait()
    raise RuntimeError(f"server did not become healthy: {read()}")


class Output:
    """A process's output pipe, read by a thread as the process writes it. A server that lives for a whole run logs a
    line per request (and vLLM its stats every few seconds): unread, the pipe's 64 KiB fill and the server's next
    write blocks its event loop, and every request after it hangs."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._lines: list[str] = []
        self._pipe = process.stdout
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._pipe is not None
        for line in self._pipe:
            self._lines.append(line)
        self._pipe.close()

    def text(self, timeout: float | None = None) -> str:
        """Everything read so far, once the pipe has closed (every process holding it ended) or `timeout` passed."""
        self._thread.join(timeout)
        return "".join(self._lines)


PORT_TAKEN = re.compile(r"is already in use|failed to bind to address", re.IGNORECASE)  # ours; Ray Serve's proxy


class Server:
    """A running `lmserve serve` process."""

    kv_events_port = 0
    """Where the server publishes KV cache events, when it was started with a --kv-events-config that says so."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        """Start the server with `args`; `env` adds to (or overrides) its environment."""
        environ = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
        self.models_dir = scratch.store()
        environ["LMSERVE_MODELS"] = self.models_dir
        environ.update(env or {})
        for attempt in range(3):
            # A free port can be taken by another process (a Ray worker, a parallel test) before the server binds
            # it: that is the harness's race, not the server's failure, so it is retried on a fresh port.
            self.port = free_port()
            self.base_url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "lmserve", "serve", "--port", str(self.port), "-c", "1024", "-np", "8", *args]
            self.process = subprocess.Popen(
                cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            self.output = Output(self.process)
            try:
                wait_healthy(self.process, self.base_url, output=self.output.text)
                return
            except RuntimeError as error:
                if attempt == 2 or not PORT_TAKEN.search(str(error)):
                    raise

    def repository_model(self, headers: dict[str, str] | None = None) -> str:
        """The one safetensors repository's name as the server lists it (the store also lists the embedded GGUF, and
        the LoRA adapters registered over the repository, which GET /lora-adapters names)."""
        tags = httpx.get(self.base_url + "/api/tags", headers=headers).json()["models"]
        adapters = {f"{entry['name']}:latest" for entry in
                    httpx.get(self.base_url + "/lora-adapters", headers=headers).json()}
        [name] = [m["name"] for m in tags if m["details"]["format"] == "safetensors" and m["name"] not in adapters]
        return str(name)

    def client(self, api_key: str = "placeholder") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, _strict_response_validation=True
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1", api_key="placeholder", max_retries=0, _strict_response_validation=True
        )

    def stop(self) -> str:
        """SIGTERM (SIGKILL after 30 s); everything the server wrote."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.output.text(timeout=60)

    def stop_leaving_nothing(self) -> str:
        """Stop with SIGTERM, and check what a stop must do: the server exits 0 and every process it started (an
        engine's core and workers) ends with it. A shared server's teardown carries this check."""
        started = set(descendants(self.process.pid))
        out = self.stop()
        assert self.process.returncode == 0, f"SIGTERM: the server exited {self.process.returncode}:\n{out[-2000:]}"
        assert wait_until_gone(started, 30) == set(), "processes the server started outlived it"
        return out


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie has ended)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def wait_until_gone(pids: set[int], seconds: float) -> set[int]:
    """Those of `pids` still running after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(pids)


def test_output_drains_the_pipe_so_a_chatty_process_never_blocks_on_it() -> None:
    process = subprocess.Popen([sys.executable, "-c", "for i in range(20000): print('request', i)"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = Output(process)
    assert process.wait(timeout=60) == 0  # 250 KB: an unread pipe (64 KiB) would hold it at its write
    lines = output.text(timeout=10).splitlines()
    assert len(lines) == 20000 and lines[-1] == "request 19999"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    real_free_port = free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = int(taken.getsockname()[1])
        ports = iter([taken_port])
        monkeypatch.setattr(sys.modules[__name__], "free_port", lambda: next(ports, None) or real_free_port())
        srv = Server("-c", "256", "-np", "1")
        try:
            assert srv.port != taken_port
            assert httpx.get(srv.base_url + "/health").status_code == 200
        finally:
            srv.stop()


def test_startup_prints_address_model_context_and_slots() -> None:
    srv = Server("-c", "512", "-np", "2")
    with srv.client() as client:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=3)  # type: ignore[arg-type]
    out = srv.stop()
    assert srv.base_url in out
    assert MODEL in out
    assert "512 tokens per sequence" in out
    assert "2 parallel sequences" in out
    assert re.search(rf"^POST /v1/chat/completions 200 model={MODEL} tokens=\d+\+3 \d+\.\d\ds$", out, re.MULTILINE)
    assert re.search(r"^GET /health 200 ", out, re.MULTILINE)


def lmserve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the `lmserve` command with no LMSERVE_* variables but those in `env`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    return subprocess.run([sys.executable, "-m", "lmserve", *args], env={**environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_a_taken_port_is_one_line_before_any_banner() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = lmserve("serve", "--port", str(port), env={"LMSERVE_MODELS": scratch.store()})
    assert (done.returncode, done.stdout, done.stderr) == (
        1, "", f"lmserve: port {port} on 127.0.0.1 is already in use\n")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--port", "99999"], {}, "lmserve: --port must be at most 65535, got 99999\n"),
        ([], {"LMSERVE_PARALLEL": "many"}, "lmserve: LMSERVE_PARALLEL must be an integer, got 'many'\n"),
        (["--host", "no.such.host.invalid"], {}, "lmserve: cannot listen on 'no.such.host.invalid': "),
    ],
)
def test_bad_values_are_one_line_errors(args: list[str], env: dict[str, str], message: str) -> None:
    done = lmserve("serve", *args, env=env)
    assert done.returncode == (1 if "listen" in message else 2)
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("files", "says"),
    [
        (None, ": no such file or directory"),
        ([], " is not a model: it has no config.json and no .gguf file"),
        (["config.json", "model.safetensors", "tokenizer_config.json"],
         " is not a model lmserve can serve: it has config.json and weights but no tokenizer"),
    ],
)
def test_serve_a_directory_that_is_not_a_model_says_what_it_lacks(tmp_path: Path, files: list[str] | None,
                                                                  says: str) -> None:
    folder = tmp_path / "my-model"
    if files is not None:
        folder.mkdir()
        for name in files:
            (folder / name).write_text("{}")
    done = lmserve("serve", str(folder), "--port", str(free_port()), env={"LMSERVE_MODELS": str(tmp_path / "store")})
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(f"lmserve: {folder}{says}") and done.stderr.count("\n") == 1, done.stderr


def test_serve_names_a_file_as_run_does(tmp_path: Path, model_path: Path) -> None:
    """`serve FILE` registers it under `model_name_for_file`, the name `run FILE` gives it (tests/test_cli.py)."""
    from lmserve.parsing import model_name_for_file

    path = tmp_path / "Modèle été Q4.gguf"
    path.symlink_to(model_path)
    srv = Server(str(path))
    try:
        names = [m["name"] for m in httpx.get(srv.base_url + "/api/tags").json()["models"]]
    finally:
        srv.stop()
    assert model_name_for_file(path) == "Modele-ete-Q4:latest"
    assert "Modele-ete-Q4:latest" in names


def test_version_flag() -> None:
    from lmserve import __version__

    assert lmserve("--version").stdout == f"lmserve {__version__}\n"


def test_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    assert reply.model == MODEL
    assert reply.usage is not None
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens > 10


def test_decode_health_probes_the_model_with_one_token(server: Server, client: openai.OpenAI) -> None:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    response = httpx.get(server.base_url + "/health/decode", timeout=60)
    assert response.status_code == 200, response.text
    found = response.json()["models"][MODEL]
    assert (found["state"], found["check"]) == ("ok", "probed") and 0 < found["seconds"] < 10


def tree_rss(pid: int) -> int:
    """The resident memory of process `pid` and every process below it, in bytes."""
    total = 0
    for each in [pid, *descendants(pid)]:
        status = Path(f"/proc/{each}/status").read_text()
        total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
    return total


def test_a_model_sleeps_gives_its_memory_back_and_wakes_for_a_request(server: Server, client: openai.OpenAI) -> None:
    """Level 1 frees the KV cache (8 slots of 1,024 tokens: 189 MiB on SmolLM2), level 2 the weights too; a request
    wakes either and is answered as before."""
    asked = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 8}
    before = client.chat.completions.create(**asked).choices[0].message.content  # type: ignore[call-overload]
    awake = tree_rss(server.process.pid)
    [loaded] = httpx.get(server.base_url + "/api/ps").json()["models"]
    memory = loaded["memory"]
    assert memory["kv_cache"] == 8 * 1024 * 30 * 2 * 3 * 64 * 2  # cells x layers x K,V x heads x dims x f16
    assert 70 * 2**20 < memory["weights"] < loaded["size"] == memory["weights"] + memory["kv_cache"]
    metrics = httpx.get(server.base_url + "/metrics").text
    assert f'lmserve_model_memory_bytes{{model="{MODEL}",part="kv_cache"}} {memory["kv_cache"]:.8g}' in metrics
    slept = httpx.post(server.base_url + "/sleep", params={"level": 1}, timeout=60)
    assert slept.status_code == 200 and slept.json() == {"sleeping": {MODEL: 1}}, slept.text
    level_1 = tree_rss(server.process.pid)
    assert awake - level_1 > 0.8 * memory["kv_cache"], (awake, level_1)  # the measured KV cache is what comes back
    assert httpx.get(server.base_url + "/api/ps").json()["models"][0]["memory"]["kv_cache"] == 0
    assert client.chat.completions.create(**asked).choices[0].message.content == before  # type: ignore[call-overload]
    assert httpx.get(server.base_url + "/is_sleeping").json() == {"is_sleeping": False, "sleeping": {}}
    assert httpx.post(server.base_url + "/sleep", params={"level": 2, "model": MODEL}).status_code == 200
    level_2 = tree_rss(server.process.pid)
    assert awake - level_2 > awake - level_1 + 50 * 2**20, (awake, level_1, level_2)  # the weights: 90 MiB
    assert httpx.get(server.base_url + "/is_sleeping", params={"model": MODEL}).json()["is_sleeping"] is True
    assert client.chat.completions.create(**asked).choices[0].message.content == before  # type: ignore[call-overload]
    assert httpx.get(server.base_url + "/api/ps").json()["models"][0]["name"] == MODEL


def test_streamed_chat_equals_the_whole_reply(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["stop"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_stop_string_is_not_in_the_reply(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, stop=["Paris"]  # type: ignore[arg-type]
    )
    content = reply.choices[0].message.content or ""
    assert "Paris" not in content
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, stop=["Paris"], stream=True  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content


def test_max_tokens_gives_finish_reason_length(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a long story about a dragon."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 7
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, temperature=0  # type: ignore[arg-type]
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 5


def test_same_seed_gives_the_same_sampled_reply(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Invent a name for a cat."}]

    def ask(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=seed, max_tokens=20  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content or ""

    assert ask(42) == ask(42)


def test_sampling_extensions_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, temperature=0.7, top_p=0.9, seed=1,  # type: ignore[arg-type]
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"28": -100},
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert reply.choices[0].message.content


def alone_and_together(server: Server, model: str, prompts: list[str], max_tokens: int) -> tuple[list[str], list[str]]:
    """Greedy replies to each prompt sent one at a time, then to all of them sent at once."""

    async def ask(client: openai.AsyncOpenAI, prompt: str) -> str:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens
        )
        return reply.choices[0].message.content or ""

    async def run() -> tuple[list[str], list[str]]:
        async with server.async_client() as client:
            alone = [await ask(client, p) for p in prompts]
            together = await asyncio.gather(*(ask(client, p) for p in prompts))
        return alone, list(together)

    return asyncio.run(run())


def test_temperature_zero_alone_equals_eight_concurrent(server: Server) -> None:
    prompts = [
        "What is the capital of France?", "Write a haiku about rain.", "Count from 1 to 10.",
        "Explain gravity in one sentence.", "Name five fruits.", "What is 12 times 7?",
        "Tell me a joke.", "Describe the ocean.",
    ]
    alone, together = alone_and_together(server, MODEL, prompts, max_tokens=24)
    assert together == alone
    assert len(set(alone)) == len(prompts)


def test_completions(server: Server, client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text
    assert reply.choices[0].finish_reason == "length"
    # Streamed legacy completions carry finish_reason null until the end, as OpenAI's own do; the client's
    # Completion type says non-null, so strict validation cannot read any real stream: read it plainly.
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="placeholder", max_retries=0) as plain:
        stream = plain.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == reply.choices[0].text


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"model": MODEL, "messages": QUESTION, "temperature": "hot"}, "temperature"),
    ],
)
def test_bad_requests_get_400_with_the_openai_error_body(server: Server, body: dict[str, object], param: str) -> None:
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert param in (error["param"] or "")


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)  # type: ignore[arg-type]


def test_prompt_longer_than_context_is_400_with_both_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello " * 1500}]  # type: ignore[arg-type]
        )
    assert "1024" in str(info.value)


def test_api_key_is_required_when_set() -> None:
    srv = Server("--api-key", "sekret", "-np", "1", "-c", "256")
    try:
        assert httpx.get(srv.base_url + "/health").status_code == 200
        assert httpx.get(srv.base_url + "/v1/models").status_code == 401
        wrong = httpx.get(srv.base_url + "/v1/models", headers={"Authorization": "Key nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.base_url + "/v1/models", headers={"Authorization": "Key sekret"}).status_code == 200
        with srv.client(api_key="sekret") as good, srv.client(api_key="wrong") as bad:
            assert [m.id for m in good.models.list()] == [MODEL]
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        # The CLI sends LMSERVE_API_KEY; without it (or with a wrong one) it says so and starts no second server.
        where = {"LMSERVE_HOST": f"127.0.0.1:{srv.port}"}
        listed = lmserve("list", env={**where, "LMSERVE_API_KEY": "sekret"})
        assert listed.returncode == 0 and MODEL in listed.stdout
        refused = lmserve("list", env=where)
        assert (refused.returncode, refused.stderr) == (
            1, f"Error: the server at {srv.base_url} requires an API key: set LMSERVE_API_KEY\n")
        wrong_key = lmserve("ps", env={**where, "LMSERVE_API_KEY": "nope"})
        assert "refused the API key in LMSERVE_API_KEY" in wrong_key.stderr
        by_port = lmserve("list", env={"LMSERVE_PORT": str(srv.port), "LMSERVE_API_KEY": "sekret"})
        assert by_port.returncode == 0 and MODEL in by_port.stdout
    finally:
        srv.stop()


def test_the_ollama_client_chats_generates_and_manages(server: Server) -> None:
    import ollama

    with ollama.Client(host=server.base_url) as client:
        assert [m.model for m in client.list().models] == [MODEL]
        reply = client.chat(model=MODEL, messages=QUESTION, options={"temperature": 0})
        assert "Paris" in reply.message.content
        assert reply.done_reason == "stop" and reply.eval_count and reply.prompt_eval_count
        parts = list(client.chat(model=MODEL, messages=QUESTION, options={"temperature": 0}, stream=True))
        assert "".join(p.message.content for p in parts) == reply.message.content
        generated = client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                                    options={"temperature": 0, "num_predict": 6})
        assert generated.done_reason == "length" and generated.eval_count == 6 and generated.context
        streamed = list(client.generate(model=MODEL, prompt="The capital of France is", raw=True, stream=True,
                                        options={"temperature": 0, "num_predict": 6}))
        assert "".join(p.response for p in streamed) == generated.response
        shown = client.show(MODEL)
        assert shown.details is not None and shown.details.family == "llama"
        assert [m.model for m in client.ps().models] == [MODEL]
        assert httpx.get(server.base_url + "/api/ps").json()["models"][0]["context_length"] == 1024
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model="nope", messages=QUESTION)
        assert info.value.status_code == 404


def test_embeddings_in_both_dialects(server: Server, client: openai.OpenAI) -> None:
    import math

    import ollama

    texts = ["The cat sat on the mat.", "A kitten is sitting on a rug.", "Interest rates rose again this quarter."]
    with ollama.Client(host=server.base_url) as native:
        pair = native.embed(model=MODEL, input=["a", "b"])
        assert pair.model == MODEL and len(pair.embeddings) == 2 and pair.prompt_eval_count
        reply = native.embed(model=MODEL, input=texts)
        legacy = native.embeddings(model=MODEL, prompt=texts[0])
    vectors = [list(v) for v in reply.embeddings]
    assert len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 100
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0, abs_tol=1e-5) for v in vectors)

    def cos(a: list[float], b: list[float]) -> float:
        return math.fsum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2])
    raw = list(legacy.embedding)
    assert cos(raw, vectors[0]) / math.sqrt(cos(raw, raw)) == pytest.approx(1.0, abs=1e-5)

    result = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert result.model == MODEL and [d.index for d in result.data] == [0, 1, 2]
    assert result.usage.prompt_tokens == result.usage.total_tokens == reply.prompt_eval_count
    assert result.data[2].embedding == pytest.approx(vectors[2], abs=1e-6)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=[], encoding_format="float")
    # Without encoding_format the client asks for base64 and decodes it after validating the body against a
    # list-of-floats type, so strict validation cannot read it (as with streamed completions): read it plainly.
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="placeholder", max_retries=0) as plain:
        packed = plain.embeddings.create(model=MODEL, input=["a", "b"])
    assert packed.data[0].embedding == pytest.approx(list(pair.embeddings[0]), abs=1e-6)


def test_embeddings_take_token_ids_as_openai_does(server: Server, client: openai.OpenAI) -> None:
    texts = ["The cat sat on the mat.", "Interest rates rose again this quarter."]
    ids = [httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
           for text in texts]  # the ids the server embeds a text as (LangChain's OpenAIEmbeddings sends such lists)
    by_text = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    for got, want in zip([*by_ids.data, *one.data], [*by_text.data, by_text.data[1]], strict=True):
        assert got.embedding == pytest.approx(want.embedding, abs=1e-5)
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == sum(len(i) for i in ids)
    assert one.usage.prompt_tokens == len(ids[1])
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=[[1, 2], [3, 10**6]], encoding_format="float")
    error = cast(dict[str, str], caught.value.body)
    assert error["param"] == "input" and "input[1][1] = 1000000" in error["message"]


def test_pull_progress_at_serve_is_one_line_per_step_and_tenth(capsys: pytest.CaptureFixture[str]) -> None:
    from lmserve.server import ProgressLines
    from lmserve.store.pull import PullProgress

    lines = ProgressLines()
    for completed in (0, 5, 10, 15, 50, 99, 100):
        lines(PullProgress("pulling model.safetensors", total=100, completed=completed))
    for status in ("verifying sha256 digest", "verifying sha256 digest", "success"):
        lines(PullProgress(status))
    assert capsys.readouterr().err.splitlines() == [
        "lmserve: pulling model.safetensors 0%", "lmserve: pulling model.safetensors 10%",
        "lmserve: pulling model.safetensors 50%", "lmserve: pulling model.safetensors 90%",
        "lmserve: pulling model.safetensors 100%", "lmserve: verifying sha256 digest", "lmserve: success",
    ]
