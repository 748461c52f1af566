"""Precise mode: the engine's own tokens and block hashes for each request.

`PreciseChainBuilder` turns a canonical request body into the `PrefixChain` whose keys are
exactly the block hashes vLLM will compute for the prompt, so that the index (fed by the
workers' KV events, `cache_client.kv_events`) answers "how many prompt tokens does worker W
really hold", to the block.

Rendering reproduces vLLM's OpenAI chat path (vllm/renderers/{hf,chat_utils}.py and
transformers' `render_jinja_template`), for text requests:

* messages: text parts joined with "\\n" when the template reads `content` as a string
  (vLLM's "string" content format, detected from the template's AST like vLLM does), else
  passed as `[{"type": "text", "text": ...}]`; tool messages' text parts always joined;
  `name`, `tool_call_id`, assistant `tool_calls` and `reasoning` kept; tool-call
  `arguments` strings parsed into objects (invalid or non-object JSON becomes `{}`);
  `developer` turned into `system` when the template does not know that role;
* tools: as vLLM's pydantic models dump them (`{"type", "function": {"name",
  "description", "parameters"[, "strict"]}}`, missing description/parameters as null), and
  dropped when `tool_choice` is "none" only if the worker excludes them (not the default);
* the template runs in transformers' sandboxed Jinja environment (trim_blocks,
  lstrip_blocks, loopcontrols, `tojson` without HTML escaping, `raise_exception`,
  `strftime_now`), with the tokenizer's special tokens and the request's
  `add_generation_prompt`, `continue_final_message`, `documents`, `reasoning_effort` and
  `chat_template_kwargs` (only variables the template uses);
* tokenization: `tokenizers` with `add_special_tokens` false for chat (the template writes
  BOS itself) and true for completions, or the request's own `add_special_tokens`.

Multimodal parts, LoRA adapters, prompt embeddings and Mistral tokenizers change vLLM's
block hashes in ways not modelled here: such requests fall back to the estimate chain.

Exactness is checked against the worker's own `POST /tokenize` (tests/test_vllm_e2e.py).

Modules, by concern:

* `template` — the Jinja environment, the variables a template uses, its content format;
* `tokenizer` — `ModelTokenizer`: requests rendered and tokenized into vLLM's token ids;
* `chain` — `PreciseChainBuilder`: token ids to the chain of vLLM block hashes;
* `events` — `PreciseMode`: the builder plus KV-event ingestion for the fleet (worker
  config discovery, the refresh loop, start/stop);
* `settings` — `PreciseSettings` (every setting, with its default: the router config's
  `precise` section) and `build_precise`.
"""

from router.precise.chain import PreciseChainBuilder, chain_of_tokens
from router.precise.events import PreciseMode
from router.precise.settings import PreciseSettings, build_precise, require_precise_extra
from router.precise.template import content_format, template_variables
from router.precise.tokenizer import ModelTokenizer, UnsupportedRequest

__all__ = [
    "ModelTokenizer",
    "PreciseChainBuilder",
    "PreciseMode",
    "PreciseSettings",
    "UnsupportedRequest",
    "build_precise",
    "chain_of_tokens",
    "content_format",
    "require_precise_extra",
    "template_variables",
]
