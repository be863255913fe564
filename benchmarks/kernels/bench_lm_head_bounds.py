"""The pruned LM head (kernels/lm_head_bounds.py) against the LM head's full product with the fused
sampler (gemv.py `sampling=`), at Llama-3.2-1B's shape (128,256 × 2,048, bf16, one row).

    python benchmarks/kernels/bench_lm_head_bounds.py [--draws 48] [--out DIR]

1. Same ids: `--draws` inputs h ~ N(0, 1) (an RMSNorm's output with unit gain) × greedy, T = 0.6 and
   T = 1.0 with their own seeds, the weight ~ N(0, 0.02) as the dummy checkpoints draw it; every id of the
   pruned path must equal the full path's; the kept rows (the second pass's work) are counted.
2. Time, as CUDA-graph replays (the weight alone is 525 MB, far beyond L2): the full product and
   sampler; the bound pass alone and the pruned pair for each bound-pass config; floors at the measured
   copy bandwidth (bytes read / (copy rate / 2), generous to us as bench_sampling.py's).
Writes lm_head_bounds_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
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

from tinyvllm.kernels.gemv import GemvSampling, fused_gemv_fwd
from tinyvllm.kernels.int8_rows import quantize_rows
from tinyvllm.kernels.lm_head_bounds import (
    BoundsConfig,
    default_bounds_config,
    sample_pruned,
    score_bounds,
)

CONFIGS = [
    BoundsConfig(64, 64, 4, 1, 128),
    BoundsConfig(64, 32, 4, 1, 128),
    BoundsConfig(32, 64, 4, 1, 128),
    BoundsConfig(16, 128, 4, 1, 128),
    BoundsConfig(128, 32, 4, 1, 128),
    BoundsConfig(64, 128, 8, 1, 128),
    BoundsConfig(64, 64, 4, 1, 64),
    BoundsConfig(64, 64, 4, 2, 128),
    BoundsConfig(64, 64, 4, 3, 128),
]


def check_ids(w, rows, draws: int, gen, dev) -> tuple[int, list[dict], list[int]]:
    """(cases, mismatches, kept rows per case): the pruned path's id against the full path's for `draws`
    inputs × greedy, T = 0.6 and T = 1.0, each with its own seed."""
    mismatches, kept, cases = [], [], 0
    for d in range(draws):
        x = torch.randn(1, w.shape[1], generator=gen, device=dev).to(torch.bfloat16)
        for temperature in (0.0, 0.6, 1.0):
            t = torch.tensor([temperature], device=dev)
            s = torch.tensor([1000 + d], dtype=torch.int64, device=dev)
            full = torch.full((1,), -1, dtype=torch.int64, device=dev)
            pruned = torch.full((1,), -2, dtype=torch.int64, device=dev)
            fused_gemv_fwd(x, w, sampling=GemvSampling(t, s, full))
            sample_pruned(x, w, rows, GemvSampling(t, s, pruned))
            hi, lo_max, _, _ = score_bounds(x, rows, t, s)
            kept.append(int((hi >= lo_max.max()).sum()))
            cases += 1
            if full.item() != pruned.item():
                mismatches.append({"draw": d, "temperature": temperature, "full": full.item(), "pruned": pruned.item()})
    return cases, mismatches, kept


def time_paths(w, rows, gen, dev, copy: float) -> list[dict]:
    """The full product + sampler, then per config the bound pass alone and the pruned pair (graph replays);
    floors: bytes read at half the copy rate (the copy figure counts a read and a write)."""
    x = torch.randn(1, w.shape[1], generator=gen, device=dev).to(torch.bfloat16)
    t = torch.tensor([0.0], device=dev)
    s = torch.tensor([7], dtype=torch.int64, device=dev)
    sampling = GemvSampling(t, s, torch.zeros(1, dtype=torch.int64, device=dev))
    bf16_bytes = w.numel() * 2
    int8_bytes = rows.packed.numel() * 4 + 8 * w.shape[0]
    results = [
        {
            "path": "full product + sampler (gemv.py)",
            "us": bench_graph([lambda: fused_gemv_fwd(x, w, sampling=sampling)], calls=20) * 1e3,
            "floor_us": bf16_bytes / (copy / 2) * 1e6,
        }
    ]
    for cfg in CONFIGS:
        try:
            bound_us = bench_graph([lambda cfg=cfg: score_bounds(x, rows, t, s, cfg)], calls=20) * 1e3
            pair_us = bench_graph([lambda cfg=cfg: sample_pruned(x, w, rows, sampling, cfg)], calls=20) * 1e3
        except Exception as e:  # a config that does not compile here: say so, keep going
            print(f"{cfg}: {type(e).__name__}: {e}", flush=True)
            continue
        name = f"bounds {cfg.block_n}x{cfg.block_c} words w{cfg.num_warps} s{cfg.num_stages}"
        name += f"; pass 2: {cfg.programs} programs" + (" (default)" if cfg == default_bounds_config(dev) else "")
        results.append({"path": name, "bound_us": bound_us, "us": pair_us, "floor_us": int8_bytes / (copy / 2) * 1e6})
    for r in results:
        r["full/this"] = results[0]["us"] / r["us"]
        r["TB/s"] = (bf16_bytes if r is results[0] else int8_bytes) / (r.get("bound_us", r["us"]) * 1e-6) / 1e12
    return results


COLUMNS = [
    ("path", "path", "s"),
    ("bound_us", "bound pass µs", ".1f"),
    ("us", "µs (pair)", ".1f"),
    ("floor_us", "floor µs", ".1f"),
    ("TB/s", "bound pass TB/s", ".2f"),
    ("full/this", "full/this", ".2f"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--draws", type=int, default=48)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    dev = require_cuda()
    copy = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(ns.vocab, ns.hidden, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rows = quantize_rows(w)
    torch.cuda.synchronize()
    quantize_s = time.perf_counter() - t0

    cases, mismatches, kept = check_ids(w, rows, ns.draws, gen, dev)
    kept_sorted = sorted(kept)
    print(
        f"ids: {cases - len(mismatches)} of {cases} equal; kept rows median {kept_sorted[len(kept) // 2]}, "
        f"max {kept_sorted[-1]}, mean {sum(kept) / len(kept):.1f}; int8 copy made in {quantize_s:.2f} s",
        flush=True,
    )
    results = time_paths(w, rows, gen, dev, copy)
    title = f"LM head {ns.vocab} x {ns.hidden} bf16, one row (copy bandwidth {copy / 1e12:.2f} TB/s)"
    print_table(title, results, COLUMNS)
    json_path, _ = output_paths(ns.out, "lm_head_bounds")
    payload = {
        "device": device_info(dev),
        "copy_bw": copy,
        "vocab": ns.vocab,
        "hidden": ns.hidden,
        "draws": ns.draws,
        "cases": cases,
        "mismatches": mismatches,
        "kept_rows": kept,
        "quantize_s": quantize_s,
        "results": results,
    }
    write_json(json_path, payload)


if __name__ == "__main__":
    main()
