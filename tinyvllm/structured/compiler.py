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


_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # values there are data, not schemas


def length_bounds_as_patterns(schema: Any) -> Any:
    """A copy of a JSON schema in which a string's minLength/maxLength (without a pattern) become a
    pattern of that many characters other than a quote, a backslash or a control character
    (U+0000..U+001F).

    xgrammar 0.2.9 compiles a length-bounded string to "any character but a quote, a backslash, CR or
    LF", which lets other control characters such as U+0008 in unescaped: not JSON. Its patterns are
    matched as JSON string content, so the rewritten schema allows the same strings, as valid JSON.
    Bounds that are not integers, or contradict each other, are left for xgrammar to reject.
    """
    if isinstance(schema, list):
        return [length_bounds_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYS else length_bounds_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        if isinstance(low, int) and (high is None or (isinstance(high, int) and low <= high)):
            upper = "" if high is None else high
            out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{upper}}}$'
        else:  # not integers: leave them for xgrammar to reject
            out["minLength"], out["maxLength"] = low, high
    return out


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
                schema = json.loads(params.json) if isinstance(params.json, str) else params.json
                schema = json.dumps(length_bounds_as_patterns(schema))
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
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid structured_outputs.json: the schema is not valid JSON ({e})") from None
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
