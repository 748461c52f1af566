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

The memory is bounded (oldest entries dropped first). Router replicas sharing an index share
it too: behind a round-robin balancer a conversation's next turn reaches a replica that did
not send the previous one, and without the previous turn's end it has no home, so the
recent-count cap could move it (seen with 4 replicas on real vLLM: 6 of 30 resends of a
prompt were moved and recomputed). Each replica keeps its own records for the others
(`share`, `take_sent`), and the Redis load board passes them on at its next sync (every
50 ms, off the request path: router/load/redis.py) and `absorb`s theirs. A remembered end
only counts while the index still shows its worker holding it, so a failed attempt or an
eviction cannot name a worker that does not hold the prompt.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

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

EndRecord = tuple[str, PrefixKey, PrefixKey, int, PrefixKey | None]
"""One prompt sent: (worker, its end key, its last key, the end key's index in the chain,
the remembered end it continues or None). What `record` applies, and what one replica
tells the others."""


class ServedEnds:
    """Where the prompts this router sent ended (module docstring). `lookup` reads only;
    `record` is called once per prompt sent to a worker, never for a dry run."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._outbox: list[EndRecord] | None = None
        """Records for the other replicas (`share`), None while nobody reads them."""
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
        sent = self._note(worker, chain)
        if sent is None:
            return
        self._apply(sent)
        if self._outbox is not None:
            self._outbox.append(sent)
            if len(self._outbox) > self._capacity:  # the replicas have been away a while
                del self._outbox[0]

    def _note(self, worker: str, chain: PrefixChain) -> EndRecord | None:
        """What `record` remembers of a sent prompt, as one replica tells the others."""
        keys, cum = chain.keys, chain.cum_tokens
        at = bisect.bisect_right(cum, chain.total_tokens - END_SLACK_TOKENS) - 1
        if at < 1:  # an end at key 0 names no conversation
            return None
        continued = None if chain.reply_depth else self._deepest_key(keys, at + 1)
        return (worker, keys[at], keys[-1], at, continued)

    def _apply(self, sent: EndRecord) -> None:
        worker, end, last, at, continued = sent
        ends = self._ends
        if continued is not None and (entry := ends.get(continued)) is not None:
            self._continue(continued, entry, last)
        previous = ends.pop(end, None)
        if previous is None or (previous[0] is not _FORK and previous[1] == last):
            # New, or the same prompt again (a retry, or re-ranked after queueing).
            ends[end] = (worker, last, at, previous[3] if previous else None)
        else:
            ends[end] = (_FORK, last, at, None)  # a second prompt ended here: a shared prefix
        if len(ends) > self._capacity:
            del ends[next(iter(ends))]

    # -- replicas ----------------------------------------------------------------------------
    def share(self) -> None:
        """Keep what `record` remembers for the other replicas (`take_sent`): the router's
        Redis load board passes it on at its next sync (router/load/redis.py)."""
        if self._outbox is None:
            self._outbox = []

    def take_sent(self, limit: int | None = None) -> list[EndRecord]:
        """The oldest `limit` (default: all) records not yet taken, for the other replicas."""
        if not self._outbox:
            return []
        if limit is None or len(self._outbox) <= limit:
            out, self._outbox = self._outbox, []
        else:
            out, self._outbox = self._outbox[:limit], self._outbox[limit:]
        return out

    def give_back(self, sent: list[EndRecord]) -> None:
        """Records `take_sent` handed out that did not reach the others (Redis failed): sent
        again at the next sync, bounded as before."""
        if self._outbox is not None and sent:
            self._outbox[:0] = sent
            del self._outbox[: max(0, len(self._outbox) - self._capacity)]

    def absorb(self, sent: Iterable[Sequence]) -> None:
        """Another replica's records (`take_sent`, through JSON): remembered as if this
        router had sent those prompts."""
        for worker, end, last, at, continued in sent:
            self._apply((str(worker), PrefixKey(end), PrefixKey(last), int(at),
                         None if continued is None else PrefixKey(continued)))

    def _deepest(self, keys: Sequence[PrefixKey], stop: int) -> _Entry | None:
        """The deepest remembered end among `keys[1:stop]`. Key 0 (model and tools) is
        every request's, so an end there names no conversation. Found at C speed: a
        32k-token prompt holds 500 keys."""
        return next(filter(None, map(self._ends.get, reversed(keys[1:stop]))), None)

    def _deepest_key(self, keys: Sequence[PrefixKey], stop: int) -> PrefixKey | None:
        """The key of `_deepest`'s entry."""
        return next(filter(self._ends.__contains__, reversed(keys[1:stop])), None)

    def _continue(self, end: PrefixKey, entry: _Entry, last: PrefixKey) -> None:
        """A prompt whose last key is `last` continues the remembered `end` of an earlier one."""
        worker, ended, at, next_last = entry
        if worker is _FORK or last == ended or next_last == last:
            return  # a fork already, or a retry of the prompt that ended there or of its continuation
        if next_last is None:
            self._ends[end] = (worker, ended, at, last)  # its one continuation, so far
        else:
            self._ends[end] = (_FORK, ended, at, next_last)  # a second prompt continues it: a shared prefix
