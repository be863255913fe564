"""The engine's side of structured outputs: each constrained sequence's grammar, the step's bitmask.

`StructuredOutputManager` (one per engine, built on the first constrained request: importing xgrammar
costs ~0.3 s) compiles through the process's `GrammarCompiler` (futures, off the step loop), keeps a
`RequestGrammar` per constrained sequence, and fills a step's token bitmask: xgrammar's packed int32
layout, row r bit j of word w allowing token 32·w + j, [rows, ceil(V / 32)]. It fills the constrained
rows of the step with `xgrammar.BatchGrammarMatcher` (one C++ call, the GIL released) and the other
rows with all ones (structured/utf8_guard.py then removes the tokens that would make ill-formed UTF-8);
a step without constrained rows gets no bitmask at all, so it runs exactly the
kernels it runs without this feature.

Each step's host work is per row only where it must be: one `accept_token` per row (xgrammar's
`batch_accept_token` measured slower than the loop, benchmarks/bench_structured_host.py), the
termination check only after a stop token, the active rows read from Python flags, no fill of the
constrained rows before xgrammar's (it writes whole rows), the UTF-8 guard on the few rows that need it
and the dead-row check reading whole rows only where their first words are zero (`shard.empty_rows`).

With `num_workers`, the matchers of a large batch live in grammar worker processes instead
(structured/workers.py): each sequence is placed on one at its first use once the engine holds
`WORKER_MIN_SEQUENCES` constrained sequences, and each step's tokens and mask rows go to the workers in
one message each, so the accepts and fills of a batch run on several cores.

A step that accepts the previous step's tokens before filling its own mask (async scheduling: the
runner's `before_mask`) overlaps the two: `begin_fill` names the step's rows and buffer, `accept_tokens`
hands each chunk of `FILL_CHUNK` rows, once accepted, to a pool of worker threads that fill their mask
rows (xgrammar's fill releases the GIL; chunks write disjoint rows, so several fill at once) while the
next chunk is accepted, and `finish_fill` fills the rows
no chunk covered, waits for the worker and applies the guard. A row's mask is filled after its token is
accepted and before anything else touches its matcher, so the mask is the one `fill` computes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tinyvllm.sampling.bitmask import bitmask_width
from tinyvllm.sampling_params import StructuredOutputsParams
from tinyvllm.structured.compiler import compiler_for
from tinyvllm.structured.matcher import RequestGrammar
from tinyvllm.structured.reasoning_gate import prompt_closed_thinking
from tinyvllm.structured.shard import empty_rows
from tinyvllm.structured.utf8_guard import Utf8Guard

FILL_CHUNK = 32
"""Rows per fill handed to a worker thread while `accept_tokens` accepts the next ones. A step of at most
this many rows fills on the caller's thread (a hand-over costs more than such a step's fill)."""
WORKER_MIN_SEQUENCES = 16
"""Constrained sequences an engine must hold (running, waiting or compiling) before they go to grammar
workers: below it a step's grammar work (~5-10 µs a row) is shorter than a round trip to a worker
(~50-100 µs), so the sequences stay in the engine's process, and move to the workers (their accepted
tokens replayed there) once there are this many."""
FILL_THREADS = 1
"""Worker threads that fill accepted chunks of a step's mask. One: on the 2-core development machine two
fills at once took as long as one after the other (471 against 460 µs for 256 rows, the GIL released), and
on the 16-core H200 host the overlapped accept + fill of 256 rows took 4.0 ms a step with one thread and
4.3–5.1 ms with 2–8 (`python -m benchmarks.bench_structured_host --fill-threads N`, docs/perf.md §10)."""


@dataclass
class _PendingFill:
    """A step's mask being filled (`begin_fill` .. `finish_fill`)."""

    request_ids: Sequence[str]
    out: torch.Tensor
    index: dict[str, int]  # request id -> its row
    submitted: set[int] = field(default_factory=set)  # rows handed to the worker
    futures: list[Future] = field(default_factory=list)


class StructuredOutputManager:
    """Grammars of an engine's constrained sequences (module docstring).

    Args:
        tokenizer: the engine's `Tokenizer`.
        vocab_size: the model's logits width.
        eos_token_ids: the engine's EOS ids (the grammars' stop tokens).
        reasoning_end_ids: token ids that end thinking (`reasoning_gate.end_token_ids`); None: no gate.
        reasoning_start_ids: token ids that open it (`reasoning_gate.start_token_ids`).
        fill_threads: worker threads filling the rows held in this process.
        num_workers: grammar worker processes (structured/workers.py); 0: every matcher in this process.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        reasoning_end_ids: Sequence[int] | None = None,
        reasoning_start_ids: Sequence[int] | None = None,
        fill_threads: int = FILL_THREADS,
        num_workers: int = 0,
    ) -> None:
        import xgrammar as xgr

        self.compiler = compiler_for(tokenizer, vocab_size, list(eos_token_ids))
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.reasoning_end_ids = reasoning_end_ids
        self.reasoning_start_ids = reasoning_start_ids
        self.grammars: dict[str, RequestGrammar] = {}
        self.stop_token_ids = frozenset(self.compiler.tokenizer_info.stop_token_ids)
        # xgrammar's batch fill on one thread per call: its own threads start on every call, which costs
        # ~110 µs with 2 threads and ~400 µs with 8 (the H200 host's "auto") even for one row, more than
        # the fill itself (~2-7 µs per row). Parallel fills run on our persistent workers instead, each
        # chunk of rows on one of them with that thread's own single-threaded BatchGrammarMatcher.
        self._batch = xgr.BatchGrammarMatcher(1)
        self._new_batch = xgr.BatchGrammarMatcher
        self._worker_local = threading.local()
        self._worker = ThreadPoolExecutor(fill_threads, thread_name_prefix="grammar-fill")
        self._pending: _PendingFill | None = None
        self._dead: list[str] = []
        self._compiling: set[str] = set()  # sequences whose grammar's future was not seen done yet
        self.utf8_guard = Utf8Guard(self.compiler.tokenizer_info.decoded_vocab)
        self._keys: dict[str, Any] = {}  # request id -> its constraint's key (the worker's grammar cache)
        self._held_here: set[str] = set()  # sequences whose matcher was made in this process
        self._sids: dict[int, str] = {}  # a worker's name for a sequence placed on it -> its request id
        self._next_sid = 0
        self.worker_min_sequences = WORKER_MIN_SEQUENCES
        self.pool = None
        if num_workers > 0:
            from tinyvllm.structured.workers import GrammarWorkerPool

            self.pool = GrammarWorkerPool(self.compiler.tokenizer_info, num_workers)

    def wait_for_workers(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until every grammar worker has started or failed to; whether they
        all started."""
        if self.pool is None:
            return True
        return all(w.settled.wait(timeout) and w.ready.is_set() for w in self.pool.workers)

    def close(self) -> None:
        """Stop the grammar workers, if any."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def host_masks(self, rows: int, pin: bool) -> list[torch.Tensor]:
        """Two host bitmask buffers [rows, width] int32 for the steps to alternate between (page-locked
        when `pin`); with grammar workers, in the shared memory they fill."""
        if self.pool is not None:
            return self.pool.host_masks(rows, self.width, pin)
        return [torch.empty((rows, self.width), dtype=torch.int32, pin_memory=pin) for _ in range(2)]

    def fills_into(self, buffer: torch.Tensor) -> bool:
        """Whether the manager can fill `buffer` (one of `host_masks`' when there are workers)."""
        return self.pool is None or self.pool.owns(buffer)

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile `params` now (cached); raises ValueError naming what is wrong."""
        self.compiler.compile(params)

    def add(
        self, request_id: str, params: StructuredOutputsParams, prompt_token_ids: Sequence[int] = ()
    ) -> RequestGrammar:
        """Start compiling a sequence's grammar (cached by its text); returns its state. With a reasoning
        gate, a prompt that already closed its thinking block opens the gate from the first token."""
        closed = self.reasoning_end_ids is not None and prompt_closed_thinking(
            prompt_token_ids, self.reasoning_start_ids or (), self.reasoning_end_ids
        )
        grammar = RequestGrammar(self.compiler.submit(params), self.reasoning_end_ids, closed, self.stop_token_ids)
        self.grammars[request_id] = grammar
        self._keys[request_id] = params.key
        self._compiling.add(request_id)
        return grammar

    def remove(self, request_id: str) -> None:
        grammar = self.grammars.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._compiling.discard(request_id)
        self._held_here.discard(request_id)
        if grammar is not None and grammar.worker is not None and self.pool is not None:
            self.pool.remove(grammar.worker, grammar.sid)
            del self._sids[grammar.sid]

    def _worker_of(self, request_id: str, grammar: RequestGrammar) -> int | None:
        """Where the sequence's matcher lives: a grammar worker's index, or None (this process). Chosen at
        its first use: the least-loaded ready worker once the engine holds `worker_min_sequences`
        (default `WORKER_MIN_SEQUENCES`) constrained sequences, else this process (until `_move_to_workers`)."""
        if grammar.worker is None and request_id not in self._held_here:  # not placed yet
            worker = self._pick_worker()
            if worker is None:
                self._held_here.add(request_id)
            else:
                self._place(request_id, grammar, worker)
        return grammar.worker

    def _pick_worker(self) -> int | None:
        if self.pool is None or len(self.grammars) < self.worker_min_sequences:
            return None
        return self.pool.pick()

    def _place(self, request_id: str, grammar: RequestGrammar, worker: int) -> None:
        """Put the sequence's matcher on `worker`, advanced by the tokens it accepted so far."""
        sid, self._next_sid = self._next_sid, self._next_sid + 1
        self.pool.add(worker, sid, self._keys[request_id], grammar.compiled.result(), grammar.accepted)
        self._sids[sid] = request_id
        grammar.worker, grammar.sid = worker, sid
        grammar.matcher = None
        grammar.remote_rollback = functools.partial(self.pool.rollback, worker, sid)

    def _move_to_workers(self) -> None:
        """Move the sequences held in this process to the workers, once they are ready and the engine holds
        enough constrained sequences (between steps: no fill of this process is pending)."""
        if not self._held_here or self._pick_worker() is None:
            return
        for rid in self._held_here:
            self._place(rid, self.grammars[rid], self.pool.pick())
        self._held_here.clear()

    def failed(self) -> list[tuple[str, str]]:
        """(request id, error) of the sequences whose grammar failed to compile since the last call;
        they are forgotten. Looks only at the grammars not yet seen compiled."""
        out = []
        for rid in [r for r in self._compiling if self.grammars[r].compiled.done()]:
            self._compiling.discard(rid)
            error = self.grammars[rid].failure()
            if error is not None:
                out.append((rid, error))
                self.remove(rid)
        return out

    def wait_for_compile(self, timeout: float) -> None:
        """Block up to `timeout` seconds until some compiling grammar is done (the engine has nothing
        else to run)."""
        pending = [self.grammars[r].compiled for r in self._compiling]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def has_grammar(self, request_ids: Sequence[str]) -> bool:
        """Whether any of these sequences has a grammar (active or not: dict lookups only)."""
        grammars = self.grammars
        return any(rid in grammars for rid in request_ids)

    def any_constrained(self, request_ids: Sequence[str]) -> bool:
        """Whether `constrained_rows(request_ids)` is not empty (stops at the first such row)."""
        get = self.grammars.get
        return any((g := get(rid)) is not None and g.gate_open and not g.terminated for rid in request_ids)

    def constrained_rows(self, request_ids: Sequence[str]) -> list[int]:
        """The rows (indices into `request_ids`) whose next token the grammar constrains."""
        get = self.grammars.get
        return [
            i for i, rid in enumerate(request_ids) if (g := get(rid)) is not None and g.gate_open and not g.terminated
        ]

    def fill(self, request_ids: Sequence[str], rows: Sequence[int], out: torch.Tensor) -> None:
        """Fill `out` [len(request_ids), width] int32 (host): the grammar's allowed tokens in `rows`,
        all ones elsewhere. A constrained row that allows nothing is recorded (`take_dead`)."""
        if not rows:
            out.fill_(-1)
            return
        self._move_to_workers()
        local, remote = self._split_rows(request_ids, rows)
        self._send_fills(remote, out)
        if local:
            self._fill_rows(self._batch, self._matchers(request_ids, local), local, out)
        self._recv_fills()
        self._finish_rows(request_ids, rows, local, out)

    def begin_fill(self, request_ids: Sequence[str], out: torch.Tensor) -> None:
        """Start a step's mask into `out` [len(request_ids), width] int32 (host): the rows whose tokens
        the following `accept_tokens` accepts are filled on the worker thread (or by their grammar worker)
        as they are accepted (module docstring). `finish_fill` completes it."""
        assert self._pending is None, "finish_fill the previous step's mask first"
        self._move_to_workers()
        self._pending = _PendingFill(request_ids, out, {rid: i for i, rid in enumerate(request_ids)})

    def finish_fill(self) -> list[int]:
        """Complete the mask `begin_fill` started, as `fill(request_ids, constrained_rows(request_ids), out)`
        would, and return those rows; when there are none, `out` is left as it was."""
        pending, self._pending = self._pending, None
        assert pending is not None, "begin_fill first"
        ids = pending.request_ids
        rows = self.constrained_rows(ids)
        submitted = pending.submitted
        local_rest, remote = self._split_rows(ids, [i for i in rows if i not in submitted])
        self._send_fills(remote, pending.out)
        if local_rest:
            self._fill_rows(self._batch, self._matchers(ids, local_rest), local_rest, pending.out)
        for future in pending.futures:
            future.result()
        self._recv_fills()
        grammars = self.grammars
        local = [i for i in rows if grammars[ids[i]].worker is None] if self._held_here or self.pool is None else []
        self._finish_rows(ids, rows, local, pending.out)
        return rows

    def _split_rows(self, request_ids: Sequence[str], rows: Sequence[int]) -> tuple[list[int], dict[int, list]]:
        """`rows` as (those held in this process, {worker: ([sid], [row])})."""
        grammars = self.grammars
        local: list[int] = []
        remote: dict[int, tuple[list, list]] = {}
        for i in rows:
            grammar = grammars[request_ids[i]]
            worker = self._worker_of(request_ids[i], grammar)
            if worker is None:
                local.append(i)
            else:
                sids, where = remote.setdefault(worker, ([], []))
                sids.append(grammar.sid)
                where.append(i)
        return local, remote

    def _send_fills(self, remote: dict[int, tuple[list, list]], out: torch.Tensor) -> None:
        """Send each worker its fill-only step (`_recv_fills` reads the answers)."""
        for worker, (sids, rows) in remote.items():
            self.pool.send_step(worker, [], [], sids, rows, out)

    def _recv_accepts(self, sent: Sequence[int]) -> tuple[list[str], list[str]]:
        """Read the accept answers of these workers: completions into the grammars. Returns the (rejected,
        completed) request ids of all of them."""
        rejected: list[str] = []
        terminated: list[str] = []
        sids = self._sids
        for worker in sent:
            worker_rejected, worker_terminated = self.pool.recv_accept(worker)
            rejected += [sids[sid] for sid in worker_rejected]
            for sid in worker_terminated:
                rid = sids[sid]
                self.grammars[rid].terminated = True
                terminated.append(rid)
        return rejected, terminated

    def _recv_fills(self) -> None:
        """Wait for every fill a worker owes; their dead rows into `take_dead`'s list."""
        if self.pool is None:
            return
        sids = self._sids
        for worker in self.pool.fills_due():  # a sequence removed since its step was sent is left out
            self._dead += [rid for sid in self.pool.recv_fills(worker) if (rid := sids.get(sid)) is not None]

    def _submit_fill(self, pending: _PendingFill, rids: Sequence[str]) -> None:
        """Hand the rows of `rids` (just accepted) that are in the pending step and active to the worker."""
        grammars = self.grammars
        rows = [i for rid in rids if (i := pending.index.get(rid)) is not None and grammars[rid].is_active]
        if rows:
            pending.submitted.update(rows)
            matchers = self._matchers(pending.request_ids, rows)
            job = self._worker.submit(self._fill_on_worker, matchers, rows, pending.out)
            pending.futures.append(job)

    def _matchers(self, request_ids: Sequence[str], rows: Sequence[int]) -> list[Any]:
        grammars = self.grammars
        return [(g := grammars[request_ids[i]]).matcher or g.get_matcher() for i in rows]

    def _fill_on_worker(self, matchers: list[Any], rows: list[int], out: torch.Tensor) -> None:
        """`_fill_rows` on a worker thread, with that thread's own batch matcher."""
        batch = getattr(self._worker_local, "batch", None)
        if batch is None:
            batch = self._worker_local.batch = self._new_batch(1)
        self._fill_rows(batch, matchers, rows, out)

    @staticmethod
    def _fill_rows(batch: Any, matchers: list[Any], rows: list[int], out: torch.Tensor) -> None:
        """xgrammar's mask of each matcher into its row of `out` (whole rows; on either thread)."""
        batch.batch_fill_next_token_bitmask(matchers, out, rows)

    def _finish_rows(
        self, request_ids: Sequence[str], rows: Sequence[int], local: Sequence[int], out: torch.Tensor
    ) -> None:
        """All ones in the rows not in `rows`; the UTF-8 guard and the dead-row check in `local`, the rows
        filled in this process (a grammar worker applies both to its own rows)."""
        if not rows:
            return
        view = out.numpy()
        n = view.shape[0]
        if len(rows) < n:
            free = np.ones(n, dtype=bool)
            free[list(rows)] = False
            view[free] = -1
        if not local:
            return
        grammars = self.grammars
        self.utf8_guard.apply(view, local, [grammars[request_ids[i]].last_token for i in local])
        self._dead += [request_ids[local[j]] for j in empty_rows(view, local)]

    def take_dead(self) -> list[str]:
        """The request ids whose mask allowed nothing since the last call."""
        dead, self._dead = self._dead, []
        return dead

    def accept_tokens(
        self, items: Sequence[tuple[str, int, Sequence[int]]], while_waiting: Callable[[], None] | None = None
    ) -> tuple[list[str], list[str]]:
        """Advance the grammars of these sequences, each (request id, its new output token, all its
        output tokens with that one last), by their new token. Returns (the ids whose grammar rejected
        its token, the ids whose grammar is now complete). `while_waiting`: called once the workers have
        their tokens and this process has accepted its own, before their answers are read (work for the
        caller that does not need the answers); not called when no worker holds any of them.

        Sequences on grammar workers get their tokens, and under `begin_fill` their mask rows, in one
        message per worker, sent before this process accepts its own and read after."""
        grammars = self.grammars
        rejected: list[str] = []
        terminated: list[str] = []
        pending = self._pending
        local_items = items
        sent: list[int] = []
        if self.pool is not None:
            local_items = []
            remote: dict[int, tuple[list, list, list, list]] = {}  # worker -> (sids, tokens, fill sids, rows)
            index = None if pending is None else pending.index
            submitted = None if pending is None else pending.submitted
            for item in items:
                rid = item[0]
                grammar = grammars[rid]
                worker = grammar.worker  # placed on a worker only once its gate is open
                if worker is None:
                    if not grammar.gate_passes(item[2]):
                        continue  # still thinking (or the token that ends it): nothing for the matcher
                    worker = self._worker_of(rid, grammar)
                    if worker is None:  # held in this process: accepted below
                        local_items.append(item)
                        continue
                lists = remote.get(worker)
                if lists is None:
                    lists = remote[worker] = ([], [], [], [])
                sid = grammar.sid
                lists[0].append(sid)
                lists[1].append(item[1])
                if index is not None and (row := index.get(rid)) is not None:
                    lists[2].append(sid)
                    lists[3].append(row)
                    submitted.add(row)
            out = None if pending is None else pending.out
            for worker, (sids, tokens, fill_sids, rows) in remote.items():
                self.pool.send_step(worker, sids, tokens, fill_sids, rows, out)
                sent.append(worker)
        if pending is not None and len(pending.request_ids) <= FILL_CHUNK:
            pending = None  # finish_fill fills it all
        chunk = max(1, len(local_items) if pending is None else FILL_CHUNK)
        for start in range(0, len(local_items), chunk):
            part = local_items[start : start + chunk]
            for rid, token, output_token_ids in part:
                grammar = grammars[rid]
                if not grammar.accept(token, output_token_ids):
                    rejected.append(rid)
                elif grammar.terminated:
                    terminated.append(rid)
            if pending is not None:
                self._submit_fill(pending, [rid for rid, _, _ in part])
        if sent:
            if while_waiting is not None:
                while_waiting()
            remote_rejected, remote_terminated = self._recv_accepts(sent)
            rejected += remote_rejected
            terminated += remote_terminated
        return rejected, terminated
