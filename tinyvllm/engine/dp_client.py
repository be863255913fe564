"""DPAsyncLLMEngine: N engine cores, each in a process of its own, behind one client (data parallelism).

    API process                                           engine processes
    DPAsyncLLMEngine --Router--> MPAsyncLLMEngine 0  <==pipes==>  EngineCore 0 (GPUs 0 .. tp-1)
                                 MPAsyncLLMEngine 1  <==pipes==>  EngineCore 1 (GPUs tp .. 2tp-1)
                                 ...

The client has the interface of one `EngineClient` (add_request, generate, info, stats, is_dead,
shutdown, stats listeners), so the server does not know how many cores serve it. Each request goes to
one core (`tinyvllm.engine.dp_router.Router`: the least loaded, by requests in flight, with
prefix-cache affinity) and stays there: its stream belongs to that core's client, so aborts and
outputs need no routing.

Placement (`plan_cores`): on CUDA, core i sees GPUs i*tp .. i*tp+tp-1 of those visible to the server
(CUDA_VISIBLE_DEVICES, set in the core's process before CUDA starts) as cuda:0 ..; more cores × tp
than GPUs is a ValueError before any process starts. On the CPU every core runs on the CPU, with
torch's threads shared among the cores.

Faults: the client is dead once any core is (its requests fail with that core's error; later
`add_request`s raise EngineDeadError); the other cores keep serving their requests until `shutdown`.
The server, seeing `is_dead`, drains and exits non-zero (`tinyvllm.entrypoints.shutdown`).

Stats: each core's stats snapshot summed key by key (`aggregate_stats`), the KV-cache usage as the
fraction of all cores' blocks in use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tinyvllm.engine.async_llm import EngineClient, EngineInfo, RequestRejected, RequestStream, StatsListener
from tinyvllm.engine.dp_router import DEFAULT_AFFINITY_MARGIN, Router
from tinyvllm.engine.messages import RequestDelta
from tinyvllm.engine.mp_client import DEFAULT_STEP_TIMEOUT_S, EngineFactory, EngineStartError, MPAsyncLLMEngine
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CorePlacement:
    """Where engine core `index` runs: the EngineArgs `device` it is built with and the environment
    its process sets first (CUDA_VISIBLE_DEVICES on CUDA)."""

    index: int
    device: str
    env: dict[str, str]


def plan_cores(
    device: str,
    data_parallel_size: int,
    tensor_parallel_size: int = 1,
    cuda_device_count: int | None = None,
    visible_devices: str | None = None,
) -> list[CorePlacement]:
    """Place `data_parallel_size` cores of `tensor_parallel_size` GPUs each (see the module docstring).

    Args:
        device: EngineArgs.device: "auto" (CUDA if there is a GPU), "cpu" or "cuda".
        cuda_device_count: GPUs visible to this process (None: ask torch; only for "auto" and "cuda").
        visible_devices: this process's CUDA_VISIBLE_DEVICES (None: read the environment); core i
            gets items i*tp .. i*tp+tp-1 of it (or of 0 .. count-1 when it is unset).

    Raises:
        ValueError: data_parallel_size < 1; a device pinned to one GPU ("cuda:N"); more
            data_parallel_size × tensor_parallel_size GPUs than there are.
    """
    if data_parallel_size < 1 or tensor_parallel_size < 1:
        raise ValueError(
            f"data_parallel_size and tensor_parallel_size must be at least 1, got {data_parallel_size} "
            f"and {tensor_parallel_size}"
        )
    if device == "cpu":
        return [CorePlacement(i, "cpu", {}) for i in range(data_parallel_size)]
    if device not in ("auto", "cuda"):
        raise ValueError(
            f"device {device!r} with data_parallel_size={data_parallel_size}: each core takes GPUs of its own "
            "(core i: GPUs i*tp ..); give device cuda (or auto), and CUDA_VISIBLE_DEVICES to choose the GPUs"
        )
    if cuda_device_count is None:
        cuda_device_count = _cuda_device_count()
    if cuda_device_count == 0:
        if device == "cuda":
            raise ValueError("device cuda, but no GPU is visible")
        return [CorePlacement(i, "cpu", {}) for i in range(data_parallel_size)]
    needed = data_parallel_size * tensor_parallel_size
    if needed > cuda_device_count:
        raise ValueError(
            f"data_parallel_size {data_parallel_size} × tensor_parallel_size {tensor_parallel_size} needs "
            f"{needed} GPUs, but {cuda_device_count} are visible; lower -dp/-tp or add GPUs"
        )
    if visible_devices is None:
        visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible_devices.split(",")] if visible_devices else []
    ids = ids[:cuda_device_count] if ids else [str(i) for i in range(cuda_device_count)]
    tp = tensor_parallel_size
    return [
        CorePlacement(i, "cuda", {"CUDA_VISIBLE_DEVICES": ",".join(ids[i * tp : (i + 1) * tp])})
        for i in range(data_parallel_size)
    ]


def _cuda_device_count() -> int:
    import torch  # only here: the API process otherwise never imports torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _threads_per_core(num_cores: int) -> int:
    """torch's CPU threads for each of `num_cores` engines on the CPU: the cores this process may use,
    less one for the API process, shared out (at least one each)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cpus - 1) // num_cores)


def aggregate_stats(snapshots: Sequence[dict[str, float]]) -> dict[str, float]:
    """The cores' stats as one engine's: every key summed, `kv_cache_usage` (a fraction) as the share
    of all cores' blocks in use (weighted by `num_kv_blocks`; the mean where blocks are unknown)."""
    total: dict[str, float] = {}
    for snap in snapshots:
        for key, value in snap.items():
            total[key] = total.get(key, 0) + value
    if "kv_cache_usage" in total:
        blocks = [snap.get("num_kv_blocks", 0) for snap in snapshots]
        usages = [snap.get("kv_cache_usage", 0.0) for snap in snapshots]
        if all(blocks):
            total["kv_cache_usage"] = sum(u * b for u, b in zip(usages, blocks)) / sum(blocks)
        else:
            total["kv_cache_usage"] = sum(usages) / len(snapshots)
    return total


def _prompt_token_ids(prompt: Any) -> list[int]:
    """The token ids a prompt comes with ([] for a text-only prompt: the core tokenizes it)."""
    if isinstance(prompt, dict):
        return prompt.get("prompt_token_ids") or []
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    return []


class _SerialListener:
    """A StatsListener called by several reader threads (one per core), one call at a time."""

    def __init__(self, listener: StatsListener, lock: threading.Lock) -> None:
        self._listener = listener
        self._lock = lock

    def on_step(self, items: Sequence[tuple[RequestStream, RequestDelta]], now: float) -> None:
        with self._lock:
            self._listener.on_step(items, now)

    def on_abort(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            self._listener.on_abort(request_ids)


class DPAsyncLLMEngine:
    """`data_parallel_size` MPAsyncLLMEngines behind the EngineClient interface; see the module docstring.

    Args:
        engine_args: tinyvllm.engine.args.EngineArgs; each core is built from it with
            data_parallel_size=1 and its placement's device.
        max_waiting_requests: per core, as MPAsyncLLMEngine's.
        engine_factory, show_progress, step_timeout_s: as MPAsyncLLMEngine's, for every core.
        affinity_margin: the Router's (requests).
        cuda_device_count: GPUs visible (None: ask torch, when the device may be CUDA).

    Raises:
        ValueError: an impossible placement (`plan_cores`), before any process starts.
    """

    def __init__(
        self,
        engine_args: Any,
        max_waiting_requests: int | None = None,
        engine_factory: EngineFactory | None = None,
        show_progress: bool = False,
        step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
        affinity_margin: int = DEFAULT_AFFINITY_MARGIN,
        cuda_device_count: int | None = None,
    ) -> None:
        dp = engine_args.parallel_config().data_parallel_size
        tp = engine_args.tensor_parallel_size
        placements = plan_cores(engine_args.device, dp, tp, cuda_device_count)
        threads = _threads_per_core(dp) if placements[0].device == "cpu" else None
        self.max_waiting_requests = max_waiting_requests
        grammar_workers = engine_args.structured_outputs_workers
        if grammar_workers is None and placements[0].device != "cpu":  # the default, split between the cores
            from tinyvllm.structured.workers import default_num_workers

            grammar_workers = default_num_workers() // dp
        self.cores = [
            MPAsyncLLMEngine(
                engine_args.replace(data_parallel_size=1, device=p.device, structured_outputs_workers=grammar_workers),
                max_waiting_requests=max_waiting_requests,
                engine_factory=engine_factory,
                show_progress=show_progress and p.index == 0,
                step_timeout_s=step_timeout_s,
                name=f"data-parallel core {p.index} of {dp}",
                env=p.env,
                num_threads=threads,
            )
            for p in placements
        ]
        self.router = Router(dp, engine_args.block_size, affinity_margin)
        self._route_lock = threading.Lock()
        self._listener_lock = threading.Lock()
        self.info: EngineInfo | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> DPAsyncLLMEngine:
        """Spawn every core, then wait until each has built its engine (they build at once).

        Raises:
            EngineStartError: a core could not be built (the others are stopped).
        """
        try:
            for core in self.cores:
                core.launch()
            for core in self.cores:
                try:
                    core.wait_until_ready(timeout)
                except EngineStartError as e:
                    raise EngineStartError(f"{core.name}: {e}") from None
        except BaseException:
            self.shutdown(timeout=5)
            raise
        self.info = self.cores[0].info
        return self

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop every core (what is in flight fails with EngineDeadError) and wait for them, at once."""
        with ThreadPoolExecutor(len(self.cores)) as pool:
            list(pool.map(lambda core: core.shutdown(timeout), self.cores))

    @property
    def pids(self) -> list[int | None]:
        return [core.pid for core in self.cores]

    @property
    def is_running(self) -> bool:
        """Every core's process runs."""
        return all(core.is_running for core in self.cores)

    @property
    def dead_error(self) -> BaseException | None:
        """The error of the first core found dead (None while all live)."""
        for core in self.cores:
            if core.dead_error is not None:
                return core.dead_error
        return None

    @property
    def is_dead(self) -> bool:
        return any(core.is_dead for core in self.cores)

    @property
    def stats(self) -> dict[str, float]:
        return aggregate_stats([core.stats for core in self.cores])

    @property
    def num_in_flight(self) -> int:
        return sum(core.num_in_flight for core in self.cores)

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Have `listener` called after every step of every core (one call at a time)."""
        serial = _SerialListener(listener, self._listener_lock)
        for core in self.cores:
            core.add_stats_listener(serial)

    # ------------------------------------------------------------------ requests
    async def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestStream:
        """Queue a request on the core the router picks; raises as `EngineClient.add_request`, and
        EngineDeadError once any core has died."""
        request_id = str(request_id)
        dead = next((core for core in self.cores if core.is_dead), None)
        if dead is not None:
            raise dead._dead()
        key = self.router.affinity_key(_prompt_token_ids(prompt))
        with self._route_lock:
            if any(request_id in core._streams or request_id in core._adding for core in self.cores):
                raise RequestRejected(f"request id {request_id!r} is already in use")
            index = self.router.choose([core.num_in_flight for core in self.cores], key)
        return await self.cores[index].add_request(request_id, prompt, params, arrival_time)

    generate = EngineClient.generate  # add_request (routed above) + iterate, aborting on an early stop
