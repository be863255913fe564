"""Chat templates: find them in a model directory, pick one, render it the way transformers does.

Rendering reproduces ``transformers``' ``apply_chat_template(..., tokenize=False)``: a Jinja
``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension, transformers' ``tojson`` filter (no HTML escaping, ``indent``/``separators``/
``sort_keys`` options), the ``raise_exception`` and ``strftime_now`` globals and the
``{% generation %}`` tag (rendered as its body). Templates execute in the sandbox: they cannot
reach Python internals nor mutate the messages.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

ChatTemplates = str | dict[str, str]
"""One template, or named ones (``{"default": ..., "tool_use": ...}``)."""


def load_chat_templates(model_dir: Path, tokenizer_config: dict[str, Any]) -> ChatTemplates | None:
    """The chat template(s) of a model directory, with transformers' precedence.

    ``chat_template.jinja`` (named "default") and ``additional_chat_templates/<name>.jinja`` win
    over tokenizer_config.json's ``chat_template``, which is a string or a list of
    ``{"name": ..., "template": ...}``. Returns None when there is none.
    """
    templates: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if not templates:
        value = tokenizer_config.get("chat_template")
        if isinstance(value, list):
            return {t["name"]: t["template"] for t in value}
        return value
    if list(templates) == ["default"]:
        return templates["default"]
    return templates


def select_chat_template(templates: ChatTemplates | None, chat_template: str | None, tools: list | None) -> str:
    """The template source to render, as transformers' ``get_chat_template``.

    ``chat_template`` is a template name (when the model has named templates) or a template
    string; without it: the model's single template, else "tool_use" when tools are given, else
    "default".

    Raises:
        ValueError: no template at all, or named templates without a "default".
    """
    named = templates if isinstance(templates, dict) else {}
    if chat_template is not None:
        return named.get(chat_template, chat_template)
    if isinstance(templates, str):
        return templates
    if tools is not None and "tool_use" in named:
        return named["tool_use"]
    if "default" in named:
        return named["default"]
    if named:
        raise ValueError(
            f"the model has several chat templates and no default; pass chat_template= one of {sorted(named)}"
        )
    raise ValueError(
        "this model has no chat template (no chat_template in tokenizer_config.json nor chat_template.jinja); "
        "pass chat_template= a Jinja template string"
    )


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Render ``template`` with the variables transformers passes.

    ``variables`` are the named special tokens (``bos_token``, ...) and any extra template
    variables (``date_string``, ``tools_in_user_message``, ...).

    Raises:
        ValueError: an empty conversation, or the template failed: ``raise_exception`` (the
            template rejects the messages), a sandbox violation, a syntax error.
        TypeError: ``tools`` is not a list of JSON-schema dicts.
    """
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise TypeError("tools must be a list of JSON-schema dicts (callables are not converted)")
    try:
        return _compile(template).render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' override of Jinja's tojson: no HTML escaping, keys kept in order.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """Compile in transformers' environment; memoized, as a template is rendered once per request."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template has a syntax error: {e}") from e
