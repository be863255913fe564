"""Rank 0 of a tensor-parallel group, in the engine's process: the engine's runner when TP > 1.

`TensorParallelRunner` has the ModelRunner methods the engine calls (`determine_num_blocks`,
`initialize`, `launch`) and runs each on every rank: it broadcasts the command (for a step, the
pickled SchedulerOutput, the only contract with the workers, as in vLLM v1), then runs it on its own
shard. The scheduler, the KV-cache manager, the grammars and the output processing stay here.

Faults: before each command the driver polls its machine's workers; a dead one, or a collective that
fails (gloo: the peer closed its connection) or times out (`distributed_timeout_s`: a hung rank), raises
`WorkerDiedError` out of the engine's step instead of hanging, and every later call raises it again. A
step's command itself is sent with that deadline too (distributed/commands.py): a rank stopped while it
waited for the command would otherwise block the sending broadcast for good.
`shutdown` stops the workers (and kills any that do not stop within seconds); it also runs when the
driver is garbage collected or the interpreter exits, and workers whose driver died exit on their own
(distributed/worker.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tinyvllm.config import ParallelConfig
from tinyvllm.distributed.commands import CommandSender
from tinyvllm.distributed.group import TPGroup, destroy_tp_group, free_port, init_tp_group, share_cpu_threads
from tinyvllm.distributed.worker import WorkerSpec, spawn_worker

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died or stopped answering: the engine cannot run steps any more."""


def _stop_workers(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to `grace_s` for the workers to exit, then kill the rest and reap them."""
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class TensorParallelRunner:
    """The engine's runner under tensor parallelism (module docstring).

    Args:
        parallel: the group's shape and rendezvous; this process is rank 0 on machine 0.
        runner_kwargs: ModelRunner's keyword arguments, less `device` and `group` (sent to every rank).
        device: rank 0's device; rank r of this machine runs on cuda:r on CUDA.
    """

    def __init__(self, parallel: ParallelConfig, runner_kwargs: dict[str, Any], device: torch.device) -> None:
        from tinyvllm.engine.model_runner import ModelRunner

        assert parallel.node_rank == 0 and parallel.world_size > 1
        if dist.is_initialized():
            raise ValueError(
                "this process already belongs to a process group (another tensor-parallel engine?): one per "
                "process; shut the other engine down first (LLMEngine.shutdown())"
            )
        self.parallel = parallel
        self._failure: str | None = None
        port = parallel.master_port or free_port(parallel.master_addr)
        self.workers: dict[int, subprocess.Popen] = {}
        self.group: TPGroup | None = None
        self._commands: CommandSender | None = None
        self._finalizer = weakref.finalize(self, _kill_all, self.workers)
        for local_rank in range(1, parallel.ranks_per_node):
            spec = WorkerSpec(parallel, port, local_rank, local_rank, device.type, os.getpid())
            self.workers[local_rank] = spawn_worker(spec)
        self._threads = torch.get_num_threads()  # restored at shutdown
        if device.type == "cpu":
            share_cpu_threads(parallel)
        try:
            self.group = init_tp_group(parallel, 0, device, port)
            self._commands = CommandSender(self.group)
            self._guard(lambda: self._commands.send({**runner_kwargs, "show_progress": False}, None))
            self.runner = ModelRunner(**runner_kwargs, device=device, group=self.group)
        except BaseException:
            self.shutdown()
            raise

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.runner.kv_cache_dtype

    @property
    def startup_times(self) -> dict[str, float]:
        """Rank 0's runner's start-up phases (ModelRunner.startup_times)."""
        return self.runner.startup_times

    @property
    def graphs(self):
        """Rank 0's decode graphs (every rank captures the same buckets): for timing and inspection."""
        return self.runner.graphs

    def determine_num_blocks(self, *args: Any, **kwargs: Any):
        return self._call("determine_num_blocks", args, kwargs)

    def initialize(self, **kwargs: Any) -> None:
        self._call("initialize", (), kwargs)

    def launch(self, sched, structured=None, before_mask: Callable[[], None] | None = None):
        """Send the step to every worker, then run it here (ModelRunner.launch)."""

        def run():
            self._commands.send(("launch", sched), self.parallel.distributed_timeout_s)  # workers wait for it
            return self.runner.launch(sched, structured, before_mask)

        return self._guard(run)

    def prepare(self, sched) -> None:
        """Pack the next step's inputs on rank 0 (ModelRunner.prepare); the workers pack theirs when it
        reaches them."""
        self.runner.prepare(sched)

    def _call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        def run():
            self._commands.send(("call", method, args, kwargs), None)  # workers may still be building
            return getattr(self.runner, method)(*args, **kwargs)

        return self._guard(run)

    def next_graph_capture(self, idle: bool = False) -> int | None:
        """The decode graph bucket to capture next: every rank ran the same steps, so rank 0's answer is
        every rank's (ModelRunner.next_graph_capture)."""
        return self.runner.next_graph_capture(idle)

    def capture_graph(self, bucket: int) -> None:
        """Capture one bucket's decode graphs on every rank (ModelRunner.capture_graph)."""
        self._call("capture_graph", (bucket,), {})

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker of this machine has died, without running anything: lets an
        idle engine notice a dead rank before its next step."""
        if self._failure is None:
            self._failure = self._dead_workers()
        if self._failure is not None:
            raise WorkerDiedError(self._failure)

    def _guard(self, run: Callable[[], Any]) -> Any:
        """`run()`, with a dead or hung rank raised as WorkerDiedError (module docstring). Any error leaves
        the ranks out of step (some may wait in a collective the others never reach), so every later
        call raises WorkerDiedError."""
        self.check_health()
        try:
            return run()
        except BaseException as e:
            if isinstance(e, WorkerDiedError):
                raise
            dead = self._dead_workers(wait_s=1.0)
            if dead is None and not _is_collective_error(e):
                self._failure = f"rank 0 failed in a step ({type(e).__name__}: {e}); the ranks are out of step"
                raise
            self._failure = dead or f"a tensor-parallel rank stopped answering ({type(e).__name__}: {e})"
            raise WorkerDiedError(self._failure) from e

    def _dead_workers(self, wait_s: float = 0.0) -> str | None:
        """A description of this machine's workers that have exited (waiting up to `wait_s` for one that
        is exiting), or None."""
        dead = []
        for rank, proc in self.workers.items():
            try:
                code = proc.wait(timeout=wait_s) if wait_s else proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                dead.append(f"rank {rank} (pid {proc.pid}) exited with {_describe_exit(code)}")
        return "tensor-parallel worker died: " + "; ".join(dead) if dead else None

    def shutdown(self) -> None:
        """Stop the workers (kill those that do not stop within seconds) and leave the group."""
        if self._failure is None and self._commands is not None and self._dead_workers() is None:
            with contextlib.suppress(RuntimeError, dist.DistError, TimeoutError):
                self._commands.send(("stop",), self.parallel.distributed_timeout_s)
        _kill_all(self.workers, grace_s=_STOP_GRACE_S if self._failure is None else 0.0)
        if self._commands is not None and not self._commands.close(wait_s=_STOP_GRACE_S):
            logger.warning("a tensor-parallel command is still blocked after the workers were stopped")
        self._failure = self._failure or "the engine was shut down"
        destroy_tp_group()
        torch.set_num_threads(self._threads)


def _kill_all(workers: dict[int, subprocess.Popen], grace_s: float = 0.0) -> None:
    _stop_workers(list(workers.values()), grace_s)


def _is_collective_error(e: BaseException) -> bool:
    """Whether `e` is a failed or timed-out collective (torch raises some as plain RuntimeErrors)."""
    if isinstance(e, (dist.DistError, TimeoutError)):  # TimeoutError: CommandSender gave up on a rank
        return True
    if not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def _describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"
