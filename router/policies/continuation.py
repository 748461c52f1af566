"""Which worker served the prompt a request continues, when the request carries no reply.

A chat conversation names its previous turn by its last assistant message
(`PrefixChain.reply_depth`). Many requests carry no such boundary, yet still continue one
earlier prompt: `/v1/completions` agents resend a growing prompt (prompt N+1 = prompt N +
output + new text), trace replayers send each turn as one user message holding the whole
conversation, and precise chains (vLLM's token blocks) have no message boundaries at all.

The index alone cannot tell such a continuation from a new session on a hot prefix: both
find one worker holding almost all of their prompt (a 6,000-character system prompt and a
one-line question is 99% shared). What tells them apart is where a served prompt *ended*.
So the policy remembers, for each prompt it placed, its *end key*, the key before its last
block (the last block is the one a continuation may still grow: the partial tail of a
completions prompt or of the last message; every earlier key is in any continuation's
chain, precise ones included), mapped to the worker it went to.

The rule: a request continues what worker W served if the deepest remembered end key in
its chain, among the keys W holds (`IndexView` depth), was recorded for W. An end key that
two different prompts ended at is a fork point (sessions diverging after a shared prefix,
whose own tails were shorter than a block), remembered as such, and a request whose
deepest remembered end is a fork point has no home. So new sessions on a hot system
prompt never name a home, except the second one when the first session's question fit in
a block: they are spread by the recent-count cap as before. A conversation whose turns add
less than a block each loses its home for one turn (its earlier ends still name it after).

Precise chains need no template knowledge for this: the template does render a reply
boundary (the generation prompt before each assistant message), but a served prompt's end
is that boundary already, and prompt N's tokens prefix prompt N+1's exactly when the
template renders the history unchanged, which is also when vLLM can reuse it. (A template
that rewrites earlier turns, e.g. dropping reasoning, breaks the prefix there; the scan
then finds the end of an earlier turn.)

Cost: one dict probe per key held (about 40 ns each, measured: 20-45 µs for the 500 keys of
a 32k-token estimate chain with nothing remembered, against 1.3 ms to build that chain);
a continuing request hits within its last few keys.

The memory is this router's own (bounded, oldest entries dropped first): router replicas
sharing an index each know the prompts they placed. A remembered end only counts while
the index still shows its worker holding it, so a failed-over or dry-run (`/debug/route`)
decision, or an eviction, cannot name a worker that does not hold the prompt.
"""

from __future__ import annotations

from cache_client.base import IndexView
from normalizer.prefix import PrefixChain, PrefixKey

DEFAULT_CAPACITY = 1 << 16
"""Remembered prompt ends (about 150 bytes each): one per turn routed, the oldest dropped."""

_FORK = None
"""The worker of an end key that several prompts ended at."""


class ServedEnds:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._ends: dict[PrefixKey, tuple[str | None, PrefixKey, int]] = {}
        """end key -> (worker, or _FORK; the last key of the prompt that ended there; the
        end key's index in the chain, the same in every chain holding it)."""

    def __len__(self) -> int:
        return len(self._ends)

    def home(self, chain: PrefixChain, view: IndexView) -> str | None:
        """The worker holding a prompt that `chain` continues (module docstring), if any."""
        depths = view.depths
        if not depths or not self._ends:
            return None
        keys = chain.keys
        # No end beyond the deepest holder's depth is held; key 0 (model and tools) is
        # every request's, so an end there names no conversation. The deepest remembered
        # end first, found at C speed (a 32k-token prompt holds 500 keys).
        held = keys[1 : min(max(depths.values()), len(keys))]
        entry = next(filter(None, map(self._ends.get, reversed(held))), None)
        if entry is None:
            return None
        worker, _, at = entry
        if worker is _FORK or depths.get(worker, 0) <= at:
            return None
        return worker

    def served(self, chain: PrefixChain, worker: str) -> None:
        """Remember that `chain`'s prompt went to `worker`."""
        keys = chain.keys
        if len(keys) < 3:  # its end would be key 0
            return
        end, last = keys[-2], keys[-1]
        ends = self._ends
        previous = ends.pop(end, None)
        if previous is not None and (previous[0] is _FORK or previous[1] != last):
            ends[end] = (_FORK, last, len(keys) - 2)  # a second prompt ended here: a shared prefix
        else:
            ends[end] = (worker, last, len(keys) - 2)  # new, or the same prompt again (a retry)
        if len(ends) > self._capacity:
            del ends[next(iter(ends))]
