"""lmserve.client against httpx.MockTransport: request shapes, NDJSON streams, and the two error types."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from lmserve.client import Client, ClientError, ServerBusy, ServerUnreachable, parse_host

Handler = Callable[[httpx.Request], httpx.Response]


class Recorder:
    """A MockTransport handler that answers per (method, path) and remembers every request."""

    def __init__(self, routes: dict[tuple[str, str], httpx.Response]) -> None:
        self.routes = routes
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.routes.get((request.method, request.url.path), httpx.Response(404, json={"error": "no route"}))

    @property
    def body(self) -> dict[str, Any]:
        return dict(json.loads(self.requests[-1].content))


def ndjson(*lines: dict[str, Any]) -> httpx.Response:
    text = "".join(json.dumps(line) + "\n" for line in lines)
    return httpx.Response(200, text=text, headers={"content-type": "application/x-ndjson"})


def client_for(routes: dict[tuple[str, str], httpx.Response]) -> tuple[Client, Recorder]:
    recorder = Recorder(routes)
    return Client("127.0.0.1:9999", transport=httpx.MockTransport(recorder)), recorder


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        (None, "http://127.0.0.1:11434"),
        ("", "http://127.0.0.1:11434"),
        ("127.0.0.1:8080", "http://127.0.0.1:8080"),
        (":9000", "http://127.0.0.1:9000"),
        ("example.com", "http://example.com:11434"),
        ("http://example.com:1234", "http://example.com:1234"),
        ("http://example.com:1234/", "http://example.com:1234"),
        ("https://example.com", "https://example.com:443"),
        ("0.0.0.0:11434", "http://0.0.0.0:11434"),
        ("[::1]:8000", "http://[::1]:8000"),
        ("http://host:1/prefix/", "http://host:1/prefix"),
    ],
)
def test_parse_host(host: str | None, expected: str) -> None:
    assert parse_host(host) == expected


def test_host_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMSERVE_HOST", ":7777")
    assert Client().base_url == "http://127.0.0.1:7777"
    monkeypatch.delenv("LMSERVE_HOST")
    assert Client().base_url == "http://127.0.0.1:11434"
    assert Client("h:1").base_url == "http://h:1"


def test_version_and_is_running() -> None:
    client, recorder = client_for({("GET", "/api/version"): httpx.Response(
        200, json={"version": "0.12.11", "lmserve_version": "0.1.0"})})
    assert client.version() == "0.1.0"
    assert client.is_running()
    assert str(recorder.requests[0].url) == "http://127.0.0.1:9999/api/version"


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_connection_refused_is_server_unreachable() -> None:
    client = Client(":9999", transport=httpx.MockTransport(refuse))
    assert not client.is_running()
    with pytest.raises(ServerUnreachable, match=r"could not connect to lmserve at http://127\.0\.0\.1:9999"):
        client.tags()
    with pytest.raises(ServerUnreachable):
        list(client.chat("m", [{"role": "user", "content": "hi"}]))


def test_plain_json_routes_send_the_native_shapes() -> None:
    models = {"models": [{"name": "a:latest", "digest": "sha256:" + "ab" * 32}]}
    client, recorder = client_for({
        ("GET", "/api/tags"): httpx.Response(200, json=models),
        ("GET", "/api/ps"): httpx.Response(200, json={"models": []}),
        ("POST", "/api/show"): httpx.Response(200, json={"modelfile": "FROM x"}),
        ("POST", "/api/copy"): httpx.Response(200),
        ("DELETE", "/api/delete"): httpx.Response(200),
        ("POST", "/api/generate"): httpx.Response(200, json={"done": True, "done_reason": "unload"}),
    })
    assert client.tags() == models
    assert client.ps() == {"models": []}
    assert client.show("a", verbose=True) == {"modelfile": "FROM x"}
    assert recorder.body == {"model": "a", "verbose": True}
    client.copy("a", "b")
    assert recorder.body == {"source": "a", "destination": "b"}
    client.delete("b")
    assert (recorder.requests[-1].method, recorder.body) == ("DELETE", {"model": "b"})
    client.stop("a")
    assert recorder.body == {"model": "a", "prompt": "", "keep_alive": 0, "stream": False}


def test_create_streams_status_lines_and_sends_only_given_fields() -> None:
    lines = [{"status": "parsing modelfile"}, {"status": "writing manifest"}, {"status": "success"}]
    client, recorder = client_for({("POST", "/api/create"): ndjson(*lines)})
    assert list(client.create("m", "FROM /x.gguf\n", quantize="q8_0")) == lines
    assert recorder.body == {"model": "m", "modelfile": "FROM /x.gguf\n", "quantize": "q8_0", "stream": True}
    list(client.create("n", from_="/abs/model.gguf", files={"a.gguf": "sha256:00"}))
    assert recorder.body == {"model": "n", "from": "/abs/model.gguf", "files": {"a.gguf": "sha256:00"},
                             "stream": True}


def test_the_request_is_sent_when_iteration_starts() -> None:
    client, recorder = client_for({("POST", "/api/pull"): ndjson({"status": "success"})})
    stream = client.pull("m")
    assert recorder.requests == []
    assert next(stream) == {"status": "success"}


def test_pull_progress_lines() -> None:
    lines: list[dict[str, Any]] = [{"status": "pulling manifest"}, {"status": "success"},
                                   {"status": "pulling abc", "digest": "sha256:abc", "total": 10, "completed": 5}]
    client, recorder = client_for({("POST", "/api/pull"): ndjson(*lines)})
    assert list(client.pull("hf.co/org/repo:Q4_K_M")) == lines
    assert recorder.body == {"model": "hf.co/org/repo:Q4_K_M", "stream": True}


def test_generate_and_chat_stream_chunks() -> None:
    gen = [{"response": "Hel", "done": False}, {"response": "lo", "done": True, "eval_count": 2}]
    chat = [{"message": {"role": "assistant", "content": "Hi"}, "done": False},
            {"message": {"role": "assistant", "content": ""}, "done": True}]
    client, recorder = client_for({("POST", "/api/generate"): ndjson(*gen), ("POST", "/api/chat"): ndjson(*chat)})
    assert list(client.generate("m", "Say hi", images=["aGk="], options={"temperature": 0}, system="S")) == gen
    assert recorder.body == {"model": "m", "prompt": "Say hi", "stream": True, "images": ["aGk="],
                             "options": {"temperature": 0}, "system": "S"}
    messages = [{"role": "user", "content": "Hi", "images": ["aGk="]}]
    assert list(client.chat("m", messages, options={"seed": 1}, keep_alive="5m")) == chat
    assert recorder.body == {"model": "m", "messages": messages, "stream": True, "options": {"seed": 1},
                             "keep_alive": "5m"}


def test_stream_false_yields_the_single_object() -> None:
    answer = {"message": {"role": "assistant", "content": "Hi"}, "done": True}
    client, recorder = client_for({("POST", "/api/chat"): httpx.Response(200, json=answer)})
    assert list(client.chat("m", [], stream=False)) == [answer]
    assert recorder.body["stream"] is False


@pytest.mark.parametrize(
    ("response", "message", "status"),
    [
        (httpx.Response(404, json={"error": "model 'x' not found"}), "model 'x' not found", 404),
        (httpx.Response(400, json={"error": {"message": "bad", "type": "invalid_request_error"}}), "bad", 400),
        (httpx.Response(503, text="busy"), "busy", 503),
        (httpx.Response(500), "500 Internal Server Error", 500),
    ],
)
@pytest.mark.parametrize("route", ["show", "chat", "create"])
def test_http_errors_raise_client_error(response: httpx.Response, message: str, status: int, route: str) -> None:
    path = {"show": "/api/show", "chat": "/api/chat", "create": "/api/create"}[route]
    client, _ = client_for({("POST", path): response})
    calls: dict[str, Callable[[], object]] = {
        "show": lambda: client.show("x"),
        "chat": lambda: list(client.chat("x", [])),
        "create": lambda: list(client.create("x", "FROM y")),
    }
    with pytest.raises(ClientError) as caught:
        calls[route]()
    assert (caught.value.message, caught.value.status, str(caught.value)) == (message, status, message)


def test_error_line_mid_stream_raises_after_the_chunks_before_it() -> None:
    client, _ = client_for({("POST", "/api/generate"): ndjson({"response": "a", "done": False},
                                                              {"error": "the engine failed"})})
    stream: Iterator[dict[str, Any]] = client.generate("m", "p")
    assert next(stream)["response"] == "a"
    with pytest.raises(ClientError, match="the engine failed"):
        next(stream)


def test_a_line_that_is_not_json_raises_client_error() -> None:
    client, _ = client_for({("POST", "/api/pull"): httpx.Response(200, text="{\"status\": \"ok\"}\nnot json\n")})
    with pytest.raises(ClientError, match="not JSON"):
        list(client.pull("m"))


def test_blank_lines_are_skipped_and_context_manager_closes() -> None:
    client, _ = client_for({("POST", "/api/pull"): httpx.Response(200, text='\n{"status": "success"}\n\n')})
    with client:
        assert list(client.pull("m")) == [{"status": "success"}]


# ---- where the server is, its API key, and what answers -------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "http://127.0.0.1:11434"),
        ({"LMSERVE_PORT": "8123"}, "http://127.0.0.1:8123"),
        ({"LMSERVE_HOST": "0.0.0.0", "LMSERVE_PORT": "8123"}, "http://0.0.0.0:8123"),
        ({"LMSERVE_HOST": "h:9000", "LMSERVE_PORT": "8123"}, "http://h:9000"),
        ({"LMSERVE_HOST": "[::1]", "LMSERVE_PORT": "8123"}, "http://[::1]:8123"),
        ({"LMSERVE_HOST": "https://h", "LMSERVE_PORT": ""}, "https://h:443"),
        ({"LMSERVE_HOST": "https://h", "LMSERVE_PORT": "8443"}, "https://h:8443"),
    ],
)
def test_lmserve_port_is_honoured_unless_the_host_names_a_port(env: dict[str, str], expected: str) -> None:
    assert Client(env=env).base_url == expected


@pytest.mark.parametrize("env", [{"LMSERVE_PORT": "99999"}, {"LMSERVE_PORT": "eleven"}, {"LMSERVE_HOST": "h:x"}])
def test_an_unusable_address_is_a_client_error(env: dict[str, str]) -> None:
    with pytest.raises(ClientError, match="LMSERVE_HOST/LMSERVE_PORT"):
        Client(env=env)


def test_the_api_key_is_sent_as_a_bearer_token() -> None:
    recorder = Recorder({("GET", "/api/tags"): httpx.Response(200, json={"models": []})})
    with Client(env={"LMSERVE_API_KEY": "sekret"}, transport=httpx.MockTransport(recorder)) as client:
        client.tags()
    assert recorder.requests[0].headers["authorization"] == "Bearer sekret"
    with Client(env={}, transport=httpx.MockTransport(recorder)) as client:
        client.tags()
    assert "authorization" not in recorder.requests[1].headers


def unauthorized(request: httpx.Request) -> httpx.Response:
    return httpx.Response(401, json={"error": {"message": "Invalid API key", "type": "authentication_error"}})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, r"the server at http://127\.0\.0\.1:11434 requires an API key: set LMSERVE_API_KEY"),
        ({"LMSERVE_API_KEY": "wrong"},
         r"the server at http://127\.0\.0\.1:11434 refused the API key in LMSERVE_API_KEY"),
    ],
)
def test_a_401_says_an_api_key_is_needed(env: dict[str, str], message: str) -> None:
    client = Client(env=env, transport=httpx.MockTransport(unauthorized))
    for call in (client.check_server, client.tags, lambda: list(client.chat("m", []))):
        with pytest.raises(ClientError, match=message) as caught:
            call()
        assert caught.value.status == 401
    assert not client.is_running()


@pytest.mark.parametrize(
    ("response", "named"),
    [
        (httpx.Response(404, text="<html>Not Found</html>", headers={"server": "nginx"}), "404 Not Found from 'nginx'"),
        (httpx.Response(200, text="hello"), "200 OK"),
        (httpx.Response(200, json={"name": "other"}), "200 OK"),
        (httpx.Response(500, json={"error": "boom"}), "500 Internal Server Error"),
    ],
)
def test_something_else_answering_is_named_not_taken_for_no_server(response: httpx.Response, named: str) -> None:
    client = Client(env={}, transport=httpx.MockTransport(lambda request: response))
    with pytest.raises(ClientError) as caught:
        client.check_server()
    assert caught.value.message.startswith("something that is not lmserve answers at http://127.0.0.1:11434")
    assert named in caught.value.message


def test_check_server_is_true_for_lmserve_and_false_for_nothing() -> None:
    answering = Client(env={}, transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"version": "0.1"})))
    assert answering.check_server()
    assert not Client(env={}, transport=httpx.MockTransport(refuse)).check_server()


def test_check_server_says_busy_when_something_accepts_but_does_not_answer_in_time() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    client = Client(env={}, transport=httpx.MockTransport(slow))
    with pytest.raises(ServerBusy, match="accepted the connection but did not answer GET /api/version within 10 s"):
        client.check_server()
    assert not client.is_running()
