"""``<think> ... </think>`` reasoning, streamed: one state machine per completion.

Two formats, named as vLLM names them:

* ``deepseek_r1``: the output starts inside the thinking (the template opens it); a ``<think>`` the
  model writes anyway at the very start is dropped. Everything before ``</think>`` is reasoning; with
  no ``</think>`` at all (cut by max_tokens) everything is reasoning.
* ``qwen3``: the output starts inside the thinking only when the prompt ends inside an open
  ``<think>`` block (templates that open it for the model); otherwise the thinking is whatever the
  model writes between a ``<think>`` at the start of its output (after whitespace) and ``</think>``,
  and an output that does not start with ``<think>`` is all content (thinking disabled, e.g.
  ``enable_thinking=False`` puts an empty ``<think>\\n\\n</think>`` in the prompt).

The whitespace between ``</think>`` and the answer is dropped; reasoning text is kept as written.
Streaming holds back only what might be the start of a tag (``</thi`` at the end of a delta), so the
deltas of any split of a text concatenate to :func:`split_reasoning` of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"

REASONING_PARSERS = ("qwen3", "deepseek_r1")
"""The ``--reasoning-parser`` names."""


def check_reasoning_parser(name: str | None) -> str | None:
    """``name`` if it is a known parser (or None).

    Raises:
        ValueError: an unknown name, listing the choices.
    """
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return name


@dataclass(frozen=True)
class ReasoningSplit:
    """What a piece of output holds: reasoning text and content text (either may be empty)."""

    reasoning: str = ""
    content: str = ""


_OPENING, _REASONING, _AFTER, _CONTENT = range(4)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Feeds output text in pieces; each `feed` returns the reasoning and content it can release.

    Args:
        parser: "qwen3" or "deepseek_r1".
        prompt: the prompt text (qwen3 reads whether it ends inside an open ``<think>``).
    """

    def __init__(self, parser: str, prompt: str | None = None) -> None:
        check_reasoning_parser(parser)
        inside = parser == "deepseek_r1" or (prompt is not None and prompt.rfind(START) > prompt.rfind(END))
        self._fallback = _REASONING if inside else _CONTENT  # when the output does not open with <think>
        self._state = _OPENING
        self._pending = ""
        self.saw_reasoning = inside

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the thinking (or may still open it)."""
        return self._state == _REASONING or (self._state == _OPENING and self._fallback == _REASONING)

    def feed(self, text: str) -> ReasoningSplit:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            state, pending = self._state, self._pending
            if state == _OPENING:
                stripped = pending.lstrip()
                if stripped.startswith(START):
                    self._pending, self._state, self.saw_reasoning = stripped[len(START) :], _REASONING, True
                elif START.startswith(stripped):
                    break  # whitespace or a partial <think>: wait
                else:
                    self._state = self._fallback
            elif state == _REASONING:
                end = pending.find(END)
                if end >= 0:
                    reasoning.append(pending[:end])
                    self._pending, self._state = pending[end + len(END) :], _AFTER
                else:
                    keep = _held_prefix(pending, END)
                    reasoning.append(pending[: len(pending) - keep])
                    self._pending = pending[len(pending) - keep :]
                    break
            elif state == _AFTER:
                stripped = pending.lstrip()
                self._pending = stripped
                if not stripped:
                    break
                self._state = _CONTENT
            else:
                content.append(pending)
                self._pending = ""
        return ReasoningSplit("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningSplit:
        """Release what was held back at the end of the output."""
        pending, self._pending = self._pending, ""
        state = self._fallback if self._state == _OPENING else self._state
        if state == _REASONING:
            return ReasoningSplit(reasoning=pending)
        if state == _CONTENT:
            return ReasoningSplit(content=pending)
        return ReasoningSplit()


def split_reasoning(parser: str, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; None for an empty part. See the module docstring."""
    stream = ReasoningStream(parser, prompt)
    a, b = stream.feed(text), stream.finish()
    reasoning, content = a.reasoning + b.reasoning, a.content + b.content
    return (reasoning if stream.saw_reasoning and reasoning else None), (content or None)
