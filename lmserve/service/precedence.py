"""Option precedence, written once: what a request set → the model's Modelfile PARAMETERs → the sampling its
weights recommend → the server's defaults (lmserve/options.py holds the table and the merge)."""

from __future__ import annotations

from lmserve import options
from lmserve.service.catalog import ModelSettings
from lmserve.types import LoadOptions, RequestOptions, SamplingParams


class Precedence:
    """The options a request runs with, from what it set and the model's settings."""

    def __init__(self, load_options: LoadOptions | None = None, n_predict: int = -1) -> None:
        self.load_options = load_options or LoadOptions()
        """The server's load-time options (flags and LMSERVE_* variables)."""
        self.n_predict = n_predict
        """The server's default length limit (--n-predict); -1: unlimited."""

    def load(self, model: ModelSettings, asked: RequestOptions) -> LoadOptions:
        """Load-time options: the request's (num_ctx, num_gpu …) over the model's PARAMETERs over the server's."""
        return options.load_options(self.load_options, asked.values, model.parameters)

    def sampling(self, model: ModelSettings, asked: RequestOptions, base: SamplingParams) -> SamplingParams:
        """`base` (the request's settings no option names: grammar, logprobs …) with the sampling options of the
        request over the model's PARAMETERs, its recommended sampling and the server's defaults for the request's
        dialect. A fresh record."""
        return options.sampling(asked.values, model.parameters, model.recommended,
                                options.server_defaults(asked.defaults, self.n_predict), base=base)
