"""The MLX backend of the slot engine (engine/slots/batching.py): a Hugging Face or MLX-format repository loaded by
mlx-lm, one cache per slot, decoded in batches on MLX (Apple's GPU through Metal; MLX's CPU build elsewhere).

How a step runs (`step`): a slot that prefills (several tokens, or verifies a draft) runs alone on its own cache;
the slots that decode one token each run together as one batch. The batch's caches are mlx-lm's batch caches
(keys and values left-padded to the longest slot; a convolution's state row by row). They persist from step to
step: a slot joins the batch when it starts decoding (its cache merged in) and leaves it when anything else
touches it (its cache extracted), so a steady batch of decoding slots costs no copies. Sampling, grammars and
log-probabilities are engine/mlx/sampling.py's, in numpy, over each row's logits.

Memory a slot keeps between requests is its prefix cache: attention caches are cut at any position; a model with
convolution or recurrent state cannot be cut (`can_cut_memory` False) and reuses only whole states, as llama.cpp's
hybrids do. `save_state` writes a slot's caches as bytes (engine/mlx/states.py) for the prompt cache's RAM and
disk tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from lmserve.engine.fim import find_by_text
from lmserve.engine.logprobs import Ranked
from lmserve.engine.mlx import AUDIO_MISSING, VISION_MISSING
from lmserve.engine.mlx.grammar import Grammars
from lmserve.engine.mlx.loading import (
    device_name,
    dtype_name,
    load_model,
    num_params,
    probe_model,
    stored_as,
)
from lmserve.engine.mlx.memory import Caches, context_choice, weights_bytes
from lmserve.engine.mlx.options import MlxLaunch
from lmserve.engine.mlx.runtime import import_mlx
from lmserve.engine.mlx.sampling import Sampler
from lmserve.engine.mlx.states import copy_caches, cut_caches, read_caches, write_caches
from lmserve.engine.pieces import piece_bytes
from lmserve.engine.prompt_logprobs import PromptLogprobs
from lmserve.engine.protocol import ModelInfo, PromptImage
from lmserve.engine.slots.backend import BatchEntry
from lmserve.engine.slots.prompt_disk import SavedState
from lmserve.errors import EngineFailure, InvalidRequest
from lmserve.types import Adapter, LoadOptions, Media, SamplingParams

log = logging.getLogger("lmserve.engine.mlx")

F = TypeVar("F", bound=Callable[..., Any])


def computing(method: F) -> F:
    """Run a method on the backend's MLX stream (MLX has no default stream in a thread it did not start)."""

    @wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._mx.stream(self._stream):
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class MlxBackend:
    """A model loaded by mlx-lm, decoding batches of slots (the slot engine's Backend)."""

    def __init__(self, path: str | Path, options: LoadOptions, launch: MlxLaunch | None = None,
                 adapter_limits: tuple[int, int] = (8, 0)) -> None:
        launch = launch or MlxLaunch()
        self._mx = mx = import_mlx(launch.mlx_device, options.num_threads)
        from mlx.utils import tree_flatten
        from mlx_lm.models.cache import make_prompt_cache

        from lmserve.engine.mlx.adapters import AdapterPool  # MLX imported first, as import_mlx sets it up

        path = Path(path)
        model, tokenizer, config, dtype = load_model(mx, path, launch.mlx_dtype)
        self._model = model
        self._weights_bytes = sum(int(array.nbytes) for _, array in tree_flatten(model.parameters()))
        self.on_gpu: bool = mx.default_device() == mx.gpu
        self._stream = mx.new_thread_local_stream(mx.default_device())
        """MLX's streams belong to threads: every thread computes on its own of this one (`computing`)."""
        with mx.stream(self._stream):
            probe_model(mx, model, make_prompt_cache, path.name, config)
        self._make_cache: Callable[[], Caches] = lambda: make_prompt_cache(model)
        self._hf = tokenizer._tokenizer
        self._end_tokens = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._specials = frozenset(int(t) for t in self._hf.all_special_ids) | frozenset(
            int(i) for i, added in self._hf.added_tokens_decoder.items() if added.special)
        self.info = self._model_info(path, options, config, dtype or mx.float32)
        self.adapters = AdapterPool(model, path, dtype or mx.float32, max_loaded=adapter_limits[0],
                                    max_rank=adapter_limits[1])
        self._grammars = Grammars(self._hf, self.info.num_vocab, self._end_tokens)
        self._caches: list[Caches | None] = [self._make_cache() for _ in range(options.num_parallel)]
        """Each slot's caches; None while the slot is a row of the decoding batch."""
        self._batch: Caches | None = None
        self._batch_slots: list[int] = []
        self._samplers: dict[int, Sampler] = {}
        self._last_rows: dict[int, np.ndarray] = {}
        """Each slot's last row of logits (what `fork` samples the copies' first tokens from)."""
        self._drafted: dict[int, list[int]] = {}
        self._bos_id = self._hf.bos_token_id
        self._prompt_scoring: dict[int, PromptLogprobs] = {}
        """Slots prefilling a prompt whose log-probabilities were asked for (engine/prompt_logprobs.py)."""
        self._prompt_ranked: dict[int, list[Ranked]] = {}

    def _model_info(self, path: Path, options: LoadOptions, config: dict[str, Any], dtype: Any) -> ModelInfo:
        """What the engine seam says of the loaded model; its context chosen for `options` (computing in `dtype`)."""
        mx, model, hf = self._mx, self._model, self._hf
        text_config = config.get("text_config") or config
        caches = self._make_cache()
        choice = context_choice(path, options.num_ctx, options.num_parallel, text_config, caches, dtype)
        return ModelInfo(
            path=str(path), architecture=str(text_config.get("model_type") or config.get("model_type", "")),
            num_ctx=choice.num_ctx, num_parallel=options.num_parallel,
            num_vocab=int(text_config.get("vocab_size") or len(hf)), num_ctx_train=choice.trained,
            chat_template=getattr(hf, "chat_template", None), bos_token=str(hf.bos_token or ""),
            eos_token=str(hf.eos_token or ""), size_bytes=weights_bytes(path), num_params=num_params(model),
            description=f"MLX {dtype_name(model)} ({device_name(mx)}) {stored_as(config)}",
            can_cut_memory=all(cache.is_trimmable() for cache in caches), engine="mlx",
            can_embed=hasattr(model, "model"), can_constrain=True, fim=find_by_text(hf.get_vocab()),
            audio_missing=AUDIO_MISSING,
        )

    # ---- tokens ------------------------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        tokens = [int(t) for t in self._hf.encode(text, add_special_tokens=add_special,
                                                  split_special_tokens=not parse_special)]
        if len(tokens) >= 2 and tokens[0] == tokens[1] == self._bos_id:
            tokens = tokens[1:]  # the template wrote BOS and the tokenizer added another
        return tokens

    def tokenize_media(self, text: str, media: list[Media]) -> tuple[list[int], list[PromptImage]]:
        raise InvalidRequest(VISION_MISSING, param="images")

    def token_bytes(self, token: int, *, special: bool) -> bytes:
        if token < 0 or (not special and token in self._specials):
            return b""
        piece = self._hf.convert_ids_to_tokens(token)
        return piece_bytes(piece) if isinstance(piece, str) else b""

    def is_eog(self, token: int) -> bool:
        return token in self._end_tokens

    def check_grammar(self, grammar: str) -> None:
        self._grammars.compile(grammar)

    def check_adapters(self, adapters: tuple[Adapter, ...]) -> None:
        self.adapters.check(adapters)

    @property
    def adapter_bytes(self) -> int:
        return self.adapters.num_bytes

    @property
    def max_adapters(self) -> int:
        return self.adapters.max_loaded

    @property
    def held_bytes(self) -> tuple[int, int]:
        """The weights' arrays and every slot's (and the batch's) caches, in bytes."""
        caches = [*(caches for caches in self._caches if caches), *([self._batch] if self._batch else [])]
        return self._weights_bytes, sum(int(array.nbytes) for caches in caches for array in _arrays(caches))

    # ---- slots -------------------------------------------------------------------------------------------------

    @computing
    def start(self, slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int,
              generated: list[int] | None = None) -> int:
        caches = self._own(slot)
        if num_reused <= 0 or not cut_caches(caches, num_reused):
            self._caches[slot] = self._make_cache()
            num_reused = 0
        constraint = self._grammars.matcher(sampling.grammar) if sampling.grammar is not None else None
        self._samplers[slot] = Sampler(sampling, prompt, num_ctx=self.info.num_ctx, end_tokens=self._end_tokens,
                                       constraint=constraint)
        for token in generated or ():
            self._samplers[slot].accept(token)
        self._prompt_ranked.pop(slot, None)
        self._prompt_scoring.pop(slot, None)
        if sampling.prompt_logprobs is not None:
            self._prompt_scoring[slot] = PromptLogprobs(sampling.prompt_logprobs)
        return num_reused

    def release(self, slot: int) -> None:
        self._samplers.pop(slot, None)
        self._last_rows.pop(slot, None)
        self._prompt_scoring.pop(slot, None)
        self._prompt_ranked.pop(slot, None)

    def clear(self, slot: int) -> None:
        self._own(slot)
        self._caches[slot] = self._make_cache()

    @computing
    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        if not self.info.can_cut_memory:
            return False
        copy = copy_caches(self._own(source), self._make_cache)
        self._own(slot)
        if copy is None or not cut_caches(copy, length):
            self._caches[slot] = self._make_cache()
            return False
        self._caches[slot] = copy
        return True

    @computing
    def fork(self, source: int, slots: list[int]) -> list[int | None]:
        row = self._last_rows.get(source)
        if row is None:
            return [None] * len(slots)
        source_caches = self._own(source)
        tokens: list[int | None] = []
        for slot in slots:
            self._own(slot)
            copy = copy_caches(source_caches, self._make_cache)
            self._caches[slot] = copy if copy is not None else self._make_cache()
            tokens.append(self._samplers[slot].pick(row) if copy is not None else None)
        return tokens

    @computing
    def save_state(self, slot: int) -> SavedState | None:
        return write_caches(self._own(slot))

    @computing
    def restore_state(self, slot: int, state: SavedState, length: int) -> bool:
        self._own(slot)
        caches = read_caches(state, self._make_cache)
        if caches is None or not cut_caches(caches, length):
            self._caches[slot] = self._make_cache()
            return False
        self._caches[slot] = caches
        return True

    def take_drafted(self, slot: int) -> list[int]:
        return self._drafted.pop(slot, [])

    def draft(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        return {}  # no draft model: drafts come from the sequence's own context (engine/slots/drafting.py)

    def take_logprobs(self, slot: int) -> Ranked | None:
        sampler = self._samplers.get(slot)
        return sampler.last if sampler is not None and sampler.sampling.logprobs is not None else None

    def take_prompt_logprobs(self, slot: int) -> list[Ranked] | None:
        return self._prompt_ranked.pop(slot, None)

    def _score_prompt(self, slot: int, rows: np.ndarray, tokens: list[int], *, last: bool) -> None:
        """Rank a scored slot's prompt tokens by the logits after them (`rows`; see PromptLogprobs.add)."""
        scoring = self._prompt_scoring.get(slot)
        if scoring is None:
            return
        scoring.add(rows, tokens, last=last)
        if last:
            self._prompt_ranked[slot] = scoring.take()
            del self._prompt_scoring[slot]

    def take_scores(self, slot: int) -> list[float] | None:
        sampler = self._samplers.get(slot)
        return sampler.scores if sampler is not None else None

    # ---- decoding ----------------------------------------------------------------------------------------------

    @computing
    def step(self, entries: list[BatchEntry], adapters: tuple[Adapter, ...] = ()) -> list[int | None]:
        if any(entry.image is not None for entry in entries):
            raise EngineFailure("the MLX engine was given an image to decode")
        self.adapters.apply(adapters)
        out: dict[int, int | None] = {}
        for entry in entries:
            if entry.draft:
                out[id(entry)] = self._verify(entry, self._own(entry.slot))
        prompts = [entry for entry in entries if not entry.draft and len(entry.tokens) > 1]
        if prompts:  # all but a sampled prompt's last token: its last decodes with the batch, as in mlx-lm
            rows = self._prefill([(entry.slot, entry.tokens[:-1] if entry.wants_sample else entry.tokens)
                                  for entry in prompts])
            for entry in prompts:
                if entry.slot in rows:
                    self._score_prompt(entry.slot, rows[entry.slot], entry.tokens, last=entry.wants_sample)
        lasts = {id(entry): BatchEntry(entry.slot, entry.tokens[-1:], entry.pos + len(entry.tokens) - 1, True)
                 for entry in prompts if entry.wants_sample}
        decoding = [lasts.get(id(entry), entry) for entry in entries
                    if not entry.draft and (len(entry.tokens) == 1 or id(entry) in lasts)]
        sampled = dict(zip(map(id, decoding), self._run_batch(decoding), strict=True)) if decoding else {}
        for entry in entries:
            if not entry.draft:
                out[id(entry)] = sampled.get(id(lasts.get(id(entry), entry)))
        return [out[id(entry)] for entry in entries]

    def _prefill(self, prompts: list[tuple[int, list[int]]]) -> dict[int, np.ndarray]:
        """Run each slot's tokens into its caches, all slots as one batch: the slots' caches merged (left-padded to
        the longest held), the tokens right-padded to the longest and the padding rolled out after, as mlx-lm's
        batch generator prefills; each slot then gets its caches back. Returns the logits after each token of
        the slots whose prompt log-probabilities were asked for."""
        mx = self._mx
        own = [self._own(slot) for slot, _ in prompts]
        lengths = [len(tokens) for _, tokens in prompts]
        padding = [max(lengths) - length for length in lengths]
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*own, strict=True)]
        if any(padding):
            for cache in batch:
                cache.prepare(lengths=lengths, right_padding=padding)
        rows = [[*tokens, *[0] * pad] for (_, tokens), pad in zip(prompts, padding, strict=True)]
        logits = self._model(mx.array(rows, dtype=mx.int32), cache=batch)
        scored = {slot: np.array(logits[row, :length].astype(mx.float32))
                  for row, ((slot, _), length) in enumerate(zip(prompts, lengths, strict=True))
                  if slot in self._prompt_scoring}
        if any(padding):
            for cache in batch:
                cache.finalize()
        mx.eval(_arrays(batch))
        for row, (slot, _) in enumerate(prompts):
            self._caches[slot] = [cache.extract(row) for cache in batch]
        mx.eval([array for slot, _ in prompts for array in _arrays(self._caches[slot] or [])])
        return scored

    def _run_batch(self, entries: list[BatchEntry]) -> list[int | None]:
        """Decode one token for each entry's slot, all slots as one batch."""
        mx = self._mx
        rows = self._join([entry.slot for entry in entries])
        tokens = [0] * len(self._batch_slots)
        for entry, row in zip(entries, rows, strict=True):
            tokens[row] = entry.tokens[0]
        logits = self._model(mx.array(tokens, dtype=mx.int32)[:, None], cache=self._batch)[:, -1].astype(mx.float32)
        mx.eval([logits, *_arrays(self._batch or [])])
        table = np.array(logits)
        sampled: list[int | None] = []
        for entry, row in zip(entries, rows, strict=True):
            self._score_prompt(entry.slot, table[row][None], entry.tokens, last=entry.wants_sample)
            if not entry.wants_sample:
                sampled.append(None)
                continue
            self._last_rows[entry.slot] = table[row]
            sampled.append(self._samplers[entry.slot].pick(table[row]))
        return sampled

    def _verify(self, entry: BatchEntry, caches: Caches) -> int:
        """Decode the pending token and the draft after it; keep the drafted tokens the samples agree with."""
        mx = self._mx
        before = copy_caches(caches, self._make_cache) if not self.info.can_cut_memory else None
        logits = self._model(mx.array(entry.tokens, dtype=mx.int32)[None], cache=caches)[0]
        rows = logits[-(entry.draft + 1):].astype(mx.float32)
        mx.eval([rows, *_arrays(caches)])
        table = np.array(rows)
        sampler = self._samplers[entry.slot]
        drafted = entry.tokens[-entry.draft:]
        samples = [sampler.pick(table[0])]
        while len(samples) <= entry.draft and samples[-1] == drafted[len(samples) - 1]:
            samples.append(sampler.pick(table[len(samples)]))
        self._last_rows[entry.slot] = table[len(samples) - 1]
        rejected = entry.draft - (len(samples) - 1)
        if rejected:
            if before is None:
                cut_caches(caches, _length(caches) - rejected)
            else:  # convolution state cannot be cut: back to the state before, then the accepted tokens again
                restored = before
                if restored is None:
                    raise EngineFailure("the MLX engine could not keep a slot's state before a draft")
                kept = entry.tokens[: len(entry.tokens) - rejected]
                mx.eval([self._model(mx.array(kept, dtype=mx.int32)[None], cache=restored), *_arrays(restored)])
                self._caches[entry.slot] = restored
        self._drafted[entry.slot] = samples[1:]
        return samples[0]

    # ---- the batch ---------------------------------------------------------------------------------------------

    def _own(self, slot: int) -> Caches:
        """The slot's own caches, taking it out of the decoding batch if it is a row there."""
        if slot in self._batch_slots:
            self._leave([slot])
        caches = self._caches[slot]
        assert caches is not None
        return caches

    def _leave(self, slots: list[int]) -> None:
        """Take these slots' rows out of the batch: each gets its caches back."""
        assert self._batch is not None
        mx = self._mx
        for slot in slots:
            row = self._batch_slots.index(slot)
            self._caches[slot] = [cache.extract(row) for cache in self._batch]
            mx.eval([array for cache in self._caches[slot] or [] for array in _cache_arrays(cache)])
        kept = [row for row, slot in enumerate(self._batch_slots) if slot not in slots]
        if not kept:
            self._batch, self._batch_slots = None, []
            return
        index = mx.array(kept, dtype=mx.int32)
        for cache in self._batch:
            cache.filter(index)
        mx.eval(_arrays(self._batch))
        self._batch_slots = [self._batch_slots[row] for row in kept]

    def _join(self, slots: list[int]) -> list[int]:
        """Make the batch hold exactly these slots; each one's row."""
        leaving = [slot for slot in self._batch_slots if slot not in slots]
        if leaving:
            self._leave(leaving)
        joining = [slot for slot in slots if slot not in self._batch_slots]
        if joining:
            own = [self._caches[slot] for slot in joining]
            merged = [type(layer[0]).merge(list(layer)) for layer in zip(*own, strict=True)]
            if self._batch is None:
                self._batch = merged
            else:
                for cache, more in zip(self._batch, merged, strict=True):
                    cache.extend(more)
            self._batch_slots += joining
            self._mx.eval(_arrays(self._batch))
            for slot in joining:
                self._caches[slot] = None
        return [self._batch_slots.index(slot) for slot in slots]

    # ---- embeddings and closing --------------------------------------------------------------------------------

    @computing
    def embed(self, tokens: list[int], adapters: tuple[Adapter, ...] = ()) -> list[float]:
        self.adapters.apply(adapters)
        mx = self._mx
        if not self.info.can_embed:
            raise InvalidRequest("this model cannot embed on the MLX engine", param="model")
        hidden = self._model.model(mx.array(tokens, dtype=mx.int32)[None])
        return [float(x) for x in np.array(hidden[0].astype(mx.float32).mean(axis=0))]

    def rank_tokens(self, query: str, document: str, limit: int | None) -> list[int]:
        """MLX serves no dedicated rerankers: always InvalidRequest."""
        raise InvalidRequest("the MLX engine serves no dedicated rerankers", param="model")

    def rank(self, pairs: list[list[int]]) -> list[float]:
        """MLX serves no dedicated rerankers: always InvalidRequest."""
        raise InvalidRequest("the MLX engine serves no dedicated rerankers", param="model")

    def free_memory(self) -> None:
        """Every slot's caches and the decoding batch dropped, MLX's buffer cache emptied; the weights stay."""
        self._batch, self._batch_slots = None, []
        self._caches = [self._make_cache() for _ in self._caches]
        self._samplers.clear()
        self._last_rows.clear()
        self._mx.clear_cache()

    def restore_memory(self) -> None:
        """Nothing to make again: the caches grow as prompts come."""

    def close(self) -> None:
        self._batch, self._batch_slots = None, []
        self._caches = []
        self._samplers.clear()
        self._last_rows.clear()
        del self._model
        self._mx.clear_cache()


def _length(caches: Caches | None) -> int:
    """Positions a slot's caches hold (0 when it holds none)."""
    if caches is None:
        return 0
    sizes = [cache.size() for cache in caches if cache.is_trimmable()]
    if sizes:
        return int(max(sizes))
    return 0 if all(cache.empty() for cache in caches) else -1


def _arrays(caches: Caches) -> list[Any]:
    return [array for cache in caches for array in _cache_arrays(cache)]


def _cache_arrays(cache: Any) -> list[Any]:
    state = cache.state
    items = state if isinstance(state, list | tuple) else [state]
    out: list[Any] = []
    for item in items:
        if isinstance(item, list | tuple):
            out += [x for x in item if hasattr(x, "shape")]
        elif hasattr(item, "shape"):
            out.append(item)
    return out
