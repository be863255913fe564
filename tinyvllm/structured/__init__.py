"""Structured outputs: constrained decoding with xgrammar (JSON schema, regex, choice, EBNF grammar).

Modules, one job each:

* `vocab`: xgrammar's view of our tokenizer's vocabulary;
* `compiler`: constraint -> compiled grammar, cached by its text, compiled on a thread pool;
* `matcher`: one sequence's grammar state (accept, rollback, termination, reasoning gate);
* `manager`: the engine's grammars and each step's token bitmask;
* `reasoning_gate`: which text ends a reasoning model's thinking (pure Python).

The bitmask is applied in the samplers (sampling/bitmask.py, kernels/sampling.py). xgrammar is imported
only when a constraint is compiled, so `import tinyvllm` does not pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinyvllm.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "validate"]


def validate(
    params: StructuredOutputsParams,
    tokenizer: Any,
    vocab_size: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
) -> None:
    """Check that a constraint compiles and can be satisfied; compiles it (cached for the process).

    Blocks while compiling (milliseconds for a typical schema; call it from a worker thread in a
    server, or use `submit_validation`).

    Args:
        params: the constraint.
        tokenizer: the model's `tinyvllm.tokenizer.Tokenizer`.
        vocab_size: the model's logits width (default: the tokenizer's).
        stop_token_ids: the engine's EOS ids (default: the tokenizer's EOS).

    Raises:
        TypeError: `params` is not a StructuredOutputsParams.
        ValueError: the schema, regex, grammar or choice is invalid or unsatisfiable; the message
            names the kind and what is wrong.
    """
    submit_validation(params, tokenizer, vocab_size, stop_token_ids).result()


def submit_validation(
    params: StructuredOutputsParams,
    tokenizer: Any,
    vocab_size: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
):
    """`validate` as a `concurrent.futures.Future` (compiled on the compiler's threads); its `result()`
    raises as `validate` does. An asyncio caller awaits `asyncio.wrap_future(...)`."""
    from tinyvllm.structured.compiler import compiler_for

    if not isinstance(params, StructuredOutputsParams):
        raise TypeError(f"structured_outputs must be a StructuredOutputsParams, not {type(params).__name__}")
    return compiler_for(tokenizer, vocab_size, stop_token_ids).submit(params)
