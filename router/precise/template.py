"""The Jinja environment transformers renders chat templates in, and what vLLM reads from a
template's AST: the variables it uses and its content format (string vs openai).

jinja2 (the `precise` extra) is imported on first use, so that importing this module costs
nothing to a router without precise mode.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import jinja2
    import jinja2.nodes
    import jinja2.parser

ContentFormat = Literal["string", "openai"]

HF_APPLY_PARAMS = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)
"""`apply_chat_template`'s named parameters: accepted from requests, never passed to the
template (transformers consumes them)."""


# -- the Jinja environment transformers renders chat templates in ----------------------------
@lru_cache(maxsize=8)
def compile_template(template: str) -> tuple[jinja2.Environment, jinja2.Template, jinja2.nodes.Template]:
    """The template's environment, compiled form and AST (cached: one per chat template)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant spans for training
        # masks; rendering just emits its body.
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
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

    _env, _, ast = compile_template(template)
    return frozenset(jinja2.meta.find_undeclared_variables(ast))


# -- vLLM's content-format detection (string vs openai), from the template's AST ---------------
def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    import jinja2.nodes as n

    return isinstance(node, n.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    import jinja2.nodes as n

    if isinstance(node, n.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    if isinstance(node, n.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    import jinja2.nodes as n

    if isinstance(node, n.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, n.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _message_loop_vars(root: jinja2.nodes.Template) -> Iterator[str]:
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
def content_format(template: str) -> ContentFormat:
    """'openai' if the template loops over a message's content parts, else 'string'."""
    import jinja2.nodes as n

    _, _, root = compile_template(template)
    msg_vars = list(_message_loop_vars(root))
    in_macros = {id(loop) for m in root.find_all(n.Macro) for loop in m.find_all(n.For)}
    for loop in root.find_all(n.For):
        if any(_is_var_or_elems(loop.iter, v, "content") for v in msg_vars):
            return "openai"
        if id(loop) not in in_macros and isinstance(loop.iter, n.Name) and loop.iter.name == "content":
            return "openai"
    return "string"
