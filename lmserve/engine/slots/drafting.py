"""Draft tokens for speculative decoding, looked up in the sequence's own context (prompt lookup, no second model).

A reply often repeats its context: a rewritten text, an extracted field, code that reuses names. `NgramDrafter`
keeps, for each n-gram of 3 or 4 tokens of the prompt and the output so far, where it last occurred; the draft is
what followed the latest earlier occurrence of the sequence's last n tokens (longest n first), no longer than the
match behind it (`matched_since`: a 4-token match drafts 1 token, a reply copying its context for 19 tokens the
whole cap of 16). The engine decodes the draft with the sequence's pending token in one step and keeps the longest
prefix the model agrees with (engine/slots/batching.py), so a draft costs one wider step, and the output is plain
decoding's wherever llama.cpp computes a wide step's rows as it computes one token (docs/serving.md: not always on
long contexts, where the last bits can differ).

The draft length adapts per sequence (`DraftLength`, which paces a draft model's drafts too): it doubles (up to
the cap) after a draft is accepted whole, and shrinks to one more than what was accepted after a miss. A draft
rejected from its first token pauses drafting for a number of steps that doubles with each such miss (up to
MAX_PAUSE) and resets when a draft is accepted again: a wider step costs more than a plain one on a CPU, so a reply
that does not repeat its context (free writing) drafts rarely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmserve.engine.slots.backend import Backend
    from lmserve.engine.slots.bridge import Tracker
    from lmserve.engine.slots.sequence import Sequence

NGRAM_SIZES = (4, 3)
"""The n-gram lengths looked up, longest first (a longer match predicts better; 2-token matches, common in free
writing, were measured to cost more in rejected drafts than they save: a story 0.955x plain decoding with them,
0.987x without, a copied text 1.26x either way)."""
FIRST_DRAFT = 4
"""A sequence's first draft length (at most the cap)."""
MAX_PAUSE = 32
"""Most steps drafting pauses after drafts rejected from their first token."""


class DraftLength:
    """A sequence's adaptive draft length: doubling (up to `most`) after a draft accepted whole, shrinking to one
    more than what was accepted after a miss, pausing after drafts rejected from their first token."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.length = min(FIRST_DRAFT, most)
        """The next draft's length (adapted by `accepted`)."""
        self._pause = 0
        """Steps left without drafting."""
        self._next_pause = 1
        """The pause after the next draft rejected from its first token."""

    def next(self, limit: int) -> int:
        """How many tokens to draft in this step: min(`length`, `limit`), or 0 while paused (one step of the pause
        passes)."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return max(0, min(self.length, limit))

    def accepted(self, drafted: int, taken: int) -> None:
        """Adapt the draft length: `taken` of `drafted` draft tokens were accepted."""
        if drafted <= 0:
            return
        self.length = min(self.most, 2 * self.length) if taken == drafted else max(1, taken + 1)
        if taken == 0:
            self._pause, self._next_pause = self._next_pause, min(MAX_PAUSE, 2 * self._next_pause)
        else:
            self._next_pause = 1


class NgramDrafter(DraftLength):
    """The n-gram index of one sequence's tokens, and its adaptive draft length."""

    def __init__(self, tokens: list[int], most: int) -> None:
        super().__init__(most)
        self._tokens: list[int] = []
        self._seen: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        """n → n-gram → the position just after its latest occurrence that is not the sequence's end."""
        self.extend(tokens)

    @property
    def size(self) -> int:
        """Tokens of the sequence indexed so far."""
        return len(self._tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the sequence."""
        for token in tokens:
            self._tokens.append(token)
            end = len(self._tokens) - 1  # index n-grams ending before the newest token: the suffix is never a hit
            for n in NGRAM_SIZES:
                if end >= n:
                    self._seen[n][tuple(self._tokens[end - n:end])] = end

    def draft(self, limit: int) -> list[int]:
        """Up to min(`length`, `limit`) tokens that followed the latest earlier occurrence of the sequence's last
        n tokens; empty when none occurred, the limit is 0 or drafting pauses."""
        size = self.next(limit)
        if size <= 0:
            return []
        tokens = self._tokens
        for n in NGRAM_SIZES:
            if len(tokens) <= n:
                continue
            after = self._seen[n].get(tuple(tokens[-n:]))
            if after is not None:
                return tokens[after:after + min(size, matched_since(tokens, after, n, size) - n + 1)]
        return []


def matched_since(tokens: list[int], after: int, n: int, most: int) -> int:
    """How many tokens before the end of `tokens` equal those before `after` (at least `n`, the n-gram looked up;
    counted up to `most` + `n` - 1): a reply copying its context matches far back, a phrase repeated by chance in free
    writing only for its n tokens, so a draft is as long as the evidence for it."""
    matched = n
    end = len(tokens)
    while matched < most + n - 1 and matched < after and tokens[after - matched - 1] == tokens[end - matched - 1]:
        matched += 1
    return matched


def set_drafts(decoding: list[Sequence], trackers: dict[Sequence, Tracker], backend: Backend, draft_max: int) -> None:
    """Set the tokens each decoding sequence drafts after its pending one: from the draft model when the backend
    has one (engine/llamacpp/draft_model.py), else looked up in its own context (`NgramDrafter`).
    None unless speculative decoding is on for it and no logprobs or images are asked (a rejected draft is cut off the
    slot's memory, or a hybrid model's is rewound: engine/llamacpp/recurrent_state.py)."""
    caps: dict[Sequence, tuple[int, int]] = {}
    for seq in decoding:
        seq.draft = []
        most = draft_max if seq.sampling.draft_max is None else seq.sampling.draft_max
        limit = min(most, seq.max_new_tokens - len(seq.output) - 1)
        if limit > 0 and seq.sampling.logprobs is None and not seq.images:
            caps[seq] = most, limit
    if not caps:
        return
    if backend.info.draft_model is not None:
        contexts: dict[int, tuple[list[int], int]] = {}
        for seq, (most, limit) in caps.items():
            pace = trackers[seq].drafter
            if pace is None:
                pace = trackers[seq].drafter = DraftLength(most)
            size = pace.next(limit)
            if size > 0:
                contexts[seq.slot] = (seq.prompt + seq.output, size)
        drafts = backend.draft(contexts) if contexts else {}
        for seq in caps:
            seq.draft = drafts.get(seq.slot, [])
        return
    for seq, (most, limit) in caps.items():
        tracker = trackers[seq]
        held = len(seq.prompt) + len(seq.output)
        drafter = tracker.drafter
        if not isinstance(drafter, NgramDrafter):
            drafter = tracker.drafter = NgramDrafter(seq.prompt + seq.output, most)
        elif drafter.size < held:
            drafter.extend(seq.output[drafter.size - held:])
        seq.draft = drafter.draft(limit)
