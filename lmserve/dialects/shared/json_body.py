"""JSON request bodies: routes take their body as a typed parameter (a pydantic model), so the OpenAPI document is
generated from it; `JsonBodyRoute` reads and checks it as lmserve always has.

FastAPI reads a body as JSON only when its Content-Type is JSON, but `curl -d` sends a form type, and the local
runner and OpenAI's servers read the body as JSON anyway: so does `JsonBodyRoute`. The body is validated in
pydantic's JSON mode (`Model.model_validate_json`: its own parser and its messages, "Input should be an object"),
before FastAPI sees it; a problem is a RequestValidationError, which the app answers with a 400 in the route's
dialect (http/errors.py, shared/errors.invalid_from_validation).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.types import Receive, Scope

JSON_TYPE = (b"content-type", b"application/json")


class JsonBodyRoute(APIRoute):
    """A route whose body parameter is read as JSON whatever the request's Content-Type, in pydantic's JSON mode."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler
        assert field.field_info.annotation is not None, self.path
        body_type = TypeAdapter[Any](field.field_info.annotation)
        required = field.field_info.is_required()

        async def read_as_json(request: Request) -> Response:
            headers = [(name, value) for name, value in request.scope["headers"] if name != JSON_TYPE[0]]
            json_request = JsonRequest({**request.scope, "headers": [*headers, JSON_TYPE]}, request.receive)
            body = await json_request.body()
            if body or required:  # an optional body left out is its default
                try:
                    json_request.parsed = body_type.validate_json(body)
                except ValidationError as exc:
                    errors = exc.errors(include_url=False)
                    raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None
            return await handler(json_request)

        return read_as_json


class JsonRequest(Request):
    """A request whose JSON body was read and validated already: FastAPI takes the result as it is."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        super().__init__(scope, receive)
        self.parsed: Any = None

    async def json(self) -> Any:
        return self.parsed
