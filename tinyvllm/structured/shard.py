"""A grammar shard: the xgrammar matchers of a subset of the constrained sequences, and one step's work on them.

A `GrammarWorkerPool` (structured/workers.py) runs one shard per worker process, so that several cores
accept tokens and fill mask rows at once: xgrammar's `accept_token` and its fill are CPU work of a few
microseconds per row, which on one core is longer than a batch-256 decode step on the GPU. The shard
holds, per sequence, its matcher and the tokens it accepted (for `rollback`); the engine's process keeps
everything else (the reasoning gate, which rows a step samples, the requests' fates).

A step is `accept` (one token per sequence; reports the sequences whose token was rejected and those
whose grammar it completed), then `fill` (each sequence's mask row into `out` [rows, W] int32,
xgrammar's packed layout: the grammar's allowed tokens ANDed with the UTF-8 guard; reports the rows
that allow nothing, dead ends). The row of a sequence whose grammar the step's token completed is left
to the engine, for which that row is no longer constrained.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from tinyvllm.structured.utf8_guard import Utf8Guard


class GrammarShard:
    """The matchers of some sequences (module docstring).

    Args:
        tokenizer_info: the vocabulary (`xgrammar.TokenizerInfo`); its stop tokens are the only ones after
            which a grammar can complete.
        utf8_guard: the vocabulary's `Utf8Guard` (built from `tokenizer_info` when not given).
    """

    def __init__(self, tokenizer_info: Any, utf8_guard: Utf8Guard | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.tokenizer_info = tokenizer_info
        self.stop_token_ids = frozenset(tokenizer_info.stop_token_ids)
        self.utf8_guard = utf8_guard or Utf8Guard(tokenizer_info.decoded_vocab)
        self.grammars: dict[Any, Any] = {}  # constraint key -> xgrammar.CompiledGrammar
        # a sequence's id (the engine's name for it here) -> its xgrammar.GrammarMatcher, its accepted tokens
        self.matchers: dict[Hashable, Any] = {}
        self.accepted: dict[Hashable, list[int]] = {}
        self._batch = xgr.BatchGrammarMatcher(1)  # fills on the calling thread (no thread start-up per call)

    def add_grammar(self, key: Any, serialized: str) -> None:
        """Register a compiled grammar (`CompiledGrammar.serialize_json`) under `key`."""
        if key not in self.grammars:
            self.grammars[key] = self._xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)

    def add(self, sid: Hashable, key: Any, accepted: Sequence[int] = ()) -> None:
        """A matcher for sequence `sid` on the grammar of `key`, advanced by `accepted` (its tokens so far)."""
        matcher = self._xgr.GrammarMatcher(self.grammars[key])
        for token in accepted:
            if not matcher.accept_token(token):
                raise ValueError(f"token {token} of sequence {sid}'s accepted output is not in its grammar")
        self.matchers[sid] = matcher
        self.accepted[sid] = list(accepted)

    def remove(self, sid: Hashable) -> None:
        self.matchers.pop(sid, None)
        self.accepted.pop(sid, None)

    def rollback(self, sid: Hashable, num_tokens: int) -> bool:
        """Undo sequence `sid`'s last `num_tokens` accepted tokens; returns whether its grammar is complete
        after it."""
        matcher = self.matchers[sid]
        if num_tokens:
            if num_tokens > len(self.accepted[sid]):
                raise ValueError(f"rollback of {num_tokens} tokens past the grammar's start")
            matcher.rollback(num_tokens)
            del self.accepted[sid][-num_tokens:]
        return matcher.is_terminated()

    def accept(self, accept_ids: Sequence[Hashable], tokens: Sequence[int]) -> tuple[list, list]:
        """Accept `tokens[i]` into the matcher of `accept_ids[i]` (sequences are named by whatever id they
        were added under). Returns (the ids whose token was rejected, leaving the matcher as it was; the
        ids whose grammar the token completed)."""
        rejected: list = []
        terminated: list = []
        if not accept_ids:
            return rejected, terminated
        matchers = self.matchers
        ok = self._xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in accept_ids], list(tokens))
        stops = self.stop_token_ids
        accepted = self.accepted
        for sid, token, good in zip(accept_ids, tokens, ok):
            if not good:
                rejected.append(sid)
                continue
            accepted[sid].append(token)
            if token in stops and matchers[sid].is_terminated():
                terminated.append(sid)
        return rejected, terminated

    def fill(self, fill_ids: Sequence[Hashable], rows: Sequence[int], out: np.ndarray, skip: Sequence = ()) -> list:
        """Fill the mask row of `fill_ids[j]` into `out[rows[j]]` ([rows, W] int32), the UTF-8 guard
        applied, except the ids in `skip` (grammars the step's token completed: their rows are the
        engine's). Returns the ids whose row allows no token."""
        if skip:
            skipped = set(skip)
            kept = [(sid, row) for sid, row in zip(fill_ids, rows) if sid not in skipped]
            fill_ids, rows = [sid for sid, _ in kept], [row for _, row in kept]
        if not fill_ids:
            return []
        rows = list(rows)
        self._batch.batch_fill_next_token_bitmask([self.matchers[sid] for sid in fill_ids], out, rows)
        accepted = self.accepted
        self.utf8_guard.apply(out, rows, [acc[-1] if (acc := accepted[sid]) else None for sid in fill_ids])
        return [fill_ids[j] for j in empty_rows(out, rows)]


PREFIX_WORDS = 64
"""Words of a mask row `empty_rows` reads first: nearly every live row has an allowed token among its
first 2,048 ids, so only the rest are read whole (reading every row whole costs ~0.5 ms at 256 rows)."""


def empty_rows(words: np.ndarray, rows: Sequence[int]) -> list[int]:
    """The positions j in `rows` whose packed mask row `words[rows[j]]` ([*, W] int32) allows no token."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return []
    head = np.bitwise_or.reduce(words[rows, :PREFIX_WORDS], axis=1)
    maybe = np.flatnonzero(head == 0)
    if not len(maybe):
        return []
    if words.shape[1] <= PREFIX_WORDS:
        return [int(j) for j in maybe]
    rest = np.bitwise_or.reduce(words[rows[maybe], PREFIX_WORDS:], axis=1)
    return [int(j) for j in maybe[rest == 0]]
