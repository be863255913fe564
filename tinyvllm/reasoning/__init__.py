"""Reasoning parsers: split a model's output into its thinking (``reasoning_content``) and its answer
(``content``), as vLLM's ``--reasoning-parser`` does. See :mod:`tinyvllm.reasoning.think`."""

from tinyvllm.reasoning.think import (
    REASONING_PARSERS,
    ReasoningSplit,
    ReasoningStream,
    check_reasoning_parser,
    split_reasoning,
)

__all__ = ["REASONING_PARSERS", "ReasoningSplit", "ReasoningStream", "check_reasoning_parser", "split_reasoning"]
