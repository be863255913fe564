"""One chat choice's output text as OpenAI's message parts: reasoning, content and tool calls.

The text passes two stages, each a streaming state machine: the reasoning parser
(`tinyvllm.reasoning`, with `--reasoning-parser`) splits off the thinking; the content after it goes
to the tool stage of the request's `ToolPlan`:

* none: content as it is;
* auto: the `--tool-call-parser` machine (`tinyvllm.tool_parsers`): content, and each call once complete;
* named: the content is the one call's arguments, streamed as they come;
* required: the content is a JSON array of `{"name", "parameters"}` (the grammar saw to it), read
  into calls at the end; text that does not parse (cut by max_tokens) stays content.

`ChoiceOutput.feed` / `finish` return OpenAI delta dicts (`{"reasoning_content"}`, `{"content"}`,
`{"tool_calls": [...]}`: a call's first delta has its index, id, type and name, the next ones append
to `function.arguments`); `message` merges the deltas of a whole text, so a streamed response and a
whole one always agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tinyvllm.entrypoints.tools import ToolPlan
from tinyvllm.reasoning import ReasoningStream
from tinyvllm.tool_parsers import Content, make_tool_call_stream


@dataclass(frozen=True)
class OutputPlan:
    """How a chat request's output is read. `parses` is False for plain text (the fast path)."""

    tools: ToolPlan
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None

    @property
    def parses(self) -> bool:
        return self.reasoning_parser is not None or self.tools.mode != "none"


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ChoiceOutput:
    """The parsing state of one choice (see the module docstring)."""

    def __init__(self, plan: OutputPlan, prompt: str | None) -> None:
        self.plan = plan
        self.num_calls = 0
        self._reasoning = ReasoningStream(plan.reasoning_parser, prompt) if plan.reasoning_parser else None
        mode = plan.tools.mode
        self._calls = make_tool_call_stream(plan.tool_call_parser) if mode == "auto" else None
        self._buffer: list[str] = []  # required: the whole content, read at the end

    def feed(self, text: str) -> list[dict]:
        if self._reasoning is None:
            return self._content(text, final=False)
        split = self._reasoning.feed(text)
        head = [{"reasoning_content": split.reasoning}] if split.reasoning else []
        return head + self._content(split.content, final=False)

    def finish(self) -> list[dict]:
        if self._reasoning is None:
            return self._content("", final=True)
        split = self._reasoning.finish()
        head = [{"reasoning_content": split.reasoning}] if split.reasoning else []
        return head + self._content(split.content, final=True)

    def _content(self, text: str, final: bool) -> list[dict]:
        mode = self.plan.tools.mode
        if mode == "none":
            return [{"content": text}] if text else []
        if mode == "auto":
            assert self._calls is not None
            events = self._calls.feed(text) if text else []
            if final:
                events += self._calls.finish()
            out = []
            for e in events:
                out += [{"content": e.text}] if isinstance(e, Content) else self._call(e.name, e.arguments)
            return out
        if mode == "named":
            if not text:
                return []
            if self.num_calls == 0:
                assert self.plan.tools.function is not None
                return self._call(self.plan.tools.function, text)
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        self._buffer.append(text)
        return self._required_calls("".join(self._buffer)) if final else []

    def _call(self, name: str, arguments: str) -> list[dict]:
        index = self.num_calls
        self.num_calls += 1
        first = {"index": index, "id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        return [{"tool_calls": [first]}, {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]

    def _required_calls(self, text: str) -> list[dict]:
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        names = self.plan.tools.names
        if not isinstance(items, list) or not items or not all(_is_call(item, names) for item in items):
            return [{"content": text}] if text else []
        out = []
        for item in items:
            out += self._call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after making calls."""
        return "tool_calls" if engine_reason == "stop" and self.num_calls else engine_reason

    def message(self, text: str) -> dict:
        """The whole message of `text`: {role, content, reasoning_content?, tool_calls?}."""
        return merge_deltas(self.feed(text) + self.finish(), self.plan.reasoning_parser is not None)


def _is_call(item: object, names: tuple[str, ...]) -> bool:
    return isinstance(item, dict) and item.get("name") in names and isinstance(item.get("parameters"), dict)


def merge_deltas(deltas: list[dict], with_reasoning: bool) -> dict:
    """The message the deltas of one choice add up to."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for d in deltas:
        content.append(d.get("content", ""))
        reasoning.append(d.get("reasoning_content", ""))
        for c in d.get("tool_calls", ()):
            if c["index"] == len(calls):
                calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    message: dict = {"role": "assistant", "content": "".join(content) or None}
    if with_reasoning:
        message["reasoning_content"] = "".join(reasoning) or None
    if calls:
        message["tool_calls"] = calls
    return message
