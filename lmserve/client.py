"""A small synchronous client for lmserve's native API (`/api/*`), used by the command-line interface.

    client = Client()                      # LMSERVE_HOST / LMSERVE_PORT, default 127.0.0.1:11434
    for chunk in client.chat("smollm2:135m", [{"role": "user", "content": "Hi"}]):
        print(chunk["message"]["content"], end="")

Streaming methods return iterators over the NDJSON objects; the request is sent when iteration starts.
An HTTP error with a `{"error": "…"}` body, and an `{"error": …}` line inside a stream, raise `ClientError`;
a server that cannot be reached raises `ServerUnreachable`. With LMSERVE_API_KEY set, every request carries it as
`Authorization: Bearer <key>`; a 401 says so rather than anything about the request.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from lmserve.parsing import ParseError, parse_address

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434
HOST_ENV = "LMSERVE_HOST"
PORT_ENV = "LMSERVE_PORT"
API_KEY_ENV = "LMSERVE_API_KEY"
_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=5.0)
_PROBE_TIMEOUT = httpx.Timeout(connect=5.0, read=10.0, write=10.0, pool=5.0)

Json = dict[str, Any]


class ClientError(Exception):
    """The server answered with an error. `status` is the HTTP status (None when there was no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class ServerUnreachable(ClientError):
    """Nothing answered at the server's address (connection refused, unknown host, connect timeout)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(f"could not connect to lmserve at {base_url}")
        self.base_url = base_url


class ServerBusy(ClientError):
    """Something accepted the connection but did not answer in time: most often lmserve itself, still starting or
    busy on a loaded machine."""

    def __init__(self, base_url: str) -> None:
        super().__init__(f"the server at {base_url} accepted the connection but did not answer GET /api/version "
                         f"within {_PROBE_TIMEOUT.read:.0f} s")
        self.base_url = base_url


def parse_host(host: str | None, port: str | None = None) -> str:
    """`http://h:p`, `h:p`, `h`, `:p` or None/"" → a base URL such as `http://127.0.0.1:11434`.

    `port` (LMSERVE_PORT) is used when `host` names no port; then https defaults to 443, else 11434.
    """
    try:
        address = parse_address(host or "")
        fallback = parse_address(f":{port.strip()}").port if port and port.strip() else None
    except ParseError as exc:
        raise ClientError(f"{HOST_ENV}/{PORT_ENV}: {exc}") from None
    scheme = address.scheme or "http"
    number = address.port if address.port is not None else fallback
    if number is None:
        number = 443 if scheme == "https" and address.host else DEFAULT_PORT
    name = address.url_host or DEFAULT_HOST
    return f"{scheme}://{name}:{number}{address.path}"


def base_url_from(env: Mapping[str, str]) -> str:
    """The server's base URL from LMSERVE_HOST and LMSERVE_PORT (the host's own port wins)."""
    return parse_host(env.get(HOST_ENV), env.get(PORT_ENV))


class Client:
    """The native API, one method per route. `transport` replaces the network (tests pass httpx.MockTransport)."""

    def __init__(self, host: str | None = None, *, api_key: str | None = None,
                 transport: httpx.BaseTransport | None = None, timeout: httpx.Timeout | float | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        """`host` (else LMSERVE_HOST and LMSERVE_PORT from `env`, default os.environ) and `api_key` (else
        LMSERVE_API_KEY) say where the server is and what key it needs."""
        environ = os.environ if env is None else env
        self.base_url = parse_host(host) if host is not None else base_url_from(environ)
        self.api_key = api_key if api_key is not None else environ.get(API_KEY_ENV) or None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._http = httpx.Client(base_url=self.base_url, transport=transport, headers=headers,
                                  timeout=_TIMEOUT if timeout is None else timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plain JSON routes -------------------------------------------------------------------------------------

    def version(self) -> str:
        """The server's own version (lmserve's, not the local runner's release its routes follow)."""
        answer = self._request("GET", "/api/version")
        return str(answer.get("lmserve_version") or answer.get("version", ""))

    def is_running(self) -> bool:
        """True when lmserve answers at the address (False for nothing, or for something else)."""
        try:
            return self.check_server()
        except ClientError:
            return False

    def check_server(self) -> bool:
        """True when lmserve answers `/api/version`; False when nothing answers at the address.

        Raises ClientError when something answers but is not a server this client can use: one that wants an API
        key (401), or anything that does not answer `/api/version` as lmserve does (what answered is named);
        ServerBusy when something accepts the connection but does not answer in time.
        """
        try:
            response = self._http.get("/api/version", timeout=_PROBE_TIMEOUT)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            return False
        except httpx.ReadTimeout:
            raise ServerBusy(self.base_url) from None
        except httpx.TransportError as exc:
            raise ClientError(f"something that is not lmserve answers at {self.base_url} ({exc!r}); "
                              f"set {HOST_ENV} to lmserve's address") from None
        if response.status_code == 401:
            raise self._unauthorized()
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.is_success and isinstance(data, dict) and isinstance(data.get("version"), str):
            return True
        server = response.headers.get("server")
        raise ClientError(f"something that is not lmserve answers at {self.base_url}: GET /api/version gave "
                          f"{response.status_code} {response.reason_phrase}".rstrip()
                          + (f" from '{server}'" if server else "")
                          + f"; set {HOST_ENV} to lmserve's address", response.status_code)

    def tags(self) -> Json:
        """`{"models": [...]}`: every model in the store."""
        return self._request("GET", "/api/tags")

    def show(self, model: str, verbose: bool = False) -> Json:
        """Modelfile, parameters, template, details, model_info and capabilities of one model."""
        return self._request("POST", "/api/show", {"model": model, "verbose": verbose})

    def copy(self, src: str, dst: str) -> None:
        self._request("POST", "/api/copy", {"source": src, "destination": dst})

    def delete(self, model: str) -> None:
        self._request("DELETE", "/api/delete", {"model": model})

    def ps(self) -> Json:
        """`{"models": [...]}`: the models loaded now."""
        return self._request("GET", "/api/ps")

    def stop(self, model: str) -> None:
        """Unload a model now (an empty generate with `keep_alive: 0`)."""
        self._request("POST", "/api/generate", {"model": model, "prompt": "", "keep_alive": 0, "stream": False})

    # ---- streaming routes --------------------------------------------------------------------------------------

    def create(self, model: str, modelfile: str | None = None, *, from_: str | None = None,
               files: Mapping[str, str] | None = None, quantize: str | None = None,
               stream: bool = True) -> Iterator[Json]:
        """Create `model` from Modelfile text and/or `from_` (a model name or a .gguf path); yields status lines."""
        body: Json = {"model": model, "stream": stream}
        optional = {"modelfile": modelfile, "from": from_, "files": dict(files) if files else None,
                    "quantize": quantize}
        body.update({key: value for key, value in optional.items() if value is not None})
        return self._stream("/api/create", body, stream)

    def pull(self, model: str, *, stream: bool = True) -> Iterator[Json]:
        """Download a model; yields `{status, digest, total, completed}` lines ending with `{"status": "success"}`."""
        return self._stream("/api/pull", {"model": model, "stream": stream}, stream)

    def generate(self, model: str, prompt: str, *, images: Sequence[str] | None = None,
                 options: Mapping[str, Any] | None = None, system: str | None = None, stream: bool = True,
                 keep_alive: str | int | None = None) -> Iterator[Json]:
        """Complete `prompt`; `images` are base64 strings. Yields `{"response": …, "done": …}` chunks."""
        body: Json = {"model": model, "prompt": prompt, "stream": stream}
        optional = {"images": list(images) if images else None, "options": dict(options) if options else None,
                    "system": system, "keep_alive": keep_alive}
        body.update({key: value for key, value in optional.items() if value is not None})
        return self._stream("/api/generate", body, stream)

    def chat(self, model: str, messages: Sequence[Mapping[str, Any]], *, options: Mapping[str, Any] | None = None,
             stream: bool = True, keep_alive: str | int | None = None) -> Iterator[Json]:
        """Answer `messages`; yields `{"message": {"role", "content"}, "done": …}` chunks."""
        body: Json = {"model": model, "messages": [dict(m) for m in messages], "stream": stream}
        if options:
            body["options"] = dict(options)
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        return self._stream("/api/chat", body, stream)

    # ---- plumbing ----------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Json | None = None) -> Json:
        try:
            response = self._http.request(method, path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise ServerUnreachable(self.base_url) from None
        except httpx.TransportError as exc:
            raise ClientError(f"connection to {self.base_url} failed: {exc}") from None
        self._raise_for_status(response)
        if not response.content:
            return {}
        data = _decode(response.text)
        return data if isinstance(data, dict) else {"value": data}

    def _stream(self, path: str, body: Json, stream: bool) -> Iterator[Json]:
        if not stream:
            yield self._request("POST", path, body)
            return
        try:
            with self._http.stream("POST", path, json=body) as response:
                if response.is_error:
                    response.read()
                    self._raise_for_status(response)
                for line in response.iter_lines():
                    if line.strip():
                        yield _check_line(_decode(line))
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise ServerUnreachable(self.base_url) from None
        except httpx.TransportError as exc:
            raise ClientError(f"connection to {self.base_url} failed: {exc}") from None

    def _raise_for_status(self, response: httpx.Response) -> None:
        if response.status_code == 401:
            raise self._unauthorized()
        _raise_for_status(response)

    def _unauthorized(self) -> ClientError:
        if self.api_key:
            return ClientError(f"the server at {self.base_url} refused the API key in {API_KEY_ENV}", 401)
        return ClientError(f"the server at {self.base_url} requires an API key: set {API_KEY_ENV}", 401)


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ClientError(f"the server sent something that is not JSON: {text[:200]!r}") from None


def _check_line(data: Any) -> Json:
    if not isinstance(data, dict):
        raise ClientError(f"the server sent an unexpected line: {data!r}")
    if data.get("error"):
        raise ClientError(_error_message(data["error"]))
    return data


def _raise_for_status(response: httpx.Response) -> None:
    if not response.is_error:
        return
    message = f"{response.status_code} {response.reason_phrase}".strip()
    try:
        data = response.json()
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("error"):
        message = _error_message(data["error"])
    elif response.text.strip() and data is None:
        message = response.text.strip()[:500]
    raise ClientError(message, response.status_code)


def _error_message(error: Any) -> str:
    """Native `{"error": "…"}`, or the OpenAI shape `{"error": {"message": …}}`."""
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
