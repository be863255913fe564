"""The batch-invariant matrix product's tile sweep: x [M, K] · Wᵀ, W [N, K] bf16, at the `llama-3.2-1b`
projections, every candidate tile of M's bucket (kernels/invariant_matmul.CANDIDATES) and the tile table's
choice against torch's F.linear (cuBLAS, which is not batch-invariant: the speed to approach).

Each time is CUDA-graph replay (as the engine runs decode) over enough weight copies to spill the 50 MB L2.
Per row: µs, cuBLAS's time over ours (1.0: as fast as cuBLAS), GB/s of operand bytes (W + x + out) and
TFLOP/s, and the floor max(bytes / copy bandwidth, 2·M·N·K / cuBLAS's 8192³ rate), both measured in the
run. Every candidate's product is also compared with the first candidate's bit for bit (`same_bits`: the
invariance tests/gpu/test_invariant_matmul_gpu.py asserts). The summary gives, per (M bucket, N bound of
the table), the candidate with the least total time over the bucket's M and the bound's shapes, as the
TILE_TABLE rule it suggests, and the decode-step estimate: 16 layers of the 4 projections plus the LM head
at the table's tiles vs cuBLAS.

    python benchmarks/kernels/bench_invariant_matmul.py                 # M ∈ {1, 4, 16, 64, 128, 256, 1024, 8192}
    python benchmarks/kernels/bench_invariant_matmul.py --ms 1,64,256   # fewer M
    python benchmarks/kernels/bench_invariant_matmul.py --smoke         # tiny shapes, CPU interpreter (no timing value)

The LM head is timed up to M = 1024 only (the engine computes logits for a step's sampled rows alone).
Writes invariant_matmul_<gpu>.json (benchmarks/results/ or --out-dir); after each M a partial one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
# projection -> (N, K, largest M timed), llama-3.2-1b
SHAPES = {
    "qkv": (3072, 2048, None),
    "o": (2048, 2048, None),
    "gate_up": (16384, 2048, None),
    "down": (2048, 8192, None),
    "lm_head": (128256, 2048, 1024),
}
SMOKE_SHAPES = {"a": (48, 80, None), "b": (136, 64, None)}
MS = (1, 4, 16, 64, 128, 256, 1024, 8192)
SMOKE_MS = (1, 5, 70)
LAYERS = 16  # llama-3.2-1b, for the decode-step estimate
ROTATE_BYTES = 256e6  # weight copies per shape: together ≥ 5× the L2
GRAPH_MS = 3.0  # GPU time one timed graph replay aims at


def bucket_of(M: int) -> int:
    """The CANDIDATES key whose bucket holds M (the smallest bound ≥ M)."""
    from tinyvllm.kernels.invariant_matmul import CANDIDATES

    return min(b for b in CANDIDATES if b >= M)


class Problem:
    """One shape at one M: rotated weight copies and the shared activations."""

    def __init__(self, N: int, K: int, M: int, device: torch.device, rotate: bool):
        self.N, self.K, self.M = N, K, M
        self.bytes = (N * K + M * K + M * N) * 2
        self.flops = 2 * M * N * K
        copies = max(1, min(32, math.ceil(ROTATE_BYTES / (N * K * 2)))) if rotate else 1
        gen = torch.Generator(device=device).manual_seed(N + K + M)
        self.weights = [(torch.randn(N, K, generator=gen, device=device) / K**0.5).to(BF16) for _ in range(copies)]
        self.x = torch.randn(M, K, generator=gen, device=device).to(BF16)

    def ours(self, config):
        from tinyvllm.kernels.invariant_matmul import matmul_fwd

        return [lambda w=w: matmul_fwd(self.x, w, config=config) for w in self.weights]

    def cublas(self):
        return [lambda w=w: F.linear(self.x, w) for w in self.weights]


def time_fns(fns: list, cuda: bool) -> float:
    """Milliseconds per call: CUDA-graph replays of the rotated calls (rounds sized to ~GRAPH_MS), or the
    wall-clock of one round on the CPU (the smoke run: the interpreter, no timing value)."""
    if not cuda:
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e3 / len(fns)
    for f in fns:
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for f in fns:
        f()
    end.record()
    end.synchronize()
    per_call = max(start.elapsed_time(end) / len(fns), 1e-3)
    calls = max(1, min(64 // len(fns), math.ceil(GRAPH_MS / per_call / len(fns))))
    return common.bench_graph(fns, calls=calls, replays=10)


def measure(row: dict, name: str, fns: list, p: Problem, cuda: bool, floors: dict) -> None:
    """row[name_us], row[name_GBs], row[name_TFs]; a config that fails (e.g. shared memory) is reported."""
    try:
        ms = time_fns(fns, cuda)
    except Exception as e:
        print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        return
    row[f"{name}_us"] = ms * 1e3
    row[f"{name}_GBs"] = p.bytes / (ms * 1e-3) / 1e9
    row[f"{name}_TFs"] = p.flops / (ms * 1e-3) / 1e12
    if floors:
        row["floor_us"] = max(p.bytes / floors["copy_Bps"], p.flops / (floors["matmul_TFs"] * 1e12)) * 1e6


def run_case(proj: str, N: int, K: int, M: int, device, cuda: bool, floors: dict, max_configs: int) -> list[dict]:
    """Every candidate of M's bucket, the table's choice (when not among them) and cuBLAS at one shape."""
    from tinyvllm.kernels.invariant_matmul import CANDIDATES, pick_config

    p = Problem(N, K, M, device, rotate=cuda)
    table = pick_config(M, N, BF16)
    configs = list(CANDIDATES[bucket_of(M)][:max_configs])
    if table not in configs:
        configs.append(table)
    base = {"proj": proj, "N": N, "K": K, "M": M, "bucket": bucket_of(M)}
    cub: dict = {}
    measure(cub, "t", p.cublas(), p, cuda, floors)
    rows, first = [], None
    for config in configs:
        row = {**base, "config": list(config), "table": config == table}
        out = p.ours(config)[0]()
        first = out if first is None else first
        row["same_bits"] = bool(torch.equal(out, first))
        row["err_vs_cublas"] = common.rel_err(out, F.linear(p.x, p.weights[0]))
        measure(row, "t", p.ours(config), p, cuda, floors)
        if row.get("t_us") and cub.get("t_us"):
            row["cublas_us"] = cub["t_us"]
            row["vs_cublas"] = cub["t_us"] / row["t_us"]
            row["floor_us"] = cub.get("floor_us")
        rows.append(row)
    done = [r for r in rows if r.get("t_us")]
    best = min(done, key=lambda r: r["t_us"]) if done else None
    tab = next((r for r in rows if r["table"]), None)
    if best and tab and tab.get("t_us"):
        print(
            f"{proj:8s} M={M:5d}: cuBLAS {cub.get('t_us', float('nan')):8.1f} us | table {tuple(tab['config'])} "
            f"{tab['t_us']:8.1f} us ({tab.get('vs_cublas', float('nan')):.2f}) | best {tuple(best['config'])} "
            f"{best['t_us']:8.1f} us ({best.get('vs_cublas', float('nan')):.2f})"
            + ("" if all(r["same_bits"] for r in rows) else "  BITS DIFFER ACROSS CONFIGS"),
            flush=True,
        )
    del p
    if cuda:
        torch.cuda.empty_cache()
    return rows


def n_bound(N: int) -> int:
    """The N bound of the first TILE_TABLE rule that holds N for a decode-sized M (the table's N classes)."""
    from tinyvllm.kernels.invariant_matmul import ANY, TILE_TABLE

    bounds = sorted({r.max_n for r in TILE_TABLE})
    return next((b for b in bounds if b >= N), ANY)


def suggest(rows: list[dict]) -> list[dict]:
    """Per (bucket, N bound): the candidate with the least total µs over the bucket's M and the bound's
    shapes (only candidates timed in every one of those cases), beside the table's current tile."""
    from tinyvllm.kernels.invariant_matmul import pick_config

    groups: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        if r.get("t_us"):
            groups.setdefault((r["bucket"], n_bound(r["N"])), []).append(r)
    out = []
    for (bucket, bound), rs in sorted(groups.items()):
        cases = {(r["proj"], r["M"]) for r in rs}
        totals: dict[tuple, float] = {}
        counts: dict[tuple, int] = {}
        for r in rs:
            c = tuple(r["config"])
            totals[c] = totals.get(c, 0.0) + r["t_us"]
            counts[c] = counts.get(c, 0) + 1
        full = {c: t for c, t in totals.items() if counts[c] == len(cases)}
        if not full:
            continue
        best = min(full, key=full.get)
        some = next(r for r in rs)
        current = tuple(pick_config(some["M"], some["N"], BF16))
        cub = sum({(r["proj"], r["M"]): r.get("cublas_us", 0.0) for r in rs}.values())
        out.append(
            {
                "bucket": bucket,
                "max_n": bound,
                "best": list(best),
                "best_us": full[best],
                "table": list(current),
                "table_us": full.get(current),
                "cublas_us": cub,
                "cases": sorted(cases),
            }
        )
    return out


def step_estimate(rows: list[dict]) -> list[dict]:
    """Per M: 16 × (qkv + o + gate_up + down) + LM head at the table's tiles and at cuBLAS, in µs."""
    out = []
    for M in sorted({r["M"] for r in rows}):
        tab = {r["proj"]: r for r in rows if r["M"] == M and r["table"] and r.get("t_us")}
        if not all(p in tab for p in ("qkv", "o", "gate_up", "down")):
            continue
        layer = ("qkv", "o", "gate_up", "down")
        ours = LAYERS * sum(tab[p]["t_us"] for p in layer) + (tab["lm_head"]["t_us"] if "lm_head" in tab else 0)
        cub = LAYERS * sum(tab[p].get("cublas_us", 0) for p in layer) + tab.get("lm_head", {}).get("cublas_us", 0)
        out.append({"M": M, "table_us": ours, "cublas_us": cub, "vs_cublas": cub / ours if ours else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default=None, help="comma-separated M values (default: the docstring's)")
    ap.add_argument("--shapes", default=None, help="comma-separated projections (default: all five)")
    ap.add_argument("--max-configs", type=int, default=8, help="candidates per bucket to time")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
        device, cuda, shapes, ms = torch.device("cpu"), False, SMOKE_SHAPES, SMOKE_MS
        info, floors = {"gpu": "cpu (interpreter)"}, {}
        max_configs = min(args.max_configs, 2)
    else:
        device, cuda, shapes, ms = common.require_cuda(), True, SHAPES, MS
        info = common.device_info(device)
        floors = {"copy_Bps": common.copy_bandwidth(device), "matmul_TFs": common.matmul_tflops(device)}
        print(
            f"{info['gpu']} ({info['sms']} SMs), triton {info['triton']}: copy {floors['copy_Bps'] / 1e9:.0f} GB/s, "
            f"cuBLAS bf16 8192³ {floors['matmul_TFs']:.0f} TFLOP/s",
            flush=True,
        )
        max_configs = args.max_configs
    if args.ms:
        ms = tuple(int(m) for m in args.ms.split(","))
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    json_path, _ = common.output_paths(args.out_dir, "invariant_matmul")
    rows = []
    for M in ms:
        for proj, (N, K, max_m) in shapes.items():
            if max_m is None or max_m >= M:
                rows += run_case(proj, N, K, M, device, cuda, floors, max_configs)
        partial = {"device": info, "floors": floors, "rows": rows, "partial": True}
        json_path.write_text(json.dumps(partial, default=float))  # what a timeout leaves
    tab = [r for r in rows if r["table"]]
    common.print_table(
        "The tile table's choice vs cuBLAS (vs_cublas > 1: faster than cuBLAS)",
        tab,
        [
            ("proj", "proj", "s"),
            ("M", "M", "d"),
            ("t_us", "us", ".1f"),
            ("cublas_us", "cuBLAS us", ".1f"),
            ("vs_cublas", "vs cuBLAS", ".2f"),
            ("floor_us", "floor us", ".1f"),
            ("t_GBs", "GB/s", ".0f"),
            ("t_TFs", "TFLOP/s", ".1f"),
        ],
    )
    sug = suggest(rows)
    print("\nBest candidate per (M bucket, N bound): total us over the bucket's M and the bound's shapes")
    for s in sug:
        mark = "" if s["best"] == s["table"] else "   <- differs from the table"
        table_us = f"{s['table_us']:.1f}" if s["table_us"] is not None else "-"
        print(
            f"  M<={s['bucket']:<19d} N<={s['max_n']:<19d} best {tuple(s['best'])} {s['best_us']:.1f} us; "
            f"table {tuple(s['table'])} {table_us} us; cuBLAS {s['cublas_us']:.1f} us{mark}"
        )
    est = step_estimate(rows)
    if est:
        print("\nDecode-step products (16 layers x 4 projections + LM head): table vs cuBLAS")
        for e in est:
            print(
                f"  M={e['M']:5d}: table {e['table_us']:9.1f} us, cuBLAS {e['cublas_us']:9.1f} us, {e['vs_cublas']:.2f}"
            )
    bad = [r for r in rows if not r["same_bits"]]
    print(
        f"\nbits equal across configs in {len(rows) - len(bad)}/{len(rows)} cases"
        + (f"; DIFFER: {bad[:3]}" if bad else "")
    )
    common.write_json(json_path, {"device": info, "floors": floors, "rows": rows, "suggested": sug, "step": est})


if __name__ == "__main__":
    main()
