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


def end_token_ids(tokenizer: Any, parser: str) -> tuple[int, ...]:
    """The token ids of `parser`'s end-of-thinking text in `tokenizer`'s vocabulary (a single id where
    the text is one special token, as in Qwen3 and DeepSeek-R1).

    Raises:
        ValueError: an unknown parser name.
    """
    if parser not in REASONING_END_TEXT:
        raise ValueError(f"unknown reasoning parser {parser!r}; expected one of {sorted(REASONING_END_TEXT)}")
    return tuple(tokenizer.encode(REASONING_END_TEXT[parser], add_special_tokens=False))


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
