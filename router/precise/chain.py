"""Precise chains: a request's keys are vLLM's own block hashes of its prompt tokens."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from normalizer.prefix import PrefixChain, PrefixKey
from normalizer.vllm_hash import BlockHasher
from router.chain import ChainBuilder, EstimateChainBuilder, RequestKind, cache_salt_of, chat_form
from router.precise.tokenizer import ModelTokenizer, UnsupportedRequest

log = logging.getLogger("kvroute.precise")


def chain_of_tokens(hasher: BlockHasher, tokens: list[int], cache_salt: str | None = None) -> PrefixChain:
    """The chain of the prompt's cacheable full blocks (vLLM never caches the last token)."""
    n = hasher.cacheable_blocks(len(tokens))
    keys = tuple(PrefixKey(k) for k in hasher.keys(tokens, max_blocks=n, cache_salt=cache_salt))
    bs = hasher.block_size
    return PrefixChain(keys, tuple(bs * (i + 1) for i in range(len(keys))), len(tokens))


class PreciseChainBuilder:
    """keys = vLLM's hashes of the prompt's cacheable full blocks (64-bit event form)."""

    records_on_route = False
    """KV events are authoritative: the router never guesses what a worker stored."""

    def __init__(
        self, tokenizer: ModelTokenizer, hasher: BlockHasher | None, fallback: ChainBuilder | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.hasher = hasher
        """None until the block size is known (precise mode reads it from the workers)."""
        self._fallback: ChainBuilder = fallback if fallback is not None else EstimateChainBuilder()
        self.fallbacks = 0

    def tokens(self, body: Mapping[str, Any], kind: RequestKind) -> list[int]:
        if kind == "completion":
            return self.tokenizer.completion_tokens(body)
        if kind == "responses" and (body.get("previous_response_id") or body.get("conversation")):
            # The engine prepends a stored conversation the router never sees: no exact
            # tokens, and a chain of the visible part would match the wrong prefixes.
            raise UnsupportedRequest("a Responses request continuing a stored response")
        return self.tokenizer.chat_tokens(chat_form(dict(body), kind))

    def build(self, body: dict[str, Any], kind: RequestKind) -> PrefixChain:
        hasher = self.hasher
        if hasher is None:  # block size not known yet (no worker answered)
            self.fallbacks += 1
            return self._fallback.build(body, kind)
        try:
            tokens = self.tokens(body, kind)
        except (UnsupportedRequest, KeyError, TypeError, ValueError) as exc:
            # Unmodelled inputs (images, templates raising on the input): route on the
            # estimate chain, which still balances load; the index holds no such keys.
            self.fallbacks += 1
            log.debug("precise tokenization fell back to estimates: %s", exc)
            return self._fallback.build(body, kind)
        except Exception as exc:  # a template error (raise_exception) is the client's problem
            self.fallbacks += 1
            log.debug("chat template failed: %s", exc)
            return self._fallback.build(body, kind)
        return chain_of_tokens(hasher, tokens, cache_salt_of(body))
