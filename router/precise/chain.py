"""Precise chains: a request's keys are vLLM's own block hashes of its prompt tokens."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from normalizer.prefix import PrefixChain, PrefixKey
from normalizer.vllm_hash import BlockHasher
from router.chain import ChainBuilder, EstimateChainBuilder, RequestKind, cache_salt_of, chat_form
from router.precise.tokenizer import MediaRequest, ModelTokenizer, UnsupportedRequest

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
        self.fallbacks: dict[str, int] = {}
        """Requests routed on an estimate chain instead, by why (`kvroute_precise_fallbacks_total`)."""

    def _fall_back(self, body: dict[str, Any], kind: RequestKind, why: str) -> PrefixChain:
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        return replace(self._fallback.build(body, kind), fallback=True)

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
            return self._fall_back(body, kind, "block_size_unknown")
        try:
            tokens = self.tokens(body, kind)
        except (MediaRequest, UnsupportedRequest, KeyError, TypeError, ValueError) as exc:
            # Unmodelled inputs (images, templates raising on the input): route on the
            # estimate chain, recorded where it is sent as in estimate mode.
            log.debug("precise tokenization fell back to estimates: %s", exc)
            return self._fall_back(body, kind, "media" if isinstance(exc, MediaRequest) else "unsupported")
        except Exception as exc:  # a template error (raise_exception) is the client's problem
            log.debug("chat template failed: %s", exc)
            return self._fall_back(body, kind, "template_error")
        return chain_of_tokens(hasher, tokens, cache_salt_of(body))
