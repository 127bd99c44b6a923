"""The stream of one request on vLLM: its deltas as `Chunk`s, the last with finish reason, usage and timings."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from lmserve.engine.vllm.errors import engine_error
from lmserve.engine.vllm.gate import gate_kind
from lmserve.engine.vllm.logprobs import LogprobMapper
from lmserve.engine.vllm.vision import encoder_decoder_prompt, multi_modal_data
from lmserve.types import Chunk, FinishReason, Timings, TokenLogprob, Usage

if TYPE_CHECKING:
    from lmserve.engine.vllm.engine import VllmEngine


_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_ids = itertools.count()


def request_id(kind: str = "") -> str:
    """A new request's id in vLLM ("lmserve-12"; "lmserve-rank-13" with kind "rank-")."""
    return f"lmserve-{kind}{next(_ids)}"


class VllmStream:
    """The output of one request: vLLM's deltas as chunks; the last one carries finish reason, usage and timings."""

    def __init__(self, engine: VllmEngine, prompt: list[int], params: Any, images: list[Any] | None = None, *,
                 priority: int = 0, lora: Any = None) -> None:
        self._engine = engine
        self._lora = lora
        """vLLM's LoRARequest for the request's adapter, or None (engine/vllm/lora.py)."""
        self._prompt = prompt
        self._params = params
        self._images = images or []
        self._priority = priority
        self._prompt_length = len(prompt)
        self._output: list[int] = []
        self.request_id = request_id()
        self.failure: str | None = None
        self._aborted = False
        self._gated: str | None = None
        """The kind this request counts as in the engine's KindGate (engine/vllm/gate.py), while it does."""
        asked = getattr(params, "prompt_logprobs", None)
        self._logprobs = (LogprobMapper(engine.llm_tokenizer, special=not params.skip_special_tokens,
                                        k=int(params.logprobs), keep_end=asked is not None)
                          if params.logprobs is not None else None)
        self._prompt_logprobs = LogprobMapper(engine.llm_tokenizer, special=True, k=int(asked)) \
            if asked is not None else None
        """Maps the prompt's log-probabilities, until the first output carried them."""

    @property
    def prompt_tokens(self) -> list[int]:
        return self._prompt

    @property
    def output_tokens(self) -> list[int]:
        return self._output

    def _logprobs_of(self, completion: Any, *, finished: bool) -> list[TokenLogprob]:
        if self._logprobs is None:
            return []
        return self._logprobs.push(list(completion.token_ids), completion.logprobs, completion.text,
                                   finished=finished, finish_reason=completion.finish_reason,
                                   stop_reason=completion.stop_reason)

    def _scores(self, completion: Any) -> list[float]:
        """The first token's log-probabilities of the request's `logprob_token_ids` (SamplingParams.score_tokens),
        in their order; none when vLLM returned no entry for one of them.

        vLLM's entry for a position maps each id to a `Logprob`: the sampled token first, then the ids asked for
        (their `rank` is not theirs: vLLM numbers them 1, 2… as if they were the top alternatives).
        """
        wanted = self._params.logprob_token_ids
        if not wanted or not completion.logprobs:
            return []
        first = completion.logprobs[0]
        if any(token not in first for token in wanted):
            return []
        return [float(first[token].logprob) for token in wanted]

    def abort(self) -> None:
        """Stop generating; vLLM frees the request's blocks on its next step."""
        if not self._aborted:
            self._aborted = True
            self._engine.abort(self.request_id, then=self._leave_gate)  # then the other kind may not meet it
            self._engine.forget(self)

    def _leave_gate(self) -> None:
        """Count this request out of the engine's KindGate, once, if it was let in."""
        if self._gated is not None:
            self._engine.gate.leave(self._gated)
            self._gated = None

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        from vllm.inputs import TokensPrompt

        start = time.perf_counter_ns()
        request: Any = TokensPrompt(prompt_token_ids=self._prompt)
        if self._engine.info.transcriber:  # the clip to the encoder, the prompt to the decoder
            request = encoder_decoder_prompt(self._prompt, self._images)
        elif self._images:  # vLLM's processor expands each image's or clip's placeholder into its tokens
            request["multi_modal_data"] = multi_modal_data(self._images)
        kind = gate_kind(self._params)
        try:  # a consumer cancelled while the request waits for the gate is forgotten too (it held a queue place)
            if kind is not None and not self._aborted:  # scoring and top-logprobs requests never share a step
                await self._engine.gate.enter(kind)
                self._gated = kind
                if self._aborted:  # while it waited
                    self._leave_gate()
            if not self._aborted and self.failure is None:
                async with contextlib.aclosing(self._generate(request, start)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
        finally:
            self._leave_gate()
            self._engine.forget(self)
        if not self._aborted or self.failure is not None:
            yield Chunk(error=self.failure or "the request ended early", finish_reason="error",
                        usage=Usage(len(self._prompt), len(self._output)))

    async def _generate(self, request: Any, start: int) -> AsyncGenerator[Chunk, None]:
        """vLLM's deltas of the request as chunks, up to the final one; nothing more when it fails (`failure`)."""
        first = 0
        outputs = self._engine.llm.generate(request, self._params, request_id=self.request_id,
                                            priority=self._priority, lora_request=self._lora)
        try:
            async for out in outputs:
                self._engine.count_output()
                completion = out.outputs[0]
                self._output.extend(completion.token_ids)
                self._prompt_length = len(out.prompt_token_ids or self._prompt)
                first = first or time.perf_counter_ns()
                if self.failure is not None:
                    break
                if self._prompt_logprobs is not None and out.prompt_logprobs is not None:
                    entries = self._prompt_logprobs.prompt(list(out.prompt_token_ids or self._prompt),
                                                           list(out.prompt_logprobs))
                    self._prompt_logprobs = None
                    yield Chunk(prompt_logprobs=entries)
                if out.finished:
                    end = time.perf_counter_ns()
                    usage = Usage(self._prompt_length, len(self._output), int(out.num_cached_tokens or 0))
                    self._engine.count_prompt(usage.cached_tokens)
                    timings = Timings(prompt_eval_ns=first - start, eval_ns=end - first, total_ns=end - start)
                    reason = _FINISH.get(str(completion.finish_reason), "stop")
                    yield Chunk(text=completion.text, finish_reason=reason, usage=usage, timings=timings,
                                logprobs=self._logprobs_of(completion, finished=True), scores=self._scores(completion))
                    return
                logprobs = self._logprobs_of(completion, finished=False)
                if completion.text or logprobs:
                    yield Chunk(text=completion.text, logprobs=logprobs)
        except Exception as exc:  # the engine died, or rejected the request after it was queued
            stopped = self._engine.failure
            self.failure = self.failure or (f"the engine stopped: {stopped}" if stopped else engine_error(exc))
        finally:
            await outputs.aclose()
