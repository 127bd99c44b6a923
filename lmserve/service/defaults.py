"""The option layers under a request: a model's Modelfile PARAMETERs and defaults over the server's.

(Formerly `Service.sampling_defaults` / `Service.load_defaults`.)
"""

from __future__ import annotations

from lmserve import options
from lmserve.options import Dialect
from lmserve.service.catalog import Catalog
from lmserve.types import LoadOptions, SamplingParams


class Defaults:
    """What a request gets for the options it does not set, per model."""

    def __init__(self, catalog: Catalog, load_options: LoadOptions | None = None, n_predict: int = -1) -> None:
        self.catalog = catalog
        self.load_options = load_options or LoadOptions()
        """The server's load-time options (flags and LMSERVE_* variables)."""
        self.n_predict = n_predict
        """The server's default length limit (--n-predict); -1: unlimited."""

    def load_defaults(self, name: str) -> LoadOptions:
        """Load-time options for `name`: its Modelfile PARAMETERs (num_ctx, num_batch …) over the server's."""
        return options.load_options(self.load_options, self.catalog.parameters(self.catalog.resolve(name)))

    async def sampling_defaults(self, name: str, dialect: Dialect = "openai") -> SamplingParams:
        """The layers under a request (options.py): Modelfile PARAMETERs → model defaults → the server's for
        `dialect`. A fresh record: the request's own options go on top of it."""
        canonical = self.catalog.resolve(name)
        return options.sampling(self.catalog.parameters(canonical), self.catalog.model_defaults(canonical),
                                options.server_defaults(dialect, self.n_predict))
