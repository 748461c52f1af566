"""Which worker served the prompt a request continues, when the request carries no reply.

A chat conversation names its previous turn by its last assistant message
(`PrefixChain.reply_depth`). Many requests carry no such boundary, yet still continue one
earlier prompt: `/v1/completions` agents resend a growing prompt (prompt N+1 = prompt N +
output + new text), trace replayers send each turn as one user message holding the whole
conversation, and precise chains (vLLM's token blocks) have no message boundaries at all.

The index alone cannot tell such a continuation from a new session on a hot prefix: both
find one worker holding almost all of their prompt (a 6,000-character system prompt and a
one-line question is 99% shared). What tells them apart is where a served prompt *ended*.
So the router remembers, for each prompt it sent, its *end key*, mapped to the worker it
went to: the deepest key whose block ends at least `END_SLACK_TOKENS` before the prompt's
end. Not its very end: a continuation rewrites the prompt's last tokens, the partial block
it grows (of a completions prompt, or of the last message) and the marker that closes a
rendered message (`<|end|>\n` in the estimate rendering; a real template's end-of-turn and
generation-prompt tokens), which a message that grows moves. Every earlier key is in any
continuation's chain, estimate or precise.

The rule: a request continues what worker W served if the deepest remembered end key in
its chain, among the keys W holds (`IndexView` depth), was recorded for W, and no other
prompt continued that end. A conversation is a line: prompt N is continued by prompt N+1
alone (its retries are the same prompt), and prompt N+2 continues N+1's end, which is
deeper. An end that two different prompts continued, or ended at (sessions that diverge
after a shared prefix within one block), is a fork: the shared prefix of sessions, not a
conversation. It is remembered as such, and a request whose deepest remembered end is a
fork has no home. So new sessions on a hot system prompt name no home (only the second
one can, when the first session's prompt, or a request of the bare prefix, ended where
the second continues): they are spread by the recent-count cap as before. A conversation
whose turn adds less than a block ends where its previous turn did, so it loses its home
until a turn crosses a block.

Precise chains need no template knowledge for this: the template does render a reply
boundary (the generation prompt before each assistant message), but a served prompt's end
is that boundary already, and prompt N's tokens prefix prompt N+1's exactly when the
template renders the history unchanged, which is also when vLLM can reuse it. (A template
that rewrites earlier turns, e.g. dropping reasoning, breaks the prefix there; the scan
then finds the end of an earlier turn.)

Cost: one dict probe per key held (about 40 ns each, measured: 20-45 µs for the 500 keys of
a 32k-token estimate chain with nothing remembered, against 1.3 ms to build that chain);
a continuing request hits within its last few keys.

Where it sits: at the edge of the routing decision, like the index. The proxy looks the
chain up (`lookup`, next to the index lookup, for chains without a reply) and hands the
answer to the policy as data (`RouteRequest.continues`); it records the prompt (`record`)
when it sends it to a worker, in estimate and precise mode alike (precise mode feeds the
index from KV events, but only the router knows which prompt it sent where). `lookup`
never writes, so a `/debug/route` dry run leaves later decisions as they were.

The memory is this router's own (bounded, oldest entries dropped first): router replicas
sharing an index each know the prompts they sent. A remembered end only counts while the
index still shows its worker holding it, so a failed attempt or an eviction cannot name a
worker that does not hold the prompt.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from cache_client.base import IndexView
from normalizer.prefix import PrefixChain, PrefixKey

END_SLACK_TOKENS = 8
"""Tokens at a prompt's end that a continuation may rewrite (module docstring): more than
the estimate rendering's closing marker (2) and the few closing tokens of a chat template."""

DEFAULT_CAPACITY = 1 << 16
"""Remembered prompt ends (about 150 bytes each): one per turn routed, the oldest dropped."""

_FORK = None
"""The worker of an end key that several prompts ended at."""


_Entry = tuple[str | None, PrefixKey, int, PrefixKey | None]


class ServedEnds:
    """Where the prompts this router sent ended (module docstring). `lookup` reads only;
    `record` is called once per prompt sent to a worker, never for a dry run."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._ends: dict[PrefixKey, _Entry] = {}
        """end key -> (worker, or _FORK; the last key of the prompt that ended there; the
        end key's index in the chain, the same in every chain holding it; the last key of
        the prompt that continued it, if one did)."""

    def __len__(self) -> int:
        return len(self._ends)

    def lookup(self, chain: PrefixChain, view: IndexView) -> str | None:
        """The worker holding a prompt that `chain` continues (module docstring), if any."""
        depths, ends = view.depths, self._ends
        if not depths or not ends:
            return None
        keys = chain.keys
        # No end beyond the deepest holder's depth is held.
        entry = self._deepest(keys, min(max(depths.values()), len(keys)))
        if entry is None:
            return None
        worker, ended, at, next_last = entry
        last = keys[-1]
        if worker is _FORK or (last != ended and next_last is not None and next_last != last):
            return None  # a shared prefix, or this request would be its second continuation
        if depths.get(worker, 0) <= at:
            return None
        return worker

    def record(self, worker: str, chain: PrefixChain) -> None:
        """`chain`'s prompt was sent to `worker`: remember where it ended and, for a chain
        without a reply (the only kind `lookup` is asked about), which end it continues."""
        keys, cum = chain.keys, chain.cum_tokens
        at = bisect.bisect_right(cum, chain.total_tokens - END_SLACK_TOKENS) - 1
        if at < 1:  # an end at key 0 names no conversation
            return
        end, last, ends = keys[at], keys[-1], self._ends
        if not chain.reply_depth:
            self._continue(keys, self._deepest(keys, at + 1))
        previous = ends.pop(end, None)
        if previous is None or (previous[0] is not _FORK and previous[1] == last):
            # New, or the same prompt again (a retry, or re-ranked after queueing).
            ends[end] = (worker, last, at, previous[3] if previous else None)
        else:
            ends[end] = (_FORK, last, at, None)  # a second prompt ended here: a shared prefix
        if len(ends) > self._capacity:
            del ends[next(iter(ends))]

    def _deepest(self, keys: Sequence[PrefixKey], stop: int) -> _Entry | None:
        """The deepest remembered end among `keys[1:stop]`. Key 0 (model and tools) is
        every request's, so an end there names no conversation. Found at C speed: a
        32k-token prompt holds 500 keys."""
        return next(filter(None, map(self._ends.get, reversed(keys[1:stop]))), None)

    def _continue(self, keys: Sequence[PrefixKey], entry: _Entry | None) -> None:
        """The prompt of `keys` continues the end `entry` (if any) of an earlier prompt."""
        if entry is None:
            return
        worker, ended, at, next_last = entry
        last = keys[-1]
        if worker is _FORK or last == ended or next_last == last:
            return  # a fork already, or a retry of the prompt that ended there or of its continuation
        end = keys[at]
        if next_last is None:
            self._ends[end] = (worker, ended, at, last)  # its one continuation, so far
        else:
            self._ends[end] = (_FORK, ended, at, next_last)  # a second prompt continues it: a shared prefix
