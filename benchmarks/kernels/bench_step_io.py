"""A small decode step's input and output traffic on the device, by way of doing it. Two ways the engine
has for it: the copy kernels and the placeholder gather around a decode graph (kernels/host_copy.py,
placeholders.py: the steps of up to 8 rows, over the shared 256-row arena) and the batch-1 graph's own
arena load (kernels/arena_load.py, over an arena of the step's rows) at several first-read sizes. Each is
timed as CUDA-graph replays of back-to-back calls, so each figure includes a kernel boundary inside a
graph (~0.3–0.5 µs).

    python benchmarks/kernels/bench_step_io.py [--rows 1 8] [--out DIR]

Arenas as the engine's (engine/input_arena.py) for max_model_len 131,072 (8,192 blocks a row), rows of
640 tokens; the sources are their pinned host twins. Writes step_io_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from common import bench_graph, device_info, output_paths, print_table, require_cuda, write_json

from tinyvllm.engine.input_arena import InputArena
from tinyvllm.kernels.arena_load import load_arena
from tinyvllm.kernels.host_copy import kernel_copy_
from tinyvllm.kernels.placeholders import resolve_placeholders


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--blocks-per-seq", type=int, default=8192)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    dev = require_cuda()
    results = []
    width = -(-ns.context // 16)
    for rows in ns.rows:
        shared_host = InputArena(256, ns.blocks_per_seq, torch.device("cpu"), pin_memory=True)
        shared = InputArena(256, ns.blocks_per_seq, dev)
        shared_bytes = shared_host.bytes_through(rows, width)
        host = InputArena(rows, ns.blocks_per_seq, torch.device("cpu"), pin_memory=True)
        arena = InputArena(rows, ns.blocks_per_seq, dev)
        nbytes = host.bytes_through(rows, width)
        host.set_copy_words(nbytes)
        host.arrays.placeholder_src[:rows] = range(rows)
        shared_host.arrays.placeholder_src[:rows] = range(rows)
        sampled = torch.arange(100, 100 + rows, device=dev)
        ids_host = host.sampled_ids[:rows]
        ids, src = arena.input_ids[:rows], arena.placeholder_src[:rows]

        def copy_kernels() -> None:
            kernel_copy_(shared.buffer[:shared_bytes], shared_host.buffer[:shared_bytes])
            resolve_placeholders(shared.input_ids[:rows], shared.placeholder_src[:rows], sampled)
            kernel_copy_(ids_host, sampled)

        variants = {
            "copy in, gather, copy out (3 kernels, shared arena)": copy_kernels,
            "copy in (1 kernel, shared arena)": lambda: kernel_copy_(
                shared.buffer[:shared_bytes], shared_host.buffer[:shared_bytes]
            ),
            "copy out (1 kernel)": lambda: kernel_copy_(ids_host, sampled),
        }
        for block in (64, 128, 256, 1024):
            variants[f"arena load, first read {block} words"] = lambda b=block: load_arena(
                arena.buffer, host.buffer, ids, src, sampled, block=b
            )
            variants[f"arena load, first read {block} words, no gather"] = lambda b=block: load_arena(
                arena.buffer, host.buffer, ids[:0], src[:0], sampled, block=b
            )
        for name, fn in variants.items():
            us = bench_graph([fn], calls=64) * 1e3
            results.append(
                {"rows": rows, "bytes": shared_bytes if "shared" in name else nbytes, "variant": name, "us": us}
            )
        load_arena(arena.buffer, host.buffer, ids, src, sampled)
        torch.cuda.synchronize()
        assert torch.equal(arena.block_tables.cpu(), host.block_tables) and ids.tolist() == sampled.tolist()
    print_table(
        "a decode step's input/output traffic, µs per call (graph replays)",
        results,
        [("rows", "rows", "d"), ("bytes", "bytes", "d"), ("variant", "variant", "s"), ("us", "µs", ".2f")],
    )
    json_path, _ = output_paths(ns.out, "step_io")
    write_json(json_path, {"device": device_info(dev), "results": results})


if __name__ == "__main__":
    main()
