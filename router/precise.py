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

Exactness is checked against the worker's own `POST /tokenize` (tests/precise/test_vllm_e2e.py).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from normalizer.prefix import PrefixChain, PrefixKey
from normalizer.vllm_hash import BlockHasher
from router.chain import EstimateChainBuilder, RequestKind
from router.redact import exc_summary

log = logging.getLogger("kvroute.precise")

HF_APPLY_PARAMS = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)
"""`apply_chat_template`'s named parameters: accepted from requests, never passed to the
template (transformers consumes them)."""

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class UnsupportedRequest(ValueError):
    """A request precise mode cannot tokenize exactly (images, audio, LoRA...)."""


# -- the Jinja environment transformers renders chat templates in ----------------------------
@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant spans for training
        # masks; rendering just emits its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env, env.from_string(template), env.parse(template)


def template_variables(template: str) -> frozenset[str]:
    import jinja2.meta

    _env, _, ast = _compile(template)
    return frozenset(jinja2.meta.find_undeclared_variables(ast))


# -- vLLM's content-format detection (string vs openai), from the template's AST ---------------
def _is_var(node: Any, name: str) -> bool:
    import jinja2.nodes as n

    return isinstance(node, n.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: Any, name: str, key: str) -> bool:
    import jinja2.nodes as n

    if isinstance(node, n.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    if isinstance(node, n.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: Any, name: str, key: str | None = None) -> bool:
    import jinja2.nodes as n

    if isinstance(node, n.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, n.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _message_loop_vars(root: Any) -> Iterator[str]:
    import jinja2.nodes as n

    names = ["messages"]
    pending = deque(["messages"])
    while pending:
        cur = pending.popleft()
        for assign in root.find_all(n.Assign):
            target = assign.target
            if _is_var_or_elems(assign.node, cur) and isinstance(target, n.Name) and target.name not in names:
                names.append(target.name)
                pending.append(target.name)
    for loop in root.find_all(n.For):
        if any(_is_var_or_elems(loop.iter, v) for v in names) and isinstance(loop.target, n.Name):
            yield loop.target.name


@lru_cache(maxsize=8)
def content_format(template: str) -> str:
    """'openai' if the template loops over a message's content parts, else 'string'."""
    import jinja2.nodes as n

    _, _, root = _compile(template)
    msg_vars = list(_message_loop_vars(root))
    in_macros = {id(loop) for m in root.find_all(n.Macro) for loop in m.find_all(n.For)}
    for loop in root.find_all(n.For):
        if any(_is_var_or_elems(loop.iter, v, "content") for v in msg_vars):
            return "openai"
        if id(loop) not in in_macros and isinstance(loop.iter, n.Name) and loop.iter.name == "content":
            return "openai"
    return "string"


# -- the tokenizer --------------------------------------------------------------------------
def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass
class ModelTokenizer:
    """A model directory's tokenizer.json + chat template, used the way vLLM uses them."""

    tokenizer: Any
    chat_templates: dict[str, str]
    special_tokens: dict[str, str]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelTokenizer:
        from tokenizers import Tokenizer

        root = Path(path)
        tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").exists():
            config = json.loads((root / "tokenizer_config.json").read_text())
        specials: dict[str, str] = {}
        if (root / "special_tokens_map.json").exists():
            for k, v in json.loads((root / "special_tokens_map.json").read_text()).items():
                if k in _SPECIAL_TOKEN_NAMES and (text := _token_text(v)) is not None:
                    specials[k] = text
        for k in _SPECIAL_TOKEN_NAMES:
            if (text := _token_text(config.get(k))) is not None:
                specials[k] = text
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            templates.update({t["name"]: t["template"] for t in raw if isinstance(t, Mapping)})
        # Newer checkpoints keep the template in its own file, which takes precedence.
        if (root / "chat_template.jinja").exists():
            templates["default"] = (root / "chat_template.jinja").read_text()
        elif (root / "chat_template.json").exists():
            doc = json.loads((root / "chat_template.json").read_text())
            if isinstance(doc.get("chat_template"), str):
                templates["default"] = doc["chat_template"]
        return cls(tok, templates, specials)

    def template_for(self, tools: Any) -> str:
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if len(self.chat_templates) == 1:
            return next(iter(self.chat_templates.values()))
        raise UnsupportedRequest("the tokenizer has no chat template")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    # -- chat --
    def render_chat(self, body: Mapping[str, Any]) -> str:
        tools = _tool_dicts(body)
        template = body.get("chat_template") or self.template_for(tools)
        conversation = _conversation(body.get("messages") or [], content_format(template))
        if any(m["role"] == "developer" for m in conversation) and not (
            '"developer"' in template or "'developer'" in template
        ):
            conversation = _developer_as_system(conversation)
        requested: dict[str, Any] = dict(body.get("chat_template_kwargs") or {})
        extra = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": body.get("reasoning_effort"),
        }
        if body.get("reasoning_effort") is not None and "enable_thinking" not in requested:
            extra["enable_thinking"] = body["reasoning_effort"] != "none"
        kwargs = {**extra, **requested}  # the request's own kwargs win, as in vLLM's merge
        accepted = template_variables(template) | HF_APPLY_PARAMS
        kwargs = {k: v for k, v in kwargs.items() if k in accepted and k not in ("chat_template", "tokenize")}
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", False))
        continue_final = kwargs.pop("continue_final_message", False)
        documents = kwargs.pop("documents", None)
        render_kwargs = {k: v for k, v in kwargs.items() if k not in HF_APPLY_PARAMS}
        if continue_final:
            raise UnsupportedRequest("continue_final_message is not modelled")
        _, compiled, _ = _compile(template)
        return compiled.render(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **render_kwargs},
        )

    def chat_tokens(self, body: Mapping[str, Any]) -> list[int]:
        return self.encode(self.render_chat(body), bool(body.get("add_special_tokens", False)))

    def completion_tokens(self, body: Mapping[str, Any]) -> list[int]:
        prompt = body.get("prompt", "")
        add = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, list):
            if not prompt:
                return []
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
            # A batch of prompts: route on the first (the others usually share its prefix).
            first = prompt[0]
            if isinstance(first, list):
                return [int(t) for t in first]
            prompt = first
        if not isinstance(prompt, str):
            raise UnsupportedRequest("prompt is neither text nor token ids")
        return self.encode(prompt, add)


def _tool_dicts(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping):
            raise UnsupportedRequest("tool without a function definition")
        dumped: dict[str, Any] = {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        if fn.get("strict") is not None:
            dumped["strict"] = fn["strict"]
        if fn.get("defer_loading") is not None:
            dumped["defer_loading"] = fn["defer_loading"]
        out.append({"type": tool.get("type", "function"), "function": dumped})
    return out


def _text_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text", "refusal"):
            texts.append(part.get("text") if part.get("type") != "refusal" else part.get("refusal", ""))
        else:
            raise UnsupportedRequest(f"content part {part.get('type') if isinstance(part, Mapping) else part!r}")
    return texts


def _conversation(messages: list[Any], fmt: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise UnsupportedRequest("message is not an object")
        role = msg["role"]
        texts = _text_parts(msg.get("content"))
        conv: dict[str, Any]
        if fmt == "openai":
            conv = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
        else:
            conv = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                calls = [_tool_call(c) for c in msg["tool_calls"]]
                if calls:
                    conv["tool_calls"] = calls
            if msg.get("reasoning") is not None:
                conv["reasoning"] = conv["reasoning_content"] = msg["reasoning"]
        elif role == "tool":
            if "tool_call_id" in msg:
                conv["tool_call_id"] = msg["tool_call_id"]
            if isinstance(conv["content"], list):
                conv["content"] = "\n".join(texts)
        if isinstance(msg.get("name"), str):
            conv["name"] = msg["name"]
        out.append(conv)
    return out


def _tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise UnsupportedRequest("assistant tool_calls entries must be objects with a function")
    call = {**call, "function": dict(call["function"])}
    fn = call["function"]
    args = fn.get("arguments")
    if not args:
        fn["arguments"] = {}
    elif not isinstance(args, Mapping):
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = None
        fn["arguments"] = parsed if isinstance(parsed, dict) else {}
    return call


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's `_convert_developer_to_system` + `_consolidate_system_messages`."""
    converted = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    # Every system message merged into one at position 0 (some templates require it
    # first), unless there is only one and it already is first.
    contents: list[str] = []
    rest: list[dict[str, Any]] = []
    needs = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or contents:
            needs = True
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, Mapping) else p
                for p in content
                if (isinstance(p, Mapping) and "text" in p) or isinstance(p, str)
            )
        if content:
            contents.append(content)
    if not needs:
        return converted
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]


# -- the chain builder ----------------------------------------------------------------------
class PreciseChainBuilder:
    """keys = vLLM's hashes of the prompt's cacheable full blocks (64-bit event form)."""

    records_on_route = False
    """KV events are authoritative: the router never guesses what a worker stored."""

    def __init__(self, tokenizer: ModelTokenizer, hasher: BlockHasher, fallback: Any = None) -> None:
        self.tokenizer = tokenizer
        self.hasher = hasher
        self._fallback = fallback if fallback is not None else EstimateChainBuilder()
        self.fallbacks = 0

    def tokens(self, body: Mapping[str, Any], kind: RequestKind) -> list[int]:
        return self.tokenizer.chat_tokens(body) if kind == "chat" else self.tokenizer.completion_tokens(body)

    def chain_of_tokens(self, tokens: list[int], cache_salt: str | None = None) -> PrefixChain:
        hasher = self.hasher
        n = hasher.cacheable_blocks(len(tokens))
        keys = tuple(PrefixKey(k) for k in hasher.keys(tokens, max_blocks=n, cache_salt=cache_salt))
        bs = hasher.block_size
        return PrefixChain(keys, tuple(bs * (i + 1) for i in range(len(keys))), len(tokens))

    def build(self, body: dict[str, Any], kind: RequestKind) -> PrefixChain:
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
        salt = body.get("cache_salt")
        return self.chain_of_tokens(tokens, salt if isinstance(salt, str) else None)


# -- precise mode in `kvroute serve` ----------------------------------------------------------
PRECISE_FLAGS = {
    "--tokenizer": "TOKENIZER",
    "--block-size": "BLOCK_SIZE",
    "--hash-algo": "HASH_ALGO",
    "--hash-seed": "HASH_SEED",
    "--kv-events": "KV_EVENTS",
    "--kv-events-discover": "KV_EVENTS_DISCOVER",
    "--kv-events-cpu": "KV_EVENTS_CPU",
}
PRECISE_HELP = """precise mode (router/precise.py; each also as env KVROUTE_<NAME>):
  --tokenizer PATH        model dir (tokenizer.json + tokenizer_config.json): precise mode on
  --block-size N          vLLM block size (default: the workers' vllm:cache_config_info)
  --hash-algo ALGO        sha256 | sha256_cbor (default: the workers' cache_config_info)
  --hash-seed SEED        the workers' PYTHONHASHSEED, if they set one
  --kv-events NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T]   (repeatable)
  --kv-events-discover / --no-kv-events-discover
                          ask workers without --kv-events for /kv_event_sources (default on)
  --kv-events-cpu pool|worker|ignore
                          where CPU-medium events go (default pool: LMCache's shared pool)"""
ENV_PREFIX = "KVROUTE_"


def take_precise_flags(argv: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """Move precise-mode flags from `argv` into `KVROUTE_*` variables; return the rest.

    Precise mode is configured through the environment so that every router process of
    `--processes N` (uvicorn re-imports the app from the environment) gets the same.
    """
    import os

    env = os.environ if environ is None else environ
    rest: list[str] = []
    events: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg in ("-h", "--help"):
            print(PRECISE_HELP)
            rest.append(arg)
        elif name == "--no-kv-events-discover" and not eq:
            env[ENV_PREFIX + "KV_EVENTS_DISCOVER"] = "0"
        elif name in PRECISE_FLAGS:
            if not eq:
                if name == "--kv-events-discover":
                    env[ENV_PREFIX + "KV_EVENTS_DISCOVER"] = "1"
                    i += 1
                    continue
                if i + 1 >= len(argv):
                    raise SystemExit(f"kvroute: {name} needs a value")
                i += 1
                value = argv[i]
            if name == "--kv-events":
                events.append(value)
            else:
                env[ENV_PREFIX + PRECISE_FLAGS[name]] = value
        else:
            rest.append(arg)
        i += 1
    if events:
        env[ENV_PREFIX + "KV_EVENTS"] = ";".join(events)
    return rest


def precise_from_env(environ: Mapping[str, str] | None = None) -> PreciseMode | None:
    """The precise chain builder configured by `KVROUTE_TOKENIZER` & co., or None."""
    import os

    from cache_client.kv_events import parse_kv_events_arg

    env = os.environ if environ is None else environ
    path = env.get(ENV_PREFIX + "TOKENIZER")
    if not path:
        if env.get(ENV_PREFIX + "KV_EVENTS"):
            raise SystemExit("kvroute: --kv-events needs --tokenizer (precise mode)")
        return None
    sources = [parse_kv_events_arg(a) for a in env.get(ENV_PREFIX + "KV_EVENTS", "").split(";") if a]
    block = env.get(ENV_PREFIX + "BLOCK_SIZE")
    algo = env.get(ENV_PREFIX + "HASH_ALGO")
    if algo is not None:
        from normalizer.vllm_hash import hash_function

        try:
            hash_function(algo)
        except ValueError as exc:
            raise SystemExit(f"kvroute: {exc}") from None
    cpu = env.get(ENV_PREFIX + "KV_EVENTS_CPU", "pool")
    if cpu not in ("pool", "worker", "ignore"):
        raise SystemExit(f"kvroute: --kv-events-cpu must be pool, worker or ignore, not {cpu!r}")
    return PreciseMode(
        ModelTokenizer.from_dir(path),
        block_size=int(block) if block else None,
        hash_algo=algo,
        hash_seed=env.get(ENV_PREFIX + "HASH_SEED"),
        sources=sources,
        discover=env.get(ENV_PREFIX + "KV_EVENTS_DISCOVER", "1").lower() not in ("0", "false", "no", "off"),
        cpu_medium=cpu,  # type: ignore[arg-type]
    )


class PreciseMode(PreciseChainBuilder):
    """The chain builder plus what feeds its index: KV-event ingestion for the fleet.

    Started by the app's lifespan (`start(app)` after the fleet's first health round):
    reads block size / hash algorithm / KV capacity from each worker's
    `vllm:cache_config_info` unless given, subscribes to every worker's KV events (given
    with --kv-events or discovered from `/kv_event_sources`), and keeps doing so as workers
    join and leave.
    """

    REFRESH_S = 10.0

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        *,
        block_size: int | None = None,
        hash_algo: str | None = None,
        hash_seed: str | None = None,
        sources: list[Any] | None = None,
        discover: bool = True,
        cpu_medium: str = "pool",
    ) -> None:
        from normalizer.vllm_hash import DEFAULT_NONE_HASH_SEED

        self._block_size = block_size
        self._algo = hash_algo
        self._seed = hash_seed or DEFAULT_NONE_HASH_SEED
        hasher = BlockHasher(block_size, hash_algo or "sha256", self._seed) if block_size else None
        super().__init__(tokenizer, hasher)  # type: ignore[arg-type]
        self._given_sources = list(sources or [])
        self._discover = discover
        self._cpu_medium = cpu_medium
        self.ingestor: Any = None
        self._task: Any = None
        self._client: Any = None
        self._app: Any = None
        self._configured: set[str] = set()

    def build(self, body: dict[str, Any], kind: RequestKind) -> PrefixChain:
        if self.hasher is None:  # block size not known yet (no worker answered)
            self.fallbacks += 1
            return self._fallback.build(body, kind)
        return super().build(body, kind)

    async def _worker_config(self, name: str, url: str) -> None:
        from normalizer.vllm_hash import hash_config_from_metrics

        try:
            r = await self._client.get(url + "/metrics", timeout=5.0)
            cfg = hash_config_from_metrics(r.text) if r.status_code == 200 else None
        except Exception as exc:
            log.info("no cache_config_info from %s: %s", name, exc_summary(exc))
            return
        if cfg is None:
            return
        self._configured.add(name)
        if cfg.capacity_tokens:
            # Events are authoritative; the capacity model only bounds memory, so give it
            # the worker's real KV size (it then never evicts before vLLM does).
            self._app.index.set_capacity(name, cfg.capacity_tokens)
        if self.hasher is None:
            self.hasher = BlockHasher(self._block_size or cfg.block_size, self._algo or cfg.algo, self._seed)
            if self.ingestor is not None:
                self._attach_hasher()
            log.info("precise mode: block size %d, hash %s (from %s)", self.hasher.block_size, self.hasher.algo, name)
        elif (cfg.block_size, cfg.algo) != (self.hasher.block_size, self.hasher.algo):
            log.warning(
                "worker %s hashes %d-token blocks with %s but the router uses %d/%s: its cache will look empty",
                name, cfg.block_size, cfg.algo, self.hasher.block_size, self.hasher.algo,
            )
        if not cfg.prefix_caching:
            log.warning("worker %s has prefix caching off", name)

    def _attach_hasher(self) -> None:
        from cache_client.kv_events import PoolTranslator

        self.ingestor.hasher = self.hasher
        self.ingestor.translator = PoolTranslator(self.hasher)

    async def _refresh(self) -> None:
        from cache_client.kv_events import discover_sources

        fleet = self._app.fleet
        present = {w.name: w for w in fleet}
        for w in present.values():
            if w.name not in self._configured:
                await self._worker_config(w.name, w.url)
        have = {s.worker for s in self.ingestor.sources()}
        for w in present.values():
            if w.name in have:
                continue
            for src in [s for s in self._given_sources if s.worker == w.name]:
                self.ingestor.add_source(src)
            if self._discover and not any(s.worker == w.name for s in self._given_sources):
                for src in await discover_sources(self._client, w.name, w.url):
                    log.info("KV events of %s: subscribed (discovered)", w.name)
                    self.ingestor.add_source(src)
        for name in have - present.keys():
            await self.ingestor.remove_worker(name)
            self._configured.discard(name)

    async def _loop(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(self.REFRESH_S)
            try:
                await self._refresh()
            except Exception as exc:  # keep ingesting for known workers whatever discovery does
                log.error("precise-mode refresh failed: %s", exc_summary(exc))

    async def start(self, app: Any) -> None:
        import asyncio

        import httpx

        from cache_client.kv_events import KvEventIngestor

        self._app = app
        self._client = httpx.AsyncClient(trust_env=False, follow_redirects=False)
        self.ingestor = KvEventIngestor(app.index, hasher=self.hasher, cpu_medium=self._cpu_medium)  # type: ignore[arg-type]
        self.ingestor.register_metrics(app.metrics.registry)
        await self._refresh()
        await self.ingestor.start()
        self._task = asyncio.create_task(self._loop(), name="kvroute-precise-refresh")

    async def stop(self) -> None:
        import asyncio
        import contextlib

        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.ingestor is not None:
            await self.ingestor.stop()
        if self._client is not None:
            await self._client.aclose()
