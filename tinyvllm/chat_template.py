"""Chat templates: find them in a model directory, pick one, render it the way transformers does.

Rendering reproduces ``transformers``' (5.x) ``apply_chat_template(..., tokenize=False)``: a Jinja
``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension, transformers' ``tojson`` filter (no HTML escaping, ``indent``/``separators``/
``sort_keys`` options), the ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` (no
underscore attributes) globals and the ``{% generation %}`` tag (rendered as its body). Before
rendering, as transformers does, each message loses its keys whose value is None (an OpenAI
``"tool_calls": null`` is a missing key) and a message's reasoning given as ``reasoning_content``,
``reasoning`` or ``thinking`` is visible under all three names (Qwen3's template reads
``reasoning_content``). Everything the template sees is rebuilt from plain JSON types.
Templates execute in the sandbox: they cannot reach Python internals nor mutate the messages.

``chat_template_kwargs`` (vLLM's name, :func:`merge_template_kwargs`) are extra template variables,
e.g. Qwen3's ``enable_thinking``; they also override the call's ``add_generation_prompt``,
``tools`` and ``documents``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ChatTemplates = str | dict[str, str]
"""One template, or named ones (``{"default": ..., "tool_use": ...}``)."""

# Names a message's reasoning may come under (transformers' order: the first is what templates read).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# chat_template_kwargs that override the render call's own arguments (vLLM merges them over those).
OVERRIDABLE_KWARGS = frozenset({"add_generation_prompt", "tools", "documents"})
# chat_template_kwargs that are refused: the template itself is chosen elsewhere (a request must not
# smuggle one in), and there is no tokenize step here.
RESERVED_KWARGS = frozenset({"chat_template", "tokenize", "messages", "conversation"})


def merge_template_kwargs(arguments: dict[str, Any], chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``arguments`` (the call's ``add_generation_prompt``, ``tools``, ...) overlaid with the user's
    ``chat_template_kwargs``, as vLLM's ``LLM.chat`` and its chat endpoint do.

    Raises:
        TypeError: ``chat_template_kwargs`` is not a dict with string keys.
        ValueError: it names ``chat_template``, ``tokenize``, ``messages`` or ``conversation``.
    """
    if chat_template_kwargs is None:
        return dict(arguments)
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise TypeError("chat_template_kwargs must be a dict of template variable names to values")
    reserved = sorted(RESERVED_KWARGS & chat_template_kwargs.keys())
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {reserved}: choose the template with chat_template, "
            "and pass the messages as messages"
        )
    return {**arguments, **chat_template_kwargs}


def resolve_chat_template(value: str) -> str:
    """The template an engine-wide `chat_template` option names (vLLM's ``--chat-template``): the
    contents of the file at that path, else the value itself as the template text. Checked to compile.

    Raises:
        ValueError: a value that looks like a file path (one line, ending in .jinja, .j2 or .txt, or
            naming a directory) but is not a readable file, or a template with a syntax error.
    """
    path = Path(value).expanduser()
    one_line = "\n" not in value and "{" not in value
    if one_line and path.is_file():
        value = path.read_text(encoding="utf-8")
    elif one_line and (path.suffix in (".jinja", ".j2", ".txt") or path.is_dir()):
        raise ValueError(f"chat_template {str(path)!r}: no such file (give a template file or the template text)")
    from tinyvllm.chat_jinja import compile_template

    compile_template(value)
    return value


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
        TypeError: ``tools`` is not a list of JSON-schema dicts, ``documents`` not a list of dicts, a
            message not a dict.
    """
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise TypeError("tools must be a list of JSON-schema dicts (callables are not converted)")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be a list of dicts")
    if not all(isinstance(m, Mapping) for m in messages):
        raise TypeError("each message must be a dict with 'role' and 'content'")
    import jinja2  # with chat_jinja: only where a template renders (Jinja's import is ~20 ms)

    from tinyvllm.chat_jinja import compile_template

    try:
        return compile_template(template).render(
            messages=template_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


def template_messages(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them (transformers 5's normalisation): plain copies
    without the keys whose value is None, the reasoning under every name of
    :data:`REASONING_FIELDS` when the message has it under one."""
    out = []
    for message in messages:
        m = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _plain(value: Any) -> Any:
    """``value`` rebuilt from JSON types (dict, list, tuple, str, int, float, bool, None); str/int/float
    subclasses lose their subclass and anything else becomes a ``"<TypeName>"`` placeholder, so the
    template never touches an object's methods (transformers' ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"
