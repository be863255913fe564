"""A tensor-parallel group and its collectives, taking the group explicitly.

Two process groups span the same ranks: `device_group` (NCCL on CUDA, gloo on the CPU) carries the
steps' all-reduces and all-gathers, with a timeout of `ParallelConfig.distributed_timeout_s` so a hung
rank surfaces as an error; `cpu_group` (gloo, the default group, no practical timeout: workers wait on
it between steps, however idle the server) carries the driver's commands as pickled objects.

The rendezvous is torchrun's: rank 0 serves a TCP store at master_addr:master_port that every rank
joins within `RENDEZVOUS_TIMEOUT_S` (the store env:// builds from MASTER_ADDR / MASTER_PORT, built here
from arguments instead of the environment).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tinyvllm.config import ParallelConfig

_IDLE_TIMEOUT = datetime.timedelta(days=365)  # the command channel: a worker may wait for work indefinitely
RENDEZVOUS_TIMEOUT_S = 600.0  # every rank must join by then (other machines may be started by hand)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the rendezvous port of a one-machine group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class TPGroup:
    """This process's rank in a tensor-parallel group, and the group's collectives."""

    rank: int
    world_size: int
    device_group: Any  # torch.distributed.ProcessGroup
    cpu_group: Any

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place (the row-parallel layers' partial products)."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank → [..., world_size · n], rank r's columns at r·n (the vocab-parallel logits)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` into every rank's `x` (contiguous), in place."""
        dist.broadcast(x, src=src, group=self.device_group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (the KV cache's block count: every rank holds every block)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s `obj` (pickled) to every rank; the others pass None and get it back."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]


def init_tp_group(parallel: ParallelConfig, rank: int, device: torch.device, master_port: int) -> TPGroup:
    """Join the rendezvous at parallel.master_addr:`master_port` as global rank `rank` and build the
    group's two process groups (module docstring). Blocks until every rank has joined, or raises after
    `RENDEZVOUS_TIMEOUT_S`."""
    store = dist.TCPStore(
        parallel.master_addr,
        master_port,
        parallel.world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
    )
    dist.init_process_group(
        backend="gloo", store=store, rank=rank, world_size=parallel.world_size, timeout=_IDLE_TIMEOUT
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=parallel.distributed_timeout_s)
    device_group = dist.new_group(backend=backend, timeout=timeout)
    return TPGroup(rank, parallel.world_size, device_group, dist.group.WORLD)


def share_cpu_threads(parallel: ParallelConfig) -> None:
    """On the CPU, give each of a machine's ranks an equal share of torch's threads: ranks that each use
    them all spin against each other in their thread pools (measured: 5× slower steps at 2 ranks)."""
    torch.set_num_threads(max(1, torch.get_num_threads() // parallel.ranks_per_node))


def destroy_tp_group() -> None:
    """Leave the process groups (safe to call when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()
