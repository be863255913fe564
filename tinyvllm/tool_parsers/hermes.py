"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5, Qwen3)::

    Some text.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

Text outside the blocks is content. A block whose body is not a call object comes back as content,
tags included; an unterminated block at the end of the output is a call if its body is one (the
model stopped on EOS before ``</tool_call>``), else content.
"""

from __future__ import annotations

from tinyvllm.tool_parsers.base import ContentText, Event, ToolCallStream, held_prefix, parse_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")


class HermesStream(ToolCallStream):
    def __init__(self) -> None:
        self._text = ContentText()
        self._pending = ""
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        out: list[Event] = []
        while self._pending:
            pending = self._pending
            if not self._in_call:
                start = pending.find(OPEN)
                if start < 0:
                    keep = held_prefix(pending, OPEN)
                    self._text.add(pending[: len(pending) - keep], out)
                    self._pending = pending[len(pending) - keep :]
                    break
                self._text.add(pending[:start], out)
                self._pending, self._in_call = pending[start + len(OPEN) :], True
            else:
                end = pending.find(CLOSE)
                if end < 0:
                    break
                self._block(pending[:end], CLOSE, out)
                self._pending, self._in_call = pending[end + len(CLOSE) :], False
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        pending, self._pending = self._pending, ""
        if self._in_call:
            self._block(pending, "", out)
        else:
            self._text.add(pending, out)
        self._text.cut()
        return out

    def _block(self, body: str, close: str, out: list[Event]) -> None:
        call = parse_call(body.strip(), _ARGUMENT_KEYS)
        if call is not None:
            self._text.cut()
            out.append(call)
        else:
            self._text.add(OPEN + body + close, out)
