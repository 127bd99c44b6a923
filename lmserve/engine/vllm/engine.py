"""The vLLM engine: a hub repository (config.json + safetensors) served by vLLM's async engine, in this process.

`VllmEngine` implements the engine seam (engine/protocol.py) over `vllm.v1.engine.async_llm.AsyncLLM`: vLLM runs
its engine core (scheduler, model runner, workers for tensor/pipeline parallelism) in child processes and streams
`RequestOutput` deltas back (engine/vllm/stream.py); lmserve's token prompts and `SamplingParams` become vLLM's
(engine/vllm/sampling.py) and its outputs `Chunk`s. Templates, tool-call parsing, options precedence and the HTTP
dialects stay above the seam, shared with llama.cpp. Every launch option maps to vLLM's names in
engine/vllm/args.py. A cross-encoder repository is a dedicated reranker instead (engine/vllm/rerank.py): vLLM's
pooling runner, `rank` only. Scoring requests (`score_tokens`) and top-logprobs requests take turns in vLLM
(engine/vllm/gate.py).

vLLM is imported only when a model is opened: the llama.cpp path never pays for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from lmserve.engine.context_size import ContextChoice
from lmserve.engine.fim import find_by_text
from lmserve.engine.lifeline import LIFELINE
from lmserve.engine.memory_estimate import meminfo_available as available_memory
from lmserve.engine.pieces import piece_bytes
from lmserve.engine.protocol import (
    EngineStats,
    ModelInfo,
    PromptImage,
    check_choices,
    check_score_tokens,
    choice_sampling,
)
from lmserve.engine.vllm.args import VllmOptions, engine_args
from lmserve.engine.vllm.errors import config_error, engine_death, engine_error
from lmserve.engine.vllm.gate import KindGate
from lmserve.engine.vllm.lora import VllmLoras
from lmserve.engine.vllm.memory import context_choice, held_bytes, kv_cache_bytes
from lmserve.engine.vllm.rerank import RankPair, is_reranker, pair_tokens, score_template
from lmserve.engine.vllm.sampling import check_grammar, to_vllm_sampling
from lmserve.engine.vllm.stats import CACHE_TIER, stat_logger
from lmserve.engine.vllm.stream import VllmStream, request_id
from lmserve.engine.vllm.vision import (
    audio_marker,
    find_all,
    image_marker,
    media_handle,
    sample_rate,
    transcribes,
    vision_support_missing,
)
from lmserve.engine.vllm.weights_check import check_weights
from lmserve.engine.vllm.workers import environment, worker_environment
from lmserve.errors import ContextOverflow, EngineFailure, EngineStopped, InvalidRequest, Overloaded
from lmserve.types import Adapter, Clip, Media, SamplingParams


class VllmEngine:
    """A repository loaded into vLLM. Blocking to construct (the engine core starts: seconds)."""

    def __init__(self, path: Path, options: VllmOptions) -> None:
        config = json.loads((path / "config.json").read_text())
        missing = vision_support_missing(config)
        if missing is not None:
            raise InvalidRequest(f"vLLM cannot serve this vision-language model here: {missing}", param="model")
        check_weights(path, config)
        self._stats = EngineStats()
        self.loras = VllmLoras(path, enabled=options.enable_lora, max_loras=options.max_loras,
                               max_rank=options.max_lora_rank)
        self.llm, choice = start_vllm(path, options, config, self._stats)
        self._failure: str | None = None
        self._tokenizer = self.llm.get_tokenizer()
        self.llm_tokenizer: Any = self._tokenizer
        """vLLM's (Hugging Face) tokenizer, for the streams' logprobs."""
        self._max_queue = options.max_queue
        self._streams: dict[str, VllmStream] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.gate = KindGate()
        """Keeps scoring and top-logprobs requests out of each other's steps (engine/vllm/gate.py)."""
        model_config = self.llm.model_config
        self.info = model_info(path, options, config, model_config, self._tokenizer, trained=choice.trained)
        self._score_template = score_template(model_config) if self.info.can_rank else None
        cache_config = self.llm.vllm_config.cache_config
        self._stats.kv_block_size = int(cache_config.block_size or 0)
        self._stats.kv_num_blocks = int(cache_config.num_gpu_blocks or 0)
        self._stats.weights_bytes, self._stats.kv_bytes = held_bytes(path, config, model_config.dtype, self._stats)
        self._bos_id = getattr(self._tokenizer, "bos_token_id", None)
        marker, audio = self.info.image_marker, self.info.audio_marker
        self._marker_ids = self.tokenize(marker, add_special=False) if marker else []
        self._audio_ids = self.tokenize(audio, add_special=False) if audio else []

    # ---- the engine seam --------------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        tokens = list(self._tokenizer.encode(text, add_special_tokens=add_special))
        if len(tokens) >= 2 and tokens[0] == tokens[1] == self._bos_id:
            tokens = tokens[1:]  # the template wrote BOS and the tokenizer added another
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))

    def token_bytes(self, token: int) -> bytes:
        return piece_bytes(str(self._tokenizer.convert_ids_to_tokens([token])[0]))

    def tokenize_media(self, text: str, media: list[Media]) -> tuple[list[int], list[PromptImage]]:
        """The text's tokens, each image's or clip's marker kept as is (vLLM's processor expands it when the request
        runs); each handle is what vLLM's processor takes (`media_handle`)."""
        kinds = ["audio" if isinstance(item, Clip) else "image" for item in media]
        if self.info.transcriber:  # its decoder's prompt; the one clip goes to its encoder
            if kinds != ["audio"]:
                raise InvalidRequest("a speech-to-text model takes one audio clip and no images", param="messages")
            return self.tokenize(text, add_special=False), [PromptImage(0, 0, media_handle(media[0]))]
        for kind, marker in (("image", self.info.image_marker), ("audio", self.info.audio_marker)):
            if kind in kinds and marker is None:
                raise InvalidRequest(f"this model takes no {kind} input on the vLLM engine",
                                     param="images" if kind == "image" else "messages")
        tokens = self.tokenize(text)
        spans = sorted([(start, "image") for start in find_all(tokens, self._marker_ids)]
                       + [(start, "audio") for start in find_all(tokens, self._audio_ids)])
        if [kind for _, kind in spans] != kinds:
            raise InvalidRequest("the prompt's media markers do not match its images and clips", param="messages")
        lengths = {"image": len(self._marker_ids), "audio": len(self._audio_ids)}
        return tokens, [PromptImage(start, lengths[kind], media_handle(item))
                        for (start, kind), item in zip(spans, media, strict=True)]

    def submit(
        self, prompt: list[int], sampling: SamplingParams, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> VllmStream:
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        self._check_request(prompt, sampling)
        lora = self.loras.request(sampling.adapters)
        kwargs = to_vllm_sampling(sampling, special=special, room=self.info.num_ctx - len(prompt))
        if sampling.grammar is not None:
            if sampling.ignore_eos:
                raise InvalidRequest("ignore_eos cannot be combined with structured output", param="ignore_eos")
            check_grammar(sampling.grammar)
            kwargs["structured_outputs"] = StructuredOutputsParams(grammar=sampling.grammar)
        if self.failure is not None:
            raise EngineStopped(f"the engine stopped: {self.failure}")
        if len(self._streams) >= self.info.num_parallel + self._max_queue:
            raise Overloaded(f"{self._max_queue} requests are already waiting for this model; retry shortly")
        try:
            params = VllmSampling(output_kind=RequestOutputKind.DELTA, **kwargs)
        except ValueError as exc:
            raise InvalidRequest(f"invalid sampling options: {exc}") from None
        if self.info.transcriber and not images:
            raise InvalidRequest("model is a speech-to-text model: it answers /v1/audio/transcriptions and "
                                 "/v1/audio/translations", param="model")
        if images and self.info.image_marker is None and self.info.audio_marker is None and not self.info.transcriber:
            raise InvalidRequest("this model takes no images or audio on the vLLM engine", param="images")
        stream = VllmStream(self, list(prompt), params, [image.handle for image in images or []],
                            priority=sampling.priority, lora=lora)
        self._streams[stream.request_id] = stream
        return stream

    def _check_request(self, prompt: list[int], sampling: SamplingParams) -> None:
        """InvalidRequest (ContextOverflow) for a prompt or sampling this model cannot take."""
        if self.info.can_rank:
            raise InvalidRequest("model is a reranker: it scores documents against a query (rerank) and generates "
                                 "no text", param="model")
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt) >= self.info.num_ctx:
            raise ContextOverflow(len(prompt), self.info.num_ctx, self.info.num_ctx_train)
        if any(not 0 <= token < self.info.num_vocab for token in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.info.num_vocab}) for this model",
                                 param="prompt")
        if any(not 0 <= token < self.info.num_vocab for token in sampling.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {self.info.num_vocab}) for this model",
                                 param="logit_bias")
        check_score_tokens(sampling, self.info.num_vocab)

    def submit_many(
        self, prompt: list[int], sampling: SamplingParams, n: int, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> list[VllmStream]:
        """`n` choices of one prompt: n requests, choice i sampling with `choice_sampling(sampling, i)`.

        This is what vLLM's own `SamplingParams(n=...)` does inside (its parent request fans out into n child
        requests, seeded seed + index), with lmserve's stream per choice; the prompt's blocks are shared by vLLM's
        prefix cache.
        """
        capacity = self.info.num_parallel + self._max_queue
        check_choices(n, self.info, self._max_queue)
        if len(self._streams) + n > capacity:
            raise Overloaded(f"{len(self._streams)} sequences are already running or waiting for this model; "
                             "retry shortly")
        return [self.submit(prompt, choice_sampling(sampling, i), special=special, images=images,
                            checkpoints=checkpoints) for i in range(n)]

    def embedding_tokens(self, text: str, *, truncate: bool = True) -> list[int]:
        raise InvalidRequest("embeddings are not available on the vLLM engine for this model; serve a GGUF with "
                             "llama.cpp for /api/embed and /v1/embeddings", param="model")

    async def embed_tokens(self, prompts: list[list[int]], *, normalize: bool = True,
                           adapters: tuple[Adapter, ...] = ()) -> list[list[float]]:
        raise InvalidRequest("embeddings are not available on the vLLM engine for this model", param="model")

    async def rank(self, query: str, documents: list[str], *, truncate: bool = True) -> list[float]:
        """A cross-encoder's relevance logit of each document to `query` (engine/vllm/rerank.py): one request of
        vLLM's classify task per pair, without vLLM's sigmoid; at most `num_parallel` + the queue's length in vLLM
        at once. A pair longer than the context has its document cut when `truncate`, else it is a ContextOverflow."""
        if not self.info.can_rank:
            raise InvalidRequest("this model is not a dedicated reranker; it reranks by judging relevance",
                                 param="model")
        pairs = [self.rank_pair(query, document, truncate=truncate) for document in documents]
        if self.failure is not None:
            raise EngineStopped(f"the engine stopped: {self.failure}")
        window = asyncio.Semaphore(self.info.num_parallel + self._max_queue)

        async def scored(pair: RankPair) -> float:
            async with window:
                return await self._classify(pair)

        tasks = [asyncio.ensure_future(scored(pair)) for pair in pairs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def rank_pair(self, query: str, document: str, *, truncate: bool = True) -> RankPair:
        """The (query, document) pair as this reranker reads it, fitted to its context (see `rank`)."""
        score_template = self._score_template(query, document) if self._score_template is not None else None
        return pair_tokens(self._tokenizer, query, document, limit=self.info.num_ctx, truncate=truncate,
                           trained=self.info.num_ctx_train, score_template=score_template,
                           use_sep_token=bool(self.llm.model_config.use_sep_token))

    async def _classify(self, pair: RankPair) -> float:
        """The reranker's head on one pair: its raw value (vLLM's `use_activation=False`: no sigmoid)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        params = PoolingParams(task="classify", use_activation=False)
        if pair.second_from is not None:
            params.extra_kwargs = {"compressed_token_type_ids": pair.second_from}
        rank_id = request_id("rank-")
        value: float | None = None
        outputs = self.llm.encode(TokensPrompt(prompt_token_ids=pair.tokens), params, request_id=rank_id)
        try:
            async for out in outputs:
                if out.finished:
                    value = float(out.outputs.data.reshape(-1)[0])
        except Exception as exc:  # the engine died, or refused the request
            stopped = self.failure
            if stopped is not None:
                raise EngineStopped(f"the engine stopped: {stopped}") from exc
            raise EngineFailure(engine_error(exc)) from exc
        finally:
            await outputs.aclose()
        if value is None:
            raise EngineFailure("vLLM's reranker returned no score")
        return value

    def fail_all(self, message: str) -> None:
        for stream in list(self._streams.values()):
            stream.failure = message
            self.abort(stream.request_id)

    @property
    def failure(self) -> str | None:
        """Why vLLM's engine can no longer answer (its engine core process died, its output handler failed), or None
        while it works. vLLM itself then fails every request in flight with EngineDeadError."""
        if self._failure is None and self.llm.errored:
            self._failure = engine_death(self.llm)
        return self._failure

    @property
    def num_running(self) -> int:
        return min(len(self._streams), self.info.num_parallel)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._streams) - self.info.num_parallel)

    @property
    def stats(self) -> EngineStats:
        self._stats.adapter_bytes, self._stats.max_adapters = self.loras.num_bytes, self.loras.max_loras
        return self._stats

    def count_output(self) -> None:
        """Count one of vLLM's outputs (a request's delta): the progress the decode health check watches."""
        self._stats.progress += 1

    def count_prompt(self, cached_tokens: int) -> None:
        """Count a finished request's prompt in the prompt-cache stats: a hit when vLLM's prefix cache held some
        of it (`cached_tokens`: the tokens it skipped), else a miss."""
        if cached_tokens > 0:
            self._stats.cache_hits[CACHE_TIER] = self._stats.cache_hits.get(CACHE_TIER, 0) + 1
            self._stats.cache_tokens[CACHE_TIER] = self._stats.cache_tokens.get(CACHE_TIER, 0) + cached_tokens
        else:
            self._stats.cache_misses += 1

    async def sleep(self) -> None:
        """vLLM frees its KV cache alone only in its own sleep mode (CUDA GPUs), which lmserve does not start yet."""
        raise InvalidRequest("vLLM frees its KV cache while keeping the weights only in its CUDA sleep mode, which "
                             "lmserve does not start; sleep this model at level 2 (its engine closes, and opens "
                             "again for the next request)", param="level")

    async def wake_up(self) -> None:
        """Nothing sleeps at level 1 here (`sleep`)."""

    def close(self) -> None:
        """Stop vLLM's engine core and workers (child processes). Called on the event loop (an unload), it returns
        at once and a thread waits for them (seconds); elsewhere (the server's exit) it waits itself."""
        self.fail_all("the model was unloaded")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._shut_down()
        else:
            threading.Thread(target=self._shut_down, name="lmserve-vllm-shutdown").start()

    def _shut_down(self) -> None:
        self.llm.shutdown()

    # ---- for streams ------------------------------------------------------------------------------------------

    def abort(self, request_id: str, then: Callable[[], None] | None = None) -> None:
        """Abort a request in vLLM (from the event loop; fire and forget), calling `then` once the abort is sent
        to vLLM's engine core (ahead of any request added later), or at once off the event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if then is not None:
                then()
            return
        task = loop.create_task(self.llm.abort(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if then is not None:
            task.add_done_callback(lambda _: then())

    def forget(self, stream: VllmStream) -> None:
        self._streams.pop(stream.request_id, None)


def start_vllm(path: Path, options: VllmOptions, config: dict[str, Any],
               stats: EngineStats) -> tuple[Any, ContextChoice]:
    """vLLM's AsyncLLM serving the repository at `path` (config.json is `config`), and the context chosen for it;
    `stats` is kept current by vLLM's scheduler. Blocking (the engine core starts). InvalidRequest for what vLLM's
    configuration refuses, EngineFailure when its engine fails while loading."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    try:
        choice = context_choice(path, options, config)
    except ValueError as exc:  # vLLM's config checks (pydantic's ValidationError is a ValueError)
        raise InvalidRequest(f"vLLM cannot serve it this way: {config_error(exc)}") from exc
    options = replace(options, num_ctx=choice.num_ctx)
    sized_by_user = "VLLM_CPU_KVCACHE_SPACE" in os.environ
    kv_bytes = kv_cache_bytes(config, options, available_memory()) if options.is_cpu and not sized_by_user else None
    with environment(worker_environment(options)), LIFELINE.watching():  # none left behind, loaded or not
        try:
            arguments = AsyncEngineArgs(**engine_args(path, options, kv_bytes=kv_bytes, config=config))
            return AsyncLLM.from_engine_args(arguments, stat_loggers=[stat_logger(stats)]), choice
        except ValueError as exc:  # vLLM's config checks (pydantic's ValidationError is a ValueError)
            raise InvalidRequest(f"vLLM cannot serve it this way: {config_error(exc)}") from exc
        except Exception as exc:  # its engine core died or failed while loading (the log has vLLM's reasons)
            raise EngineFailure(f"vLLM's engine failed while loading (the server's log has vLLM's account): "
                                f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc


def model_info(path: Path, options: VllmOptions, config: dict[str, Any], model_config: Any, tokenizer: Any, *,
               trained: int) -> ModelInfo:
    """What the engine seam says of the repository at `path` as vLLM loaded it (`model_config`, `tokenizer`)."""
    reranker = is_reranker(config)
    hears = transcribes(model_config)
    return ModelInfo(
        path=str(path),
        architecture=str(config.get("model_type", "")),
        num_ctx=int(model_config.max_model_len),
        num_parallel=options.num_parallel,
        num_vocab=int(model_config.get_vocab_size()),
        num_ctx_train=trained,
        chat_template=getattr(tokenizer, "chat_template", None),
        bos_token=str(getattr(tokenizer, "bos_token", None) or ""),
        eos_token=str(getattr(tokenizer, "eos_token", None) or ""),
        size_bytes=sum(p.stat().st_size for p in path.glob("*.safetensors")),
        description=f"vLLM {options.dtype} {config.get('torch_dtype') or config.get('dtype') or ''}".strip(),
        engine="vllm",
        can_embed=False,
        can_constrain=not reranker,
        image_marker=None if reranker else image_marker(model_config),
        audio_marker=None if reranker else audio_marker(model_config),
        audio_rate=sample_rate(path) if not reranker and (audio_marker(model_config) or hears) else 0,
        transcriber=hears,
        fim=None if reranker else find_by_text(tokenizer.get_vocab()),
        can_rank=reranker,
    )
