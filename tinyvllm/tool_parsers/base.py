"""What every tool-call parser shares: its events, the content whitespace rule, the JSON object
scanner, and whole-text extraction through the streaming machine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Content:
    """Text that is not part of a call."""

    text: str


@dataclass(frozen=True)
class ParsedCall:
    """One complete call: the function's name and its arguments as a JSON object text."""

    name: str
    arguments: str


Event = Content | ParsedCall


class ContentText:
    """The content around calls, released as it comes, except whitespace: leading whitespace and a
    whitespace run before a call or the end are dropped ("Sure.\\n\\n<tool_call>..." has content
    "Sure.")."""

    def __init__(self) -> None:
        self._started = False
        self._ws = ""

    def add(self, text: str, out: list[Event]) -> None:
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        head = self._ws if self._started else ""
        if not self._started:
            body = body.lstrip()
        self._started = True
        self._ws = text[len(text.rstrip()) :]
        out.append(Content(head + body))

    def cut(self) -> None:
        """A call starts (or the output ends): the pending whitespace is dropped."""
        self._ws = ""


class JsonObjectScanner:
    """Finds where a JSON object that starts at a ``{`` ends, fed text in pieces: tracks depth,
    strings and escapes only (the object's validity is json.loads' job once it is complete)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int | None:
        """Index in ``text`` just past the object's closing brace, or None if it has not closed."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for i, ch in enumerate(text):
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self._depth, self._in_string, self._escaped = depth, in_string, escaped
                    return i + 1
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        return None


def parse_call(text: str, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from one JSON object text: ``{"name": str, <an arguments key>: object}`` (an object
    given as a JSON string is accepted too); None when it is anything else."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in arguments_keys if k in value), None)
    args: Any = value[key] if key is not None else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """A per-completion parser: `feed` text in any pieces, `finish` at the end; both return the
    events (content pieces and complete calls) that the text so far decides."""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content or None, calls) of a whole output."""
        events = self.feed(text) + self.finish()
        content = "".join(e.text for e in events if isinstance(e, Content))
        return content or None, [e for e in events if isinstance(e, ParsedCall)]
