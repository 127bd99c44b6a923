"""JSON request bodies: routes take their body as a typed parameter (a pydantic model), read as JSON whatever the
Content-Type says.

FastAPI reads a body as JSON only when its Content-Type is JSON, but `curl -d` sends a form type, and the local
runner and OpenAI's servers read the body as JSON anyway: `JsonBodyRoute` does so too. The JSON is parsed by
pydantic's own parser (as `Model.model_validate_json` would), and a body that is not JSON is a 400 that says where
(wire_errors.invalid_from_validation renders it in the route's dialect).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope

JSON_TYPE = (b"content-type", b"application/json")


class JsonBodyRoute(APIRoute):
    """A route whose body parameter is read as JSON whatever the request's Content-Type."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def read_as_json(request: Request) -> Response:
            headers = [(name, value) for name, value in request.scope["headers"] if name != JSON_TYPE[0]]
            return await handler(JsonRequest({**request.scope, "headers": [*headers, JSON_TYPE]}, request.receive))

        return read_as_json


class JsonRequest(Request):
    """A request whose body parses with pydantic's JSON parser (NaN and Infinity taken, as pydantic takes them)."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        super().__init__(scope, receive)
        self._parsed: Any = None
        self._is_parsed = False

    async def json(self) -> Any:
        if not self._is_parsed:
            body = await self.body()
            try:
                self._parsed = pydantic_core.from_json(body)
            except ValueError as exc:  # FastAPI answers it as a `json_invalid` validation error
                raise json.JSONDecodeError(str(exc), body.decode(errors="replace"), 0) from None
            self._is_parsed = True
        return self._parsed
