"""Cascade decode attention against plain paged decode, for batches that share a cached prefix.

    python benchmarks/kernels/bench_cascade.py [--prefix 1024] [--suffix 128] [--out DIR]

The `shared-prefix` workload's decode: B sequences whose first `prefix` keys sit in the same blocks,
then `suffix` keys each. Both kernels timed as CUDA-graph replays (one layer: 32 query / 8 KV heads,
head dim 64, bf16, block 16); floors: the bytes each must read at the copy bandwidth (plain decode
re-reads the prefix per sequence unless L2 serves it; cascade reads it once per 16 sequences). The
cascade is also timed with the prefix's tiles split over 2, 4 and 8 programs per chunk of sequences
(`DecodeConfig.prefix_splits`), and split over 4 with the prefix kernel's key loop pipelined
PIPELINED_STAGES deep (`DecodeConfig.prefix_stages`: two K/V buffers, the next tile's copies in flight,
where the default depth waits for every copy each tile), and with the prefix kernel on a stream of its
own beside the splits (`DecodeConfig.prefix_stream`; graph-captured as two branches), each checked
against plain decode. Writes cascade_<gpu>.json.
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

from tinyvllm.kernels.decode_attention import DEFAULT_CONFIG, decode_attention_fwd

HQ, HK, D, BS = 32, 8, 64, 16
PREFIX_SPLITS = (2, 4, 8)  # the prefix's tiles over this many programs per chunk, beside the default 1
PIPELINED_SPLITS, PIPELINED_STAGES = 4, 5  # prefix ÷4 with DecodeConfig.prefix_stages = 5


def measure_batch(batch: int, prefix: int, suffix: int, copy: float, dev) -> dict:
    """Plain and cascade decode attention for `batch` rows sharing `prefix` keys (in the same blocks),
    then `suffix` keys each in blocks of their own, shuffled."""
    ctx = prefix + suffix
    shared_blocks, own = prefix // BS, -(-suffix // BS)
    num_blocks = shared_blocks + batch * own + 1
    k = torch.randn(num_blocks, HK, BS, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.empty(batch, shared_blocks + own, dtype=torch.int32, device=dev)
    tables[:, :shared_blocks] = torch.arange(shared_blocks, dtype=torch.int32, device=dev)
    own_blocks = shared_blocks + torch.randperm(batch * own, device=dev).view(batch, own)
    tables[:, shared_blocks:] = own_blocks.to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    p = torch.tensor([prefix], dtype=torch.int32, device=dev)

    def plain():
        return decode_attention_fwd(q, k, v, lens, tables, D**-0.5, ctx)

    def cascade(prefix_splits: int = 1, prefix_stages: int = 0, prefix_stream: bool = False):
        cfg = DEFAULT_CONFIG._replace(
            prefix_splits=prefix_splits, prefix_stages=prefix_stages, prefix_stream=prefix_stream
        )
        return lambda: decode_attention_fwd(q, k, v, lens, tables, D**-0.5, ctx, prefix_len=p, config=cfg)

    ref, out = plain().float(), cascade()().float()
    t_plain, t_casc = bench_graph([plain]) * 1e3, bench_graph([cascade()]) * 1e3
    split_us, split_diff = {}, {}
    for n in PREFIX_SPLITS:  # split-K over the shared keys (DecodeConfig.prefix_splits)
        split_us[n] = bench_graph([cascade(n)]) * 1e3
        split_diff[n] = ((ref - cascade(n)().float()).norm() / ref.norm()).item()
    piped = cascade(PIPELINED_SPLITS, PIPELINED_STAGES)  # the prefix loop prefetching (prefix_stages)
    piped_us = bench_graph([piped]) * 1e3
    piped_diff = ((ref - piped().float()).norm() / ref.norm()).item()
    streamed = cascade(DEFAULT_CONFIG.prefix_splits, prefix_stream=True)  # the prefix beside the splits
    streamed_us = bench_graph([streamed]) * 1e3
    streamed_diff = ((ref - streamed().float()).norm() / ref.norm()).item()
    kv_row = 2 * HK * D * 2  # K and V bytes of one token
    unique = (prefix + batch * suffix) * kv_row
    every = batch * ctx * kv_row
    return {
        "batch": batch,
        "plain_us": t_plain,
        "cascade_us": t_casc,
        "speedup": t_plain / t_casc,
        "floor_unique_us": unique / (copy / 2) * 1e6,
        "floor_all_us": every / (copy / 2) * 1e6,
        "rel_diff": ((ref - out).norm() / ref.norm()).item(),
        **{f"cascade_ps{n}_us": split_us[n] for n in PREFIX_SPLITS},
        **{f"rel_diff_ps{n}": split_diff[n] for n in PREFIX_SPLITS},
        f"cascade_ps{PIPELINED_SPLITS}_st{PIPELINED_STAGES}_us": piped_us,
        f"rel_diff_ps{PIPELINED_SPLITS}_st{PIPELINED_STAGES}": piped_diff,
        "cascade_stream_us": streamed_us,
        "rel_diff_stream": streamed_diff,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    dev = require_cuda()
    copy = copy_bandwidth(dev)
    rows = [measure_batch(batch, ns.prefix, ns.suffix, copy, dev) for batch in ns.batches]
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
            *[(f"cascade_ps{n}_us", f"prefix ÷{n} µs", ".1f") for n in PREFIX_SPLITS],
            (
                f"cascade_ps{PIPELINED_SPLITS}_st{PIPELINED_STAGES}_us",
                f"prefix ÷{PIPELINED_SPLITS}, {PIPELINED_STAGES} stages µs",
                ".1f",
            ),
            ("cascade_stream_us", f"prefix ÷{DEFAULT_CONFIG.prefix_splits}, own stream µs", ".1f"),
        ],
    )
    json_path, _ = output_paths(ns.out, "cascade")
    payload = {"device": device_info(dev), "copy_bw": copy, "prefix": ns.prefix, "suffix": ns.suffix, "results": rows}
    write_json(json_path, payload)


if __name__ == "__main__":
    main()
