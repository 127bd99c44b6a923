"""One exception tree for lmserve; each error knows its HTTP status and its OpenAI error type.

    LmserveError                      500 server_error
    ├── InvalidRequest                400 invalid_request_error   (bad body, bad field, bad role …)
    │   ├── ContextOverflow           400 invalid_request_error   (prompt longer than the context)
    │   └── InsufficientMemory        400 invalid_request_error   (a model larger than the memory there is)
    ├── AuthenticationFailed          401 authentication_error
    ├── ModelNotFound                 404 not_found_error
    ├── Overloaded                    503 overloaded_error
    ├── EngineStopped                 503 server_error            (a model's engine died: being restarted)
    ├── Unreachable                   502 upstream_error          (the model hub cannot be reached)
    └── EngineFailure                 500 server_error            (llama.cpp refused a batch, load failed …)

The web layer maps these to a wire body once (http/errors.py); nothing matches on message text.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NAMES_SHOWN = 5
"""How many available model names a ModelNotFound message lists."""


class LmserveError(Exception):
    """Base of every error lmserve raises on purpose."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(LmserveError):
    """The request is malformed or asks for something impossible."""

    status = 400
    type = "invalid_request_error"


class ContextOverflow(InvalidRequest):
    """The prompt (plus one token to generate) does not fit in the context window. The message gives the numbers
    and what can be done: a larger context where the model was trained for one, else a shorter prompt."""

    def __init__(self, num_prompt_tokens: int, num_ctx: int, num_ctx_train: int = 0) -> None:
        """`num_ctx`: the context per sequence in force; `num_ctx_train`: the model's trained length (0: unknown)."""
        super().__init__(context_advice(num_prompt_tokens, num_ctx, num_ctx_train), param="messages",
                         code="context_length_exceeded")
        self.num_prompt_tokens = num_prompt_tokens
        self.num_ctx = num_ctx
        self.num_ctx_train = num_ctx_train


def context_advice(num_prompt_tokens: int, num_ctx: int, num_ctx_train: int) -> str:
    """ContextOverflow's message: the prompt's tokens, the context in force, the trained length, and what to do."""
    said = (f"The prompt has {num_prompt_tokens} tokens, but this model's context is {num_ctx} tokens per sequence "
            "(the prompt must leave room for a token to generate).")
    if 0 < num_ctx_train <= num_prompt_tokens:
        return (f"{said} This model was trained for at most {num_ctx_train} tokens, so it cannot take this prompt: "
                "shorten it, or use a model with a longer context.")
    larger = 1 << num_prompt_tokens.bit_length()  # a power of two above the prompt
    if num_ctx_train > 0:
        larger = min(larger, num_ctx_train)
        return (f"{said} This model was trained for up to {num_ctx_train} tokens: start the server with -c {larger} "
                f"(--ctx-size), or set num_ctx {larger} in the request's options or a Modelfile PARAMETER; or "
                "shorten the prompt.")
    return (f"{said} Start the server with a larger context (e.g. -c {larger}), or set num_ctx {larger} in the "
            "request's options or a Modelfile PARAMETER; or shorten the prompt.")


class InsufficientMemory(InvalidRequest):
    """A model needs more memory than the machine has for it, even with every idle model unloaded.

    A 400, not a 5xx: retrying cannot help (OpenAI's and Anthropic's clients retry 5xx), asking for less can (a
    smaller context, fewer slots, a quantized KV cache, a smaller model). The message names both numbers in GiB,
    as the local runner's "model requires more system memory (X GiB) than is available (Y GiB)" does."""

    def __init__(self, name: str, needed_bytes: int, available_bytes: int, detail: str = "") -> None:
        """`detail`: what the need is made of and what to do, appended to the message."""
        message = (f"model '{name}' requires more system memory ({gib(needed_bytes)}) than is available "
                   f"({gib(available_bytes)})")
        super().__init__(message + (f": {detail}" if detail else ""), param="model", code="insufficient_memory")
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


def gib(num_bytes: int) -> str:
    """`num_bytes` in GiB, three significant digits (whole numbers from 100): "0.0916 GiB", "12.3 GiB"."""
    value = num_bytes / 2**30
    return f"{value:.3g} GiB" if value < 100 else f"{value:.0f} GiB"


class TemplateRejected(InvalidRequest):
    """The model's chat template refused the messages (e.g. a system message where it takes none)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="messages")


class AuthenticationFailed(LmserveError):
    """Missing or wrong API key."""

    status = 401
    type = "authentication_error"


class ModelNotFound(LmserveError):
    """The request names a model this server does not have."""

    status = 404
    type = "not_found_error"

    def __init__(self, name: str, *, available: Sequence[str] | None = None, hint: str = "") -> None:
        """`name` as the request wrote it; `available`: some names that do exist (None: not known); `hint`: how
        to get the model (e.g. "`lmserve pull smollm2:135m` restores it")."""
        message = f"model '{name}' not found"
        if hint:
            message += f": {hint}"
        if available is not None:
            shown = ", ".join(available[:MAX_NAMES_SHOWN]) or "none"
            more = len(available) - MAX_NAMES_SHOWN
            message += f" (available: {shown}" + (f" and {more} more; see GET /v1/models" if more > 0 else "") + ")"
        super().__init__(message, param="model", code="model_not_found")
        self.name = name


class Conflict(LmserveError):
    """The request conflicts with what the server is doing now (a model asked to sleep while it serves requests)."""

    status = 409
    type = "invalid_request_error"


class Overloaded(LmserveError):
    """The server cannot take more work right now."""

    status = 503
    type = "overloaded_error"


class EngineStopped(LmserveError):
    """A model's engine stopped (its engine process died, its thread failed): it is being restarted, or restarting
    it failed too often for now. A 503 with Retry-After: the same request may succeed once the model is back."""

    status = 503
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="engine_stopped")


class Unreachable(LmserveError):
    """Something lmserve needs from elsewhere (the model hub) cannot be reached: no fault of the request."""

    status = 502
    type = "upstream_error"


class EngineFailure(LmserveError):
    """The inference engine failed (load error, decode error)."""
