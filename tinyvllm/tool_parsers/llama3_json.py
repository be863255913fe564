"""Llama 3.x JSON tool calls (Llama 3.1 / 3.2 / 3.3 Instruct with custom tools)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The output is calls or plain text, decided at its start: after optional whitespace and an optional
``<|python_tag|>`` (gone when special tokens are skipped), a ``{`` opens a call; anything else makes
the whole output content. Calls are JSON objects with ``name`` and ``parameters`` (``arguments`` is
accepted), separated by ``;`` and whitespace. From the first object that is not a call, or any other
text after the calls, the rest of the output is content.
"""

from __future__ import annotations

from tinyvllm.tool_parsers.base import (
    ContentText,
    Event,
    JsonObjectScanner,
    ToolCallStream,
    parse_call,
)

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")
_START, _BETWEEN, _OBJECT, _TEXT = range(4)


class Llama3JsonStream(ToolCallStream):
    def __init__(self) -> None:
        self._text = ContentText()
        self._state = _START
        self._pending = ""  # undecided text: the start, or the current object's text
        self._scanner = JsonObjectScanner()
        self._scanned = 0  # characters of the current object already fed to the scanner

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        out: list[Event] = []
        while self._pending:
            pending = self._pending
            if self._state == _START:
                stripped = pending.lstrip()
                if stripped.startswith(PYTHON_TAG):
                    self._pending, self._state = stripped[len(PYTHON_TAG) :], _BETWEEN
                elif stripped.startswith("{"):
                    self._state = _BETWEEN
                elif PYTHON_TAG.startswith(stripped):
                    break  # whitespace or a partial tag: wait
                else:
                    self._state = _TEXT
            elif self._state == _BETWEEN:
                stripped = pending.lstrip(" \t\r\n;")  # separators between calls
                self._pending = stripped
                if not stripped:
                    break
                self._state = _OBJECT if stripped[0] == "{" else _TEXT
                self._scanner, self._scanned = JsonObjectScanner(), 0
            elif self._state == _OBJECT:
                end = self._scanner.feed(pending[self._scanned :])
                if end is None:
                    self._scanned = len(pending)
                    break
                end += self._scanned
                call = parse_call(pending[:end], _ARGUMENT_KEYS)
                if call is None:
                    self._state = _TEXT
                    continue
                out.append(call)
                self._pending, self._state = pending[end:], _BETWEEN
            else:
                self._text.add(pending, out)
                self._pending = ""
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        pending, self._pending = self._pending, ""
        if self._state in (_START, _OBJECT, _TEXT):
            self._text.add(pending, out)
        self._text.cut()
        return out
