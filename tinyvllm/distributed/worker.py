"""A tensor-parallel worker: one process per rank other than the driver's (rank 0).

It joins the group, receives its ModelRunner's arguments from the driver, builds its shard of the model
and then runs what the driver broadcasts, in the driver's order, until told to stop:

    ("launch", SchedulerOutput)     run the step (its ids come back by the runner's own broadcast)
    ("call", method, args, kwargs)  a runner method the driver runs too (sizing the cache, initialize)
    ("stop",)                       leave the group and exit

A worker exits, non-zero, when a collective fails (the driver or another rank is gone: gloo closes the
connection, NCCL times out) or when the process that started it dies (`watch_parent`), so none is left
behind. Started by `spawn_worker` as `python -m tinyvllm.distributed.worker` with its arguments pickled
on stdin: a fresh interpreter, as multiprocessing's spawn gives, and possible from a daemonic engine
process (which multiprocessing does not allow to have children).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from tinyvllm.config import ParallelConfig
from tinyvllm.distributed.group import destroy_tp_group, init_tp_group, share_cpu_threads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs before it can join: the group's rendezvous and its place in it."""

    parallel: ParallelConfig
    master_port: int
    rank: int
    local_rank: int  # its index among its machine's ranks: its GPU on CUDA
    device_type: str  # "cuda" or "cpu"
    parent_pid: int  # the process that started it: the worker exits when that one is gone


def spawn_worker(spec: WorkerSpec) -> subprocess.Popen:
    """Start a worker process for `spec` (module docstring)."""
    proc = subprocess.Popen([sys.executable, "-m", "tinyvllm.distributed.worker"], stdin=subprocess.PIPE)
    proc.stdin.write(pickle.dumps(spec))
    proc.stdin.close()
    return proc


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this process, from a daemon thread, as soon as `parent_pid` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(3)

    threading.Thread(target=watch, name="tinyvllm-parent-watch", daemon=True).start()


def run_worker(spec: WorkerSpec) -> None:
    """Join the group as `spec.rank`, build the rank's runner from the driver's arguments, and serve the
    driver's commands until ("stop",)."""
    from tinyvllm.engine.model_runner import ModelRunner

    device = torch.device("cuda", spec.local_rank) if spec.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        share_cpu_threads(spec.parallel)
    group = init_tp_group(spec.parallel, spec.rank, device, spec.master_port)
    try:
        runner_kwargs = group.broadcast_object()
        runner = ModelRunner(**runner_kwargs, device=device, group=group)
        while True:
            command = group.broadcast_object()
            if command[0] == "launch":
                runner.launch(command[1])
            elif command[0] == "call":
                _, method, args, kwargs = command
                getattr(runner, method)(*args, **kwargs)
            elif command[0] == "stop":
                break
            else:
                raise AssertionError(f"unknown command {command[0]!r}")
    finally:
        destroy_tp_group()


def main() -> None:
    spec: WorkerSpec = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(message)s")
    watch_parent(spec.parent_pid)
    try:
        run_worker(spec)
    except Exception:
        logger.exception("tensor-parallel worker rank %d failed", spec.rank)
        sys.exit(1)


if __name__ == "__main__":
    main()
