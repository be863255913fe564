"""Weight loading, piece by piece: how fast a checkpoint's bytes reach the device, and what bounds it.

    python benchmarks/bench_load.py --model dummy:llama-3.2-1b [--threads 8 16] [--repeats 2]

Rows (GB/s over the checkpoint's bytes; each the best of `--repeats` passes, after one pass that
brings the files into the page cache):

    page cache → pinned     positional reads (os.preadv) of every tensor into per-thread pinned
                            staging, nothing else: the host side's ceiling
    pinned → device         one pinned buffer copied to the device repeatedly: the link's rate
    read_tensors direct     the loader's CUDA path (models/loader.py): reads into pinned staging,
                            copies on each thread's stream
    read_tensors mapped     safetensors' memory map, `pin_memory()`, copy (the loader's other path)
    build_model             the engine's whole weights step (construction, reading, placement), split as
                            `StartupTimer` splits it (model_init, weights_read, weights)

Prints a table and writes JSON (`--out-dir`, `--name`).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tinyvllm.bench.report import device_tag, print_table, write_json
from tinyvllm.config import ModelConfig
from tinyvllm.engine.startup_timing import StartupTimer
from tinyvllm.kernels import get_ops
from tinyvllm.models.checkpoint import resolve_model
from tinyvllm.models.loader import CHUNK_BYTES, build_model, read_tensors, safetensors_files
from tinyvllm.models.safetensors_reader import byte_view, read_header, read_into


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_to_pinned(files: list[Path], threads: int, chunk: int) -> None:
    """Every tensor's bytes into per-thread pinned staging (or pageable memory without CUDA)."""
    local = threading.local()
    fds = {p: os.open(p, os.O_RDONLY) for p in files}
    jobs = [
        (fds[p], e.offset + s, min(chunk, e.nbytes - s))
        for p in files
        for e in read_header(p).values()
        for s in range(0, e.nbytes, chunk)
    ]

    def job(fd: int, offset: int, n: int) -> None:
        if not hasattr(local, "buf"):
            local.buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        read_into(fd, byte_view(local.buf[:n]), offset)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda j: job(*j), jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, nargs="+", default=[8])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--name", default=None)
    ns = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = resolve_model(ns.model)
    files = safetensors_files(model_dir)
    total = sum(e.nbytes for f in files for e in read_header(f).values())
    gb = total / 1e9
    read_to_pinned(files, max(ns.threads), CHUNK_BYTES)  # the page cache holds the files from here on
    rows, result = [], {"model": ns.model, "bytes": total, "device": str(device), "rows": {}}

    def row(name: str, seconds: float) -> None:
        rows.append((name, f"{seconds:.3f}", f"{gb / seconds:.2f}"))
        result["rows"][name] = seconds

    for t in ns.threads:
        row(f"page cache → pinned, {t} threads", _best(lambda: read_to_pinned(files, t, CHUNK_BYTES), ns.repeats))
    if device.type == "cuda":
        src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty_like(src, device=device)

        def h2d() -> None:
            for _ in range(-(-total // src.numel())):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        row("pinned → device (one stream)", _best(h2d, ns.repeats))

    def drain(**kw) -> None:
        for _ in read_tensors(files, device, **kw):
            pass
        if device.type == "cuda":
            torch.cuda.synchronize()

    for t in ns.threads:
        row(f"read_tensors direct, {t} threads", _best(lambda: drain(num_threads=t, direct=True), ns.repeats))
    if device.type == "cuda":  # on the CPU the mapped tensors are not read until used
        t = ns.threads[0]
        row(f"read_tensors mapped, {t} threads", _best(lambda: drain(num_threads=t, direct=False), ns.repeats))
    config = ModelConfig.from_dir(model_dir)
    ops = get_ops("triton" if device.type == "cuda" else "torch")
    for _ in range(ns.repeats):
        timer = StartupTimer(device)
        start = time.perf_counter()
        model = build_model(
            config,
            ops,
            model_dir=model_dir,
            device=device,
            dtype=getattr(torch, ns.dtype),
            max_positions=config.max_position_embeddings,
            timer=timer,
        )
        seconds = time.perf_counter() - start
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row("build_model", seconds)
    for k, v in timer.times.items():
        rows.append((f"  build_model: {k}", f"{v:.3f}", ""))
    result["build_model_phases"] = timer.times
    print_table(f"weight loading: {ns.model}, {gb:.2f} GB, on {device}", rows, ("step", "seconds", "GB/s"))
    write_json(ns.name or f"load_{device_tag()}", result, Path(ns.out_dir))


if __name__ == "__main__":
    main()
