"""The HTTP layer: the app's wiring (create_app), the one mapping of errors to HTTP, the guards, authentication,
the access log, metrics, the OpenAPI document and the web page. The routes themselves are the dialects'
(lmserve/dialects/) and the other endpoints' (lmserve/endpoints/)."""

from __future__ import annotations

from lmserve.http.app import create_app

__all__ = ["create_app"]
