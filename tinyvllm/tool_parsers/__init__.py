"""Tool-call parsers for ``tool_choice="auto"``: find the calls a model wrote in its text, as vLLM's
``--tool-call-parser`` does. Each parser is a per-completion state machine (:class:`ToolCallStream`):
feed it text in any pieces, it releases content as soon as it cannot be part of a call and each call
once its JSON is complete, so streamed and whole-text parsing agree. Malformed calls come back as
content.

* ``llama3_json`` (:mod:`.llama3_json`): Llama 3.x's ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``.
* ``hermes`` (:mod:`.hermes`): Hermes / Qwen2.5 / Qwen3's ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>`` blocks, with text around them as content.
"""

from __future__ import annotations

from tinyvllm.tool_parsers.base import Content, ParsedCall, ToolCallStream
from tinyvllm.tool_parsers.hermes import HermesStream
from tinyvllm.tool_parsers.llama3_json import Llama3JsonStream

TOOL_CALL_PARSERS: dict[str, type[ToolCallStream]] = {"llama3_json": Llama3JsonStream, "hermes": HermesStream}
"""The ``--tool-call-parser`` names."""


def check_tool_call_parser(name: str | None) -> str | None:
    """``name`` if it is a known parser (or None).

    Raises:
        ValueError: an unknown name, listing the choices.
    """
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return name


def make_tool_call_stream(name: str) -> ToolCallStream:
    """A fresh parser of the named format (one per completion)."""
    return TOOL_CALL_PARSERS[check_tool_call_parser(name)]()


def extract_tool_calls(parser: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content or None, calls) of a whole output with the named parser."""
    return make_tool_call_stream(parser).extract(text)


__all__ = [
    "TOOL_CALL_PARSERS",
    "Content",
    "ParsedCall",
    "ToolCallStream",
    "check_tool_call_parser",
    "extract_tool_calls",
    "make_tool_call_stream",
]
