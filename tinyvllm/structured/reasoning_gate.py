"""Which text ends a reasoning model's thinking, by reasoning parser name (vLLM's ``--reasoning-parser``).

A constrained request of an engine started with a reasoning parser is unconstrained while the model
thinks: its grammar starts after the model has emitted the end-of-thinking text. The engine resolves
that text to token ids once (`end_token_ids`); the server's reasoning parsers split the output text at
the same text. Pure Python: the server imports it without xgrammar or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REASONING_END_TEXT: dict[str, str] = {
    "qwen3": "</think>",
    "deepseek_r1": "</think>",
}
"""Reasoning parser name -> the text that ends the model's thinking."""

REASONING_START_TEXT: dict[str, str] = {"qwen3": "<think>", "deepseek_r1": "<think>"}
"""Reasoning parser name -> the text that opens it (a chat template may put it, or a closed empty block, in
the prompt: Qwen3's with ``enable_thinking=False`` ends the prompt with ``<think>\n\n</think>\n\n``)."""


def end_token_ids(tokenizer: Any, parser: str) -> tuple[int, ...]:
    """The token ids of `parser`'s end-of-thinking text in `tokenizer`'s vocabulary (a single id where
    the text is one special token, as in Qwen3 and DeepSeek-R1).

    Raises:
        ValueError: an unknown parser name.
    """
    if parser not in REASONING_END_TEXT:
        raise ValueError(f"unknown reasoning parser {parser!r}; expected one of {sorted(REASONING_END_TEXT)}")
    return tuple(tokenizer.encode(REASONING_END_TEXT[parser], add_special_tokens=False))


def start_token_ids(tokenizer: Any, parser: str) -> tuple[int, ...]:
    """The token ids of `parser`'s start-of-thinking text (see `end_token_ids`)."""
    if parser not in REASONING_START_TEXT:
        raise ValueError(f"unknown reasoning parser {parser!r}; expected one of {sorted(REASONING_START_TEXT)}")
    return tuple(tokenizer.encode(REASONING_START_TEXT[parser], add_special_tokens=False))


def _last_at(ids: Sequence[int], pattern: Sequence[int]) -> int | None:
    """The index of the last occurrence of `pattern` in `ids`, or None."""
    k = len(pattern)
    for i in range(len(ids) - k, -1, -1):
        if list(ids[i : i + k]) == list(pattern):
            return i
    return None


def prompt_closed_thinking(prompt_token_ids: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int]) -> bool:
    """Whether the prompt's last thinking block is already closed (its last end-of-thinking comes after
    its last start), so the output starts as the answer: the constraint applies from the first token."""
    if not end_ids:
        return False
    end = _last_at(prompt_token_ids, end_ids)
    if end is None:
        return False
    start = _last_at(prompt_token_ids, start_ids) if start_ids else None
    return start is None or start < end


def reasoning_ended(output_token_ids: Sequence[int], end_ids: Sequence[int]) -> int | None:
    """The number of output tokens up to and including the first occurrence of `end_ids`, or None
    when the model has not emitted it yet."""
    k = len(end_ids)
    if k == 0:
        return 0
    first = end_ids[0]
    for i, token in enumerate(output_token_ids):
        if token == first and list(output_token_ids[i : i + k]) == list(end_ids):
            return i + k
    return None
