"""Option precedence, written once: what a request set → the model's Modelfile PARAMETERs → the sampling its
weights recommend → the server's defaults (lmserve/options.py holds the table and the merge)."""

from __future__ import annotations

from dataclasses import replace

from lmserve import options
from lmserve.engine.protocol import ModelInfo
from lmserve.errors import ContextOverflow
from lmserve.service.adapters import LoraRegistry
from lmserve.service.catalog import ModelSettings
from lmserve.types import AUTO_CONTEXT, LoadOptions, RequestOptions, SamplingParams


class Precedence:
    """The options a request runs with, from what it set and the model's settings."""

    def __init__(self, load_options: LoadOptions | None = None, n_predict: int = -1,
                 loras: LoraRegistry | None = None) -> None:
        self.load_options = load_options or LoadOptions()
        """The server's load-time options (flags and LMSERVE_* variables)."""
        self.n_predict = n_predict
        """The server's default length limit (--n-predict); -1: unlimited."""
        self.loras = loras
        """The adapters registered by name, whose global scales apply to the served model's plain requests."""

    def load(self, model: ModelSettings, asked: RequestOptions) -> LoadOptions:
        """Load-time options: the request's (num_ctx, num_gpu …) over the model's PARAMETERs over the server's."""
        return options.load_options(self.load_options, asked.values, model.parameters)

    def sampling(self, model: ModelSettings, asked: RequestOptions, base: SamplingParams) -> SamplingParams:
        """`base` (the request's settings no option names: grammar, logprobs …) with the sampling options of the
        request over the model's PARAMETERs, its recommended sampling and the server's defaults for the request's
        dialect, and the context asked for (`num_ctx`) as its `context_limit`. Its LoRA adapters: those the request
        named (`lora`), else the model's (ADAPTER), else the registered ones at their global scales. A fresh record."""
        params = options.sampling(asked.values, model.parameters, model.recommended,
                                  options.server_defaults(asked.defaults, self.n_predict), base=base)
        if asked.lora is not None and self.loras is not None:
            params.adapters = self.loras.resolve(asked.lora)
        elif not params.adapters:
            params.adapters = model.adapters or (self.loras.applied(model.name) if self.loras is not None else ())
        num_ctx = self.load(model, asked).num_ctx
        return params if num_ctx == AUTO_CONTEXT else replace(params, context_limit=num_ctx)


def within_context(info: ModelInfo, num_prompt_tokens: int, sampling: SamplingParams) -> SamplingParams:
    """`sampling` kept within the request's own context (`context_limit`) where that is below the engine's: a prompt
    that does not fit below it is a ContextOverflow naming it, and the reply's length is capped where it falls (it
    ends "length", as at the end of the engine's context)."""
    limit = sampling.context_limit
    if limit is None or limit >= info.num_ctx:
        return sampling
    if num_prompt_tokens >= limit:
        raise ContextOverflow(num_prompt_tokens, limit, info.num_ctx_train)
    room = limit - num_prompt_tokens
    if sampling.max_tokens is not None and sampling.max_tokens <= room:
        return sampling
    return replace(sampling, max_tokens=room)
