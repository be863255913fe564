"""The fused greedy/Gumbel sampling kernel against torch, at the engine's shapes (V = 128,256).

    python benchmarks/kernels/bench_sampling.py [--batches 1 64 256] [--out DIR]

Per (batch, logits dtype, mode): our kernel and the torch anchor (greedy: `argmax`; temperature:
`argmax(z / T − log(−log u))` with u from `torch.rand`, the same Gumbel-max draw), each timed as CUDA
graph replays, and the floor: reading B·V logits once at the measured copy bandwidth (read-only, so
bytes / (copy rate / 2) is generous to us). Writes sampling_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from common import (
    bench_graph,
    copy_bandwidth,
    device_info,
    output_paths,
    print_table,
    require_cuda,
    write_json,
)

from tinyvllm.kernels.sampling import sample_greedy_or_gumbel


def torch_sample(logits: torch.Tensor, temperature: torch.Tensor, greedy: bool) -> torch.Tensor:
    z = logits.float()
    if greedy:
        return z.argmax(-1)
    u = torch.rand_like(z).clamp_min_(1e-20)
    return (z / temperature[:, None] - torch.log(-torch.log(u))).argmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    dev = require_cuda()
    copy = copy_bandwidth(dev)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch in ns.batches:
            for mode, t in (("greedy", 0.0), ("T=0.6", 0.6)):
                sets = [
                    (
                        torch.randn(batch, ns.vocab, device=dev).to(dtype),
                        torch.full((batch,), t, device=dev),
                        torch.arange(batch, device=dev) + 17 * k,
                    )
                    for k in range(4)
                ]
                ours = bench_graph([lambda s=s: sample_greedy_or_gumbel(*s) for s in sets]) * 1e3
                anchor = bench_graph([lambda s=s: torch_sample(s[0], s[1], t == 0.0) for s in sets]) * 1e3
                floor = batch * ns.vocab * sets[0][0].element_size() / (copy / 2) * 1e6
                rows.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "batch": batch,
                        "mode": mode,
                        "ours_us": ours,
                        "torch_us": anchor,
                        "floor_us": floor,
                        "torch/ours": anchor / ours,
                        "floor/ours": floor / ours,
                    }
                )
    print_table(
        f"fused sampling, V = {ns.vocab}",
        rows,
        [
            ("dtype", "logits", "s"),
            ("batch", "batch", "d"),
            ("mode", "mode", "s"),
            ("ours_us", "ours µs", ".1f"),
            ("torch_us", "torch µs", ".1f"),
            ("floor_us", "floor µs", ".1f"),
            ("torch/ours", "torch/ours", ".2f"),
            ("floor/ours", "floor/ours", ".2f"),
        ],
    )
    json_path, _ = output_paths(ns.out, "sampling")
    write_json(json_path, {"device": device_info(dev), "copy_bw": copy, "vocab": ns.vocab, "results": rows})


if __name__ == "__main__":
    main()
