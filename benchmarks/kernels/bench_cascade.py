"""Cascade decode attention against plain paged decode, for batches that share a cached prefix.

    python benchmarks/kernels/bench_cascade.py [--prefix 1024] [--suffix 128] [--out DIR]

The `shared-prefix` workload's decode: B sequences whose first `prefix` keys sit in the same blocks,
then `suffix` keys each. Both kernels timed as CUDA-graph replays (one layer: 32 query / 8 KV heads,
head dim 64, bf16, block 16); floors: the bytes each must read at the copy bandwidth (plain decode
re-reads the prefix per sequence unless L2 serves it; cascade reads it once per 16 sequences).
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

from tinyvllm.kernels.decode_attention import decode_attention_fwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    dev = require_cuda()
    copy = copy_bandwidth(dev)
    hq, hk, d, bs = 32, 8, 64, 16
    rows = []
    for batch in ns.batches:
        ctx = ns.prefix + ns.suffix
        shared_blocks = ns.prefix // bs
        own = -(-ns.suffix // bs)
        num_blocks = shared_blocks + batch * own + 1
        k = torch.randn(num_blocks, hk, bs, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.empty(batch, shared_blocks + own, dtype=torch.int32, device=dev)
        tables[:, :shared_blocks] = torch.arange(shared_blocks, dtype=torch.int32, device=dev)
        tables[:, shared_blocks:] = shared_blocks + torch.randperm(batch * own, device=dev).view(batch, own).to(
            torch.int32
        )
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
        p = torch.tensor([ns.prefix], dtype=torch.int32, device=dev)
        plain = decode_attention_fwd(q, k, v, lens, tables, d**-0.5, ctx)
        cascade = decode_attention_fwd(q, k, v, lens, tables, d**-0.5, ctx, prefix_len=p)
        err = ((plain.float() - cascade.float()).norm() / plain.float().norm()).item()
        t_plain = bench_graph([lambda: decode_attention_fwd(q, k, v, lens, tables, d**-0.5, ctx)]) * 1e3
        t_casc = bench_graph([lambda: decode_attention_fwd(q, k, v, lens, tables, d**-0.5, ctx, prefix_len=p)]) * 1e3
        kv_row = 2 * hk * d * 2  # K and V bytes of one token
        unique = (ns.prefix + batch * ns.suffix) * kv_row
        every = batch * ctx * kv_row
        rows.append(
            {
                "batch": batch,
                "plain_us": t_plain,
                "cascade_us": t_casc,
                "speedup": t_plain / t_casc,
                "floor_unique_us": unique / (copy / 2) * 1e6,
                "floor_all_us": every / (copy / 2) * 1e6,
                "rel_diff": err,
            }
        )
    print_table(
        f"decode attention, {ns.prefix} shared + {ns.suffix} own keys, one layer",
        rows,
        [
            ("batch", "batch", "d"),
            ("plain_us", "plain µs", ".1f"),
            ("cascade_us", "cascade µs", ".1f"),
            ("speedup", "plain/cascade", ".2f"),
            ("floor_all_us", "floor, all keys µs", ".1f"),
            ("floor_unique_us", "floor, unique keys µs", ".1f"),
            ("rel_diff", "rel diff", ".1e"),
        ],
    )
    json_path, _ = output_paths(ns.out, "cascade")
    write_json(
        json_path,
        {"device": device_info(dev), "copy_bw": copy, "prefix": ns.prefix, "suffix": ns.suffix, "results": rows},
    )


if __name__ == "__main__":
    main()
