"""Compiling constraints into xgrammar grammars: once per constraint text, on a thread pool.

`GrammarCompiler.submit(params)` returns a future of the compiled grammar. Futures are cached by the
constraint's key (`StructuredOutputsParams.key`: kind and canonical text), so a schema is compiled
once per process however many requests use it, and the engine's step loop only polls futures: a
large schema delays its own request, never the batch. xgrammar's compile releases the GIL.

A constraint is rejected (the future raises ValueError naming what is wrong) when xgrammar cannot
compile it (invalid JSON, an unsupported or contradictory schema such as minimum > maximum or an
empty enum, a regex or EBNF syntax error) or when its language is empty as far as the first token
shows: no token may start it and the empty output does not satisfy it.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tinyvllm.sampling_params import StructuredOutputsParams

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _message(error: Exception) -> str:
    """xgrammar's error text without its source-location prefix."""
    return _XGR_PREFIX.sub("", str(error).strip()).strip()


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles and caches the grammars of one vocabulary (module docstring).

    Args:
        tokenizer_info: the vocabulary (`tinyvllm.structured.vocab.build_tokenizer_info`).
        max_workers: threads compiling at once (each compile is one thread of xgrammar's).
    """

    def __init__(self, tokenizer_info: Any, max_workers: int = 2) -> None:
        import xgrammar as xgr

        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._futures: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of `params`' compiled grammar (`xgrammar.CompiledGrammar`); its `result()` raises
        ValueError for a constraint that cannot be compiled or satisfied. Cached by `params.key`."""
        key = params.key
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = self._pool.submit(self._compile, params)
        return future

    def compile(self, params: StructuredOutputsParams):
        """`submit(params).result()`: blocks until compiled. Raises ValueError as `submit`'s future does."""
        return self.submit(params).result()

    def _compile(self, params: StructuredOutputsParams):
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
            elif kind == "json_object":
                compiled = self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace, strict_mode=False
                )
            elif kind == "regex":
                compiled = self._compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = self._compiler.compile_grammar(choice_grammar(params.choice))
            else:
                compiled = self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid structured_outputs.{kind}: {_message(e)}") from None
        _check_satisfiable(compiled, kind, self.vocab_size)
        return compiled


def _check_satisfiable(compiled: Any, kind: str, vocab_size: int) -> None:
    """Raise ValueError when no output can satisfy the grammar: nothing may come first, and the empty
    output is not in its language."""
    import torch
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not matcher.is_completed() and not bool(torch.any(bitmask != 0)):
        raise ValueError(f"structured_outputs.{kind} cannot be satisfied: no output matches it")


_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None):
    """The process's `GrammarCompiler` for `tokenizer` (a `tinyvllm.tokenizer.Tokenizer`) and a logits
    width of `vocab_size` (default: the tokenizer's), built on first use: the vocabulary is decoded
    once per model. `stop_token_ids` default to the tokenizer's EOS."""
    from tinyvllm.structured.vocab import build_tokenizer_info

    vocab_size = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
    if stop_token_ids is None:
        stop_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    key = (vocab_size, tuple(stop_token_ids))
    with _COMPILERS_LOCK:
        by_key = _COMPILERS.setdefault(tokenizer, {})
        compiler = by_key.get(key)
        if compiler is None:
            compiler = by_key[key] = GrammarCompiler(build_tokenizer_info(tokenizer, vocab_size, stop_token_ids))
    return compiler
