"""The LM head's GEMV with part of its weight kept in L2 across a decode step's weight stream
(cuda_l2.py beside this): per variant, the set-aside for persisting accesses and the window over the
weight's first or last rows, timed as one CUDA-graph replay of the GEMV after a graph that reads
`--flush-gb` of other memory (a step's 1.95 GB of layer weights evicts every ordinary line).

    python benchmarks/kernels/bench_l2_residency.py [--flush-gb 2] [--out DIR]

Prints the device's L2 limits, a table (µs, the bytes served from HBM, the effective rate over all the
weight's bytes) and checks that the window reached the graph's kernel node and that the logits are the
same with it. Writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from common import device_info, output_paths, print_table, require_cuda, write_json
from cuda_l2 import (
    AccessPolicyWindow,
    graph_windows,
    l2_limits,
    lm_head_window,
    reset_persisting_l2,
    set_graph_window,
    set_persisting_l2_bytes,
)

from tinyvllm.kernels.gemv import fused_gemv_fwd


def capture(fn, window: AccessPolicyWindow | None) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    if window is not None:
        set_graph_window(graph.raw_cuda_graph(), window)
        got = graph_windows(graph.raw_cuda_graph())
        assert all(w.base_ptr == window.base_ptr and w.num_bytes == window.num_bytes for w in got), got
    graph.instantiate()
    return graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--flush-gb", type=float, default=2.0)
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    dev = require_cuda()
    limits = l2_limits(dev)
    print(
        f"L2 {limits.l2_bytes / 1e6:.1f} MB, persisting set-aside up to {limits.max_persisting_bytes / 1e6:.1f} MB, "
        f"window up to {limits.max_window_bytes / 1e6:.1f} MB"
    )
    torch.manual_seed(0)
    weight = torch.randn(ns.vocab, ns.hidden, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, ns.hidden, device=dev, dtype=torch.bfloat16)
    flush = torch.ones(int(ns.flush_gb * 2**30) // 2, device=dev, dtype=torch.bfloat16)
    flush_out = torch.empty((), device=dev, dtype=torch.float32)
    out = torch.empty(1, ns.vocab, device=dev, dtype=torch.bfloat16)

    def lm_head() -> None:
        out.copy_(fused_gemv_fwd(x, weight))

    flush_graph = capture(lambda: flush_out.copy_(torch.sum(flush, dtype=torch.float32)), None)
    total = weight.numel() * weight.element_size()
    results, reference = [], None
    variants = [("none", 0.0, "end", 1.0)]
    variants += [
        (f"{frac:.2f} of max, {where} rows, window {fill:.2f}", frac, where, fill)
        for frac in (1.0, 0.75, 0.5)
        for where in ("end", "start")
        for fill in (1.0, 0.9)
        if not (where == "start" and fill != 1.0)
    ]
    for name, frac, where, fill in variants:
        granted = set_persisting_l2_bytes(int(limits.max_persisting_bytes * frac))
        reset_persisting_l2()
        window = lm_head_window(weight, int(granted * fill), limits.max_window_bytes) if frac > 0 else None
        if window is not None and where == "start":
            window = AccessPolicyWindow(weight.data_ptr(), window.num_bytes, 1.0)
        graph = capture(lm_head, window)
        times = []
        for _ in range(ns.replays):
            flush_graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        us = sorted(times)[len(times) // 2]
        if reference is None:
            reference = out.clone()
        assert torch.equal(out, reference), f"{name}: logits differ"
        cached = 0 if window is None else window.num_bytes
        results.append(
            {
                "variant": name,
                "set_aside_mb": granted / 1e6,
                "window_mb": cached / 1e6,
                "us": us,
                "hbm_mb": (total - cached) / 1e6,
                "tb_per_s_all_bytes": total / us / 1e6,
            }
        )
        del graph
    set_persisting_l2_bytes(0)
    print_table(
        f"LM head GEMV [{ns.vocab} x {ns.hidden}] bf16 after a {ns.flush_gb:g} GB flush, one graph replay",
        results,
        [
            ("variant", "variant", "s"),
            ("set_aside_mb", "set-aside MB", ".1f"),
            ("window_mb", "window MB", ".1f"),
            ("us", "µs", ".2f"),
            ("tb_per_s_all_bytes", "TB/s (all bytes)", ".2f"),
        ],
    )
    json_path, _ = output_paths(ns.out, "l2_residency")
    write_json(json_path, {"device": device_info(dev), "limits": limits._asdict(), "results": results})


if __name__ == "__main__":
    main()
