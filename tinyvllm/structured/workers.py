"""Grammar worker processes: constrained rows accepted and filled on several cores at once.

At batch 256 a decode step's grammar work (xgrammar's `accept_token` and mask fill, ~4-16 µs a row) takes
longer on one core than the GPU takes for the step, and Python threads do not spread it: the accept holds
the GIL, and the fills measured no faster on 2-8 threads (docs/perf.md §10). `GrammarWorkerPool` runs
`num_workers` processes (`python -m tinyvllm.structured.grammar_worker`), each a `GrammarShard` holding
the matchers of the sequences placed on it; the engine's `StructuredOutputManager` places each new
constrained sequence on the least-loaded worker and, each step, sends every worker its rows' tokens and
mask rows in one message: each answers the accept at once (the engine needs to know which requests
ended) and fills its rows while the engine goes on with the step, reading the fill answers only
before the mask is copied to the device.

The mask rows are written straight into the step's host bitmask: `host_masks` allocates the engine's
two alternating bitmask buffers in shared memory (registered with CUDA as page-locked, so their copies
to the device stay asynchronous), which the workers attach by name.

Workers start in the background (each imports xgrammar and decodes the vocabulary, ~1-5 s); sequences
that need a matcher before any worker is ready start in the engine's process, and the manager moves them
over afterwards. A worker that fails to start is left out (logged); with none, everything stays in the
engine's process.
Workers are separate interpreters started by `subprocess` (not `multiprocessing`'s spawn, which would
re-run a user's unguarded script), connected by a `multiprocessing.Pipe` whose end they inherit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from multiprocessing import Pipe, shared_memory
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def default_num_workers(cpu_count: int | None = None) -> int:
    """Grammar workers by default: a quarter of the cores, at most 4, none below 8 cores (there the
    engine's own process, its server and the device's driver threads already hold the cores). More
    workers cost the engine a message and an answer each per step; docs/perf.md §10 has the
    measurements behind the choice."""
    cpus = os.cpu_count() if cpu_count is None else cpu_count
    return 0 if cpus is None or cpus < 8 else min(4, cpus // 4)


ANSWER_TIMEOUT_S = 60.0
"""Longest wait for a worker's answer before the engine declares it hung (a step's answer takes
milliseconds; a rollback replays nothing)."""


class WorkerError(RuntimeError):
    """A grammar worker failed or exited."""


class _Worker:
    """One worker process and the engine's side of its connection."""

    def __init__(self, index: int, tokenizer_info_json: str) -> None:
        self.index = index
        self.conn, child = Pipe()
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tinyvllm.structured.grammar_worker", str(child.fileno())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child.close()
        self.ready = threading.Event()
        self.settled = threading.Event()  # started or failed to
        self.failed: str | None = None
        self.keys: set[Any] = set()  # grammars this worker holds
        self.buffers: set[str] = set()  # mask buffers it has attached
        self.load = 0  # live sequences placed on it
        self.fills_due = 0  # fill answers sent for and not read yet
        # The vocabulary is sent, and its answer awaited, off the caller's thread: the worker reads it
        # only once its imports are done.
        self._starter = threading.Thread(target=self._start, args=(tokenizer_info_json,), daemon=True)
        self._starter.start()

    def _start(self, tokenizer_info_json: str) -> None:
        try:
            self.conn.send(("init", tokenizer_info_json))
            answer = self.conn.recv()
            if answer != ("ready",):
                raise WorkerError(f"unexpected answer {answer!r}")
            self.ready.set()
        except Exception as e:
            self.failed = str(e) or type(e).__name__
            logger.warning("grammar worker %d did not start: %s", self.index, self.failed)
        finally:
            self.settled.set()

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (OSError, EOFError) as e:
            raise WorkerError(f"grammar worker {self.index} exited ({e})") from None

    def recv(self) -> Any:
        try:
            if not self.conn.poll(ANSWER_TIMEOUT_S):
                raise WorkerError(f"grammar worker {self.index} did not answer in {ANSWER_TIMEOUT_S:.0f} s")
            answer = self.conn.recv()
        except (OSError, EOFError) as e:
            raise WorkerError(f"grammar worker {self.index} exited ({e})") from None
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise WorkerError(f"grammar worker {self.index} failed:\n{answer[1]}")
        return answer

    def stop(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.conn.send(("stop",))
        self.conn.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()


class _Buffer:
    """A host bitmask buffer in shared memory, page-locked for CUDA when `pin`."""

    def __init__(self, rows: int, width: int, pin: bool) -> None:
        self.segment = shared_memory.SharedMemory(create=True, size=max(1, rows * width * 4))
        self.array = np.ndarray((rows, width), dtype=np.int32, buffer=self.segment.buf)
        self.tensor = torch.from_numpy(self.array)
        self.pinned = False
        if pin:
            nbytes = rows * width * 4
            code = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister of the grammar mask buffer failed ({code})")
            self.pinned = True

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        with contextlib.suppress(FileNotFoundError):
            self.segment.unlink()


class GrammarWorkerPool:
    """`num_workers` grammar worker processes (module docstring).

    Args:
        tokenizer_info: the vocabulary (`xgrammar.TokenizerInfo`), sent to each worker.
        num_workers: processes to start (at least 1).
    """

    def __init__(self, tokenizer_info: Any, num_workers: int) -> None:
        assert num_workers >= 1
        info_json = tokenizer_info.serialize_json()
        self.workers = [_Worker(i, info_json) for i in range(num_workers)]
        self._buffers: dict[int, _Buffer] = {}  # data_ptr -> buffer
        # close() when the pool is collected or the interpreter exits without it: no orphan segments
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, self._buffers)

    # ------------------------------------------------------------------ placement
    def pick(self) -> int | None:
        """The least-loaded ready worker, or None when none is ready yet."""
        ready = [w for w in self.workers if w.ready.is_set()]
        return None if not ready else min(ready, key=lambda w: w.load).index

    def add(self, worker: int, sid: int, key: Any, compiled: Any, accepted: Sequence[int]) -> None:
        """Place sequence `sid` on `worker`: its grammar (`compiled`, sent once per key) and its tokens so far."""
        w = self.workers[worker]
        if key not in w.keys:
            w.send(("grammar", key, compiled.serialize_json()))
            w.keys.add(key)
        w.send(("add", sid, key, list(accepted)))
        w.load += 1

    def remove(self, worker: int, sid: int) -> None:
        w = self.workers[worker]
        w.send(("remove", sid))
        w.load -= 1

    def rollback(self, worker: int, sid: int, num_tokens: int) -> bool:
        """Undo a sequence's last `num_tokens` tokens; returns whether its grammar is complete after it."""
        w = self.workers[worker]
        w.send(("rollback", sid, num_tokens))
        return bool(w.recv())

    # ------------------------------------------------------------------ steps
    def send_step(
        self,
        worker: int,
        accept_ids: Sequence[int],
        tokens: Sequence[int],
        fill_ids: Sequence[int],
        rows: Sequence[int],
        out: torch.Tensor | None,
    ) -> None:
        """Start a worker's part of a step: accept `tokens` into `accept_ids`' grammars, then fill the rows
        `rows` of `out` (which must begin one of `host_masks`' buffers). Read its answers with
        `recv_accept` (when `accept_ids` is not empty) and then `recv_fills`."""
        w = self.workers[worker]
        name = None
        if fill_ids:
            buffer = self._buffers.get(out.data_ptr()) if out is not None else None
            if buffer is None:
                raise ValueError("a grammar worker fills only the buffers of GrammarWorkerPool.host_masks")
            name = buffer.segment.name
            if name not in w.buffers:
                w.send(("buffer", name, *buffer.array.shape))
                w.buffers.add(name)
            w.fills_due += 1
        w.send(("step", name, accept_ids, tokens, fill_ids, rows))

    def recv_accept(self, worker: int) -> tuple[list[int], list[int]]:
        """The accept answer of the worker's last step: (rejected sids, completed sids). The worker fills
        its rows meanwhile."""
        rejected, terminated = self.workers[worker].recv()
        return rejected, terminated

    def recv_fills(self, worker: int) -> list[int]:
        """Every fill answer the worker owes, in order: the sids whose rows allow no token."""
        w = self.workers[worker]
        dead: list[int] = []
        while w.fills_due:
            w.fills_due -= 1
            dead += w.recv()
        return dead

    def fills_due(self) -> list[int]:
        """The workers that owe a fill answer."""
        return [w.index for w in self.workers if w.fills_due]

    # ------------------------------------------------------------------ buffers
    def host_masks(self, rows: int, width: int, pin: bool) -> list[torch.Tensor]:
        """Two host bitmask buffers [rows, width] int32 in shared memory (page-locked when `pin`)."""
        out = []
        for _ in range(2):
            buffer = _Buffer(rows, width, pin)
            self._buffers[buffer.tensor.data_ptr()] = buffer
            out.append(buffer.tensor)
        return out

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._buffers

    def close(self) -> None:
        """Stop the workers and free the buffers (those still in use by the engine stay mapped)."""
        self._finalizer()


def _shut_down(workers: list[_Worker], buffers: dict[int, _Buffer]) -> None:
    for w in workers:
        w.stop()
    for buffer in buffers.values():
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            buffer.release()
