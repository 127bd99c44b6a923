"""Observers of the service: told of finished generations and model loads (metrics register here).

Observers are registered, never patched in: any number may listen, and one that fails is logged, never the
request's problem.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lmserve.types import Chunk

log = logging.getLogger(__name__)

FinishObserver = Callable[[str, Chunk], None]
"""Told (model name, final chunk) when a generation yields its final chunk."""
LoadObserver = Callable[[str], None]
"""Told the model name each time an engine instance is loaded for it."""


class Observers:
    """The registered observers of one service."""

    def __init__(self) -> None:
        self._on_finish: list[FinishObserver] = []
        self._on_load: list[LoadObserver] = []

    def on_finish(self, observer: FinishObserver) -> None:
        self._on_finish.append(observer)

    def on_load(self, observer: LoadObserver) -> None:
        self._on_load.append(observer)

    def finished(self, model: str, chunk: Chunk) -> None:
        for observer in self._on_finish:
            try:
                observer(model, chunk)
            except Exception:
                log.exception("finish observer failed")

    def loaded(self, model: str) -> None:
        for observer in self._on_load:
            try:
                observer(model)
            except Exception:
                log.exception("load observer failed")
