"""The Anthropic error body: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

from typing import Any

from lmserve.errors import ContextOverflow, LmserveError, ModelNotFound

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(err: LmserveError) -> dict[str, Any]:
    """The Anthropic error body; its type follows the HTTP status (e.g. 404 not_found_error, 500 api_error).

    Where Anthropic's clients read the message (Claude Code falls back or compacts on these), it starts with
    Anthropic's own wording: an unknown model is "model: NAME …", a prompt over the context "prompt is too long:
    N tokens > M maximum …"."""
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": anthropic_message(err)}}


def anthropic_message(err: LmserveError) -> str:
    """`err`'s message in Anthropic's wording where its clients match on it (see anthropic_error)."""
    if isinstance(err, ModelNotFound):
        return f"model: {err.name} ({err.message})"
    if isinstance(err, ContextOverflow):
        return f"prompt is too long: {err.num_prompt_tokens} tokens > {err.num_ctx} maximum. {err.message}"
    return err.message
