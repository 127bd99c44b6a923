"""The option layers under a request: a model's Modelfile PARAMETERs and defaults over the server's.

(Formerly `Service.sampling_defaults` / `Service.load_defaults`.)
"""

from __future__ import annotations

from dataclasses import replace

from lmserve.service.catalog import Catalog
from lmserve.types import LoadOptions, SamplingParams


class Defaults:
    """What a request gets for the options it does not set, per model."""

    def __init__(self, catalog: Catalog, load_options: LoadOptions | None = None) -> None:
        self.catalog = catalog
        self.load_options = load_options or LoadOptions()
        """The server's load-time options (flags and LMSERVE_* variables)."""

    def load_defaults(self, name: str) -> LoadOptions:
        """Load-time options for `name`: its Modelfile PARAMETERs (num_ctx, num_batch …) over the server's."""
        return replace(self.load_options, **self.catalog.load_parameters(self.catalog.resolve(name)))

    async def sampling_defaults(self, name: str) -> SamplingParams:
        """The model's Modelfile PARAMETERs over the server defaults (a request's own fields go on top)."""
        defaults = self.catalog.sampling_defaults(self.catalog.resolve(name))
        return replace(defaults, stop=list(defaults.stop), logit_bias=dict(defaults.logit_bias))
