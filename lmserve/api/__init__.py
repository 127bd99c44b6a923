"""The HTTP layer: FastAPI app, wire schemas and the OpenAI (later native) dialect translators."""

from __future__ import annotations

from lmserve.api.app import create_app

__all__ = ["create_app"]
