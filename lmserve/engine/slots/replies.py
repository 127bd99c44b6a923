"""A sequence's reply, token by token: the text each sampled token adds (detokenized, stop strings matched), its
log-probabilities, and the final chunk with usage and timings. Called on the engine thread for every sampled token
(engine/slots/batching.py `_take`).
"""

from __future__ import annotations

from lmserve.engine.logprobs import LogprobAligner, token_logprob
from lmserve.engine.slots.backend import Backend
from lmserve.engine.slots.bridge import Outbox, Tracker
from lmserve.engine.slots.sequence import Sequence
from lmserve.types import Chunk, FinishReason, Timings, TokenLogprob, Usage


def accept(backend: Backend, seq: Sequence, tracker: Tracker, token: int, outbox: Outbox) -> FinishReason | None:
    """Take one sampled token: emit its text and say whether the sequence is finished. An end-of-generation
    token has no text; a scored prompt (echo with logprobs) still gets its logprob, as vLLM gives it:
    lm-evaluation-harness reads the reply's token as the last entry, the prompt's before it."""
    if backend.is_eog(token) and not seq.sampling.ignore_eos:
        if seq.sampling.prompt_logprobs is not None and (end := _logprobs(backend, seq, tracker, 0, 0, False)):
            outbox.append((tracker.stream, Chunk(text="", logprobs=end)))  # a scored prompt's one reply token
        return "stop"
    seq.output.append(token)
    piece = backend.token_bytes(token, special=seq.special)
    decoded = tracker.decoder.push(piece)
    text, is_stopped = tracker.stops.push(decoded)
    logprobs = _logprobs(backend, seq, tracker, len(decoded), len(text), is_stopped)
    if text or logprobs:
        outbox.append((tracker.stream, Chunk(text=text, logprobs=logprobs)))
    if is_stopped:
        tracker.is_stop_hit = True
        return "stop"
    if len(seq.output) >= seq.max_new_tokens:
        return "length"
    return None

def _logprobs(backend: Backend, seq: Sequence, tracker: Tracker, num_decoded: int, num_emitted: int,
              is_stopped: bool) -> list[TokenLogprob]:
    """Place the token just sampled (its text `num_decoded` characters, `num_emitted` characters out now) and
    return the logprobs whose text is out; a stop string ends the reply (see engine/logprobs.py)."""
    if seq.sampling.logprobs is None:
        return []
    ranked = backend.take_logprobs(seq.slot)
    if tracker.logprobs is None:
        tracker.logprobs = LogprobAligner()
    if ranked is not None:
        logprob = token_logprob(ranked, lambda token: backend.token_bytes(token, special=seq.special))
        tracker.logprobs.add(logprob, num_decoded, unfinished=tracker.decoder.is_holding)
    return tracker.logprobs.finish(num_emitted) if is_stopped else tracker.logprobs.emit(num_emitted)

def final_chunk(seq: Sequence, tracker: Tracker, finish: FinishReason, now: int) -> Chunk:
    """The last chunk of a finished sequence: the text held back, its usage and timings."""
    tail = ""
    if not tracker.is_stop_hit:
        tail = tracker.stops.push(tracker.decoder.flush())[0] + tracker.stops.flush()
    logprobs = tracker.logprobs.finish(len(tail)) if tracker.logprobs is not None else []
    usage = Usage(prompt_tokens=len(seq.prompt), completion_tokens=len(seq.output), cached_tokens=seq.num_cached,
                  draft_tokens=tracker.num_drafted, draft_accepted_tokens=tracker.num_accepted)
    first = tracker.first_token_ns or now
    timings = Timings(
        prompt_eval_ns=first - tracker.admitted_ns,
        eval_ns=now - first,
        total_ns=now - tracker.submitted_ns,
    )
    return Chunk(text=tail, finish_reason=finish, usage=usage, timings=timings, logprobs=logprobs,
                 scores=tracker.scores)


def prompt_logprobs(backend: Backend, seq: Sequence) -> Chunk:
    """A chunk carrying the prompt's log-probabilities (the prompt's tokens with their special text)."""
    ranked = backend.take_prompt_logprobs(seq.slot) or []
    piece = lambda token: backend.token_bytes(token, special=True)  # noqa: E731
    return Chunk(prompt_logprobs=[token_logprob(entry, piece) for entry in ranked])
