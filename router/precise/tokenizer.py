"""A model directory's tokenizer and chat template, used the way vLLM uses them: chat and
completion requests rendered into the token ids vLLM would compute.

Rendering reproduces vLLM's OpenAI chat path (vllm/renderers/{hf,chat_utils}.py and
transformers' `render_jinja_template`), for text requests (the details are listed in the
package docstring, `router/precise/__init__.py`). `tokenizers` (the `precise` extra) is
imported by `ModelTokenizer.from_dir` only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normalizer.prefix import MEDIA_PART_TYPES
from router.precise.template import (
    HF_APPLY_PARAMS,
    ContentFormat,
    compile_template,
    content_format,
    template_variables,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class MediaRequest(ValueError):
    """A prompt with images, audio or video: its blocks' vLLM hashes mix in each item's hash
    of its decoded pixels (or samples), which the router does not decode."""


class UnsupportedRequest(ValueError):
    """A request precise mode cannot tokenize exactly (images, audio, LoRA...)."""


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass
class ModelTokenizer:
    """A model directory's tokenizer.json + chat template, used the way vLLM uses them."""

    tokenizer: Tokenizer
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

    def template_for(self, tools: list[dict[str, Any]] | None) -> str:
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
        _, compiled, _ = compile_template(template)
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
        elif isinstance(part, Mapping) and isinstance(part.get("type"), str) and part["type"] in MEDIA_PART_TYPES:
            raise MediaRequest(f"content part {part.get('type')}")
        else:
            raise UnsupportedRequest(f"content part {part.get('type') if isinstance(part, Mapping) else part!r}")
    return texts


def _conversation(messages: list[Any], fmt: ContentFormat) -> list[dict[str, Any]]:
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
