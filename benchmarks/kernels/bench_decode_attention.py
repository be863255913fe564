"""The `decode-attention` workload (docs/workloads.md): one query token per sequence, paged KV cache (block
16), 32 query / 8 KV heads, head dim 64, bf16, batch {1, 16, 64, 256} × context {512, 2k, 8k, 32k}.

Decode is bound by memory bandwidth, so the figure is GB/s of K/V + Q + O moved, and its fraction of
the device-to-device copy bandwidth measured in this same run (bytes read + written; a read-only
kernel can pass 1.0). Ours runs on the paged cache with blocks shuffled at random (as a real cache ends
up) and in order, shuffled with its split and merge kernels launched as programmatic dependents (`ours
pdl`, kernels/pdl.py: the merge's launch overlaps the split's tail; sm_90+), and shuffled with the merge
folded into the split kernel (`fold_merge`: one launch instead of two); the baselines get contiguous
[B, Hk, L, D] K/V: SDPA flash and cuDNN (enable_gqa) and FlexAttention (torch.compile). Ours (in order) is
checked against SDPA's output.

    python benchmarks/kernels/bench_decode_attention.py            # the workload (~2 min)
    python benchmarks/kernels/bench_decode_attention.py --quick    # 4 shapes
    python benchmarks/kernels/bench_decode_attention.py --sweep    # also try the candidate configs
    python benchmarks/kernels/bench_decode_attention.py --fp8      # also ours over an FP8 (e4m3) cache

With `--fp8` each shape also runs ours over the same K/V quantized to e4m3 (one scale per tensor, as the
engine's per-layer scales), its fraction counted in the bytes it moves (1-byte K/V), and its output
against SDPA's on the bf16 K/V; writes decode_attention_fp8_<gpu>.json then. `--sweep --fp8` sweeps the
candidate configs over the FP8 cache as well (for `decode_attention.FP8_CONFIG`).

Writes decode_attention_<gpu>.json and a plot of the fractions, decode_attention_<gpu>.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch
import torch.nn.functional as F

from tinyvllm.kernels.decode_attention import (
    CANDIDATE_CONFIGS,
    DEFAULT_CONFIG,
    DecodeConfig,
    decode_attention_fwd,
    num_splits_for,
)
from tinyvllm.kernels.launch import num_sms
from tinyvllm.kernels.pdl import programmatic_launches

HQ, HK, D, BLOCK = 32, 8, 64, 16
BATCHES = [1, 16, 64, 256]
CONTEXTS = [512, 2048, 8192, 32768]
SWEEP_SHAPES = [(1, 32768), (16, 2048), (16, 32768), (64, 8192), (256, 512), (256, 8192)]


class Problem:
    def __init__(self, batch: int, ctx: int, device: torch.device, seed: int = 0):
        self.batch, self.ctx = batch, ctx
        gen = torch.Generator(device=device).manual_seed(batch * 7 + ctx + 1000 * seed)
        self.q = torch.randn(batch, HQ, D, generator=gen, device=device, dtype=torch.bfloat16)
        self.k = torch.randn(batch, HK, ctx, D, generator=gen, device=device, dtype=torch.bfloat16)
        self.v = torch.randn(batch, HK, ctx, D, generator=gen, device=device, dtype=torch.bfloat16)
        nb = ctx // BLOCK

        def to_cache(x):  # [B, Hk, L, D] → [B·nb, Hk, BLOCK, D], blocks in order
            return x.view(batch, HK, nb, BLOCK, D).permute(0, 2, 1, 3, 4).reshape(batch * nb, HK, BLOCK, D).contiguous()

        self.k_cache, self.v_cache = to_cache(self.k), to_cache(self.v)
        self.tables_in_order = torch.arange(batch * nb, device=device, dtype=torch.int32).view(batch, nb)
        perm = torch.randperm(batch * nb, generator=torch.Generator().manual_seed(ctx)).to(device)
        self.tables_shuffled = perm.to(torch.int32).view(batch, nb)  # same bytes, random block order
        self.seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
        self.scale = D**-0.5
        self.bytes = 2 * self.k.numel() * 2 + 2 * self.q.numel() * 2  # K + V read, Q read, O written
        self.fp8_bytes = 2 * self.k.numel() + 2 * self.q.numel() * 2  # the same with 1-byte K/V
        self.kv_scales = (float(self.k.abs().amax()) / 448, float(self.v.abs().amax()) / 448)
        self.k_fp8 = self.v_fp8 = None

    def quantize(self) -> None:
        """The e4m3 copies of the paged K/V (per-tensor scales)."""
        e4m3 = torch.float8_e4m3fn
        self.k_fp8 = (self.k_cache.float() / self.kv_scales[0]).to(e4m3)
        self.v_fp8 = (self.v_cache.float() / self.kv_scales[1]).to(e4m3)

    def ours_fp8(self, tables, config: DecodeConfig | None = None):
        ks, vs = self.kv_scales
        return lambda: decode_attention_fwd(
            self.q, self.k_fp8, self.v_fp8, self.seq_lens, tables, self.scale, self.ctx, config=config,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip

    def ours(self, tables, config: DecodeConfig | None = None):
        return lambda: decode_attention_fwd(
            self.q, self.k_cache, self.v_cache, self.seq_lens, tables, self.scale, self.ctx, config=config
        )

    def sdpa(self, backend):
        from torch.nn.attention import sdpa_kernel

        q4 = self.q.unsqueeze(2)  # [B, Hq, 1, D]

        def fn():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, self.k, self.v, scale=self.scale, enable_gqa=True)

        return fn

    def flex(self, compiled_flex):
        q4 = self.q.unsqueeze(2)
        return lambda: compiled_flex(q4, self.k, self.v, scale=self.scale, enable_gqa=True)


def with_pdl(fn):
    """fn with its kernels launched as programmatic dependents (kernels/pdl.py; sm_90+, else unchanged)."""

    def call():
        with programmatic_launches(True):
            return fn()

    return call


def try_time(name, fn, p: Problem, copy_bw: float, ref, row: dict, graph_fns=None, nbytes=None) -> None:
    """Eager timing (do_bench, L2 flushed) of fn into row[name...]; with graph_fns (the same call
    over rotated inputs), also CUDA-graph replay timing into row[name + '_graph...']. Fractions count
    `nbytes` (default p.bytes)."""
    nbytes = p.bytes if nbytes is None else nbytes
    try:
        out = fn()
        torch.cuda.synchronize()
        if ref is not None:
            row[f"{name}_err"] = common.rel_err(out.reshape(ref.shape), ref)
        t = common.bench(fn)
        row[f"{name}_us"] = t["ms"] * 1e3
        row[name] = nbytes / (t["ms"] * 1e-3) / 1e9  # GB/s
        row[f"{name}_frac"] = row[name] * 1e9 / copy_bw
        if graph_fns:
            ms = common.bench_graph(graph_fns)
            row[f"{name}_graph_us"] = ms * 1e3
            row[f"{name}_graph_frac"] = nbytes / (ms * 1e-3) / copy_bw
    except Exception as e:
        print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--sweep", action="store_true", help="time the candidate configs on a few shapes")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (saves its compile time)")
    ap.add_argument("--quick", action="store_true", help="4 shapes")
    ap.add_argument("--fp8", action="store_true", help="also time ours over an e4m3 copy of the cache")
    ap.add_argument("--out", default=None, help="directory for the JSON and PNG (default benchmarks/results)")
    return ap.parse_args()


def measure_shape(p: Problem, rotation: list[Problem], copy_bw: float, compiled_flex, device, fp8: bool) -> dict:
    """One shape's row: ours (blocks shuffled and in order), SDPA flash and cuDNN, FlexAttention."""
    from torch.nn.attention import SDPBackend

    flash, cudnn = SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION
    splits = num_splits_for(p.batch, HK, p.ctx, num_sms(device), DEFAULT_CONFIG)
    row = {"batch": p.batch, "ctx": p.ctx, "MB": p.bytes / 1e6, "splits": splits}
    print(f"batch={p.batch} ctx={p.ctx}: {p.bytes / 1e6:.1f} MB, {splits} splits", flush=True)
    ref = p.sdpa(flash)().squeeze(2)
    shuffled = [r.ours(r.tables_shuffled) for r in rotation]
    try_time("ours_shuffled", p.ours(p.tables_shuffled), p, copy_bw, None, row, shuffled)
    try_time("ours_in_order", p.ours(p.tables_in_order), p, copy_bw, ref, row)
    pdl = [with_pdl(r.ours(r.tables_shuffled)) for r in rotation]  # split and merge as dependent launches
    try_time("ours_pdl", with_pdl(p.ours(p.tables_shuffled)), p, copy_bw, None, row, pdl)
    fold = DEFAULT_CONFIG._replace(fold_merge=True)  # the last split merges: one launch, not two
    folded = [r.ours(r.tables_shuffled, fold) for r in rotation]
    try_time("ours_fold", p.ours(p.tables_shuffled, fold), p, copy_bw, None, row, folded)
    try_time("flash", p.sdpa(flash), p, copy_bw, None, row, [r.sdpa(flash) for r in rotation])
    try_time("cudnn", p.sdpa(cudnn), p, copy_bw, ref, row, [r.sdpa(cudnn) for r in rotation])
    if compiled_flex is not None:
        try_time("flex", p.flex(compiled_flex), p, copy_bw, ref, row)
    if row.get("ours_shuffled") and row.get("cudnn"):
        row["ours/cudnn"] = row["ours_shuffled"] / row["cudnn"]
    if fp8:
        for r in rotation:
            r.quantize()
        graphs = [r.ours_fp8(r.tables_shuffled) for r in rotation]
        try_time("fp8_shuffled", p.ours_fp8(p.tables_shuffled), p, copy_bw, None, row, graphs, p.fp8_bytes)
        row["fp8_err"] = common.rel_err(p.ours_fp8(p.tables_in_order)().reshape(ref.shape), ref)
        if row.get("fp8_shuffled_graph_us") and row.get("ours_shuffled_graph_us"):
            row["fp8_speedup"] = row["ours_shuffled_graph_us"] / row["fp8_shuffled_graph_us"]
        for r in rotation:
            r.k_fp8 = r.v_fp8 = None
    return row


def sweep_shape(p: Problem, rotation: list[Problem], copy_bw: float, row: dict, fp8: bool = False) -> list[dict]:
    """Every candidate config on one shape (graph replays); the best goes into `row`. fp8: over the e4m3
    copy of the cache instead (its bytes are the fraction's), the best into row["sweep_best_fp8"]."""
    sweep_rows, best = [], None
    if fp8:
        for r in rotation:
            r.quantize()
    for c in CANDIDATE_CONFIGS:
        r: dict = {}

        def call(x: Problem, c=c):
            return (x.ours_fp8 if fp8 else x.ours)(x.tables_shuffled, c)

        try_time("t", call(p), p, copy_bw, None, r, [call(x) for x in rotation], p.fp8_bytes if fp8 else None)
        if not r.get("t"):
            continue
        sweep_rows.append(
            {"batch": p.batch, "ctx": p.ctx, "config": list(c), "fp8": fp8, "frac": r["t_frac"],
             "graph_frac": r["t_graph_frac"]}
        )  # fmt: skip
        print(f"  sweep{' fp8' if fp8 else ''} {tuple(c)}: {r['t_frac']:.2f} eager, {r['t_graph_frac']:.2f} graph")
        if best is None or r["t_graph_frac"] > best[1]:
            best = (c, r["t_graph_frac"])
    if fp8:
        for r in rotation:
            r.k_fp8 = r.v_fp8 = None
    if best:
        key = "sweep_best_fp8" if fp8 else "sweep_best"
        print(f"  best{' fp8' if fp8 else ''} config: {tuple(best[0])} at {best[1]:.2f} of copy bandwidth (graph)")
        row[key], row[f"{key}_frac"] = list(best[0]), best[1]
    return sweep_rows


COLUMNS = [
    ("batch", "B", "d"),
    ("ctx", "ctx", "d"),
    ("MB", "MB", ".1f"),
    ("splits", "splits", "d"),
    ("ours_shuffled_us", "ours us", ".1f"),
    ("ours_shuffled_frac", "ours shuf", ".2f"),
    ("ours_in_order_frac", "ours in-order", ".2f"),
    ("flash_frac", "flash", ".2f"),
    ("cudnn_frac", "cudnn", ".2f"),
    ("flex_frac", "flex", ".2f"),
    ("ours/cudnn", "ours/cudnn", ".2f"),
    ("ours_shuffled_graph_us", "graph: ours us", ".1f"),
    ("ours_shuffled_graph_frac", "ours", ".2f"),
    ("ours_pdl_graph_frac", "ours pdl", ".2f"),
    ("ours_fold_graph_frac", "ours fold", ".2f"),
    ("flash_graph_frac", "flash", ".2f"),
    ("cudnn_graph_frac", "cudnn", ".2f"),
    ("ours_in_order_err", "err vs sdpa", ".1e"),
]


def plot(png_path, rows: list[dict]) -> None:
    names = ["ours_shuffled", "ours_in_order", "flash", "cudnn", "flex"]
    panels = []
    for batch in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == batch]
        series = {n: ([r["ctx"] for r in rs], [r.get(f"{n}_frac") for r in rs]) for n in names}
        panels.append((f"decode, batch {batch}", "context", "fraction of copy bandwidth", series))
    common.plot_lines(png_path, panels)


def main() -> None:
    args = parse_args()
    shapes = [(b, c) for b in args.batches for c in args.contexts]
    if args.quick:
        shapes = [(1, 32768), (16, 2048), (64, 8192), (256, 512)]
    device, info, compiled_flex = common.start(args.no_flex)
    copy_bw = common.copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s", flush=True)

    rows, sweep_rows = [], []
    free, _ = torch.cuda.mem_get_info()
    for batch, ctx in shapes:
        need = 2 * (2 * batch * HK * ctx * D * 2)  # contiguous K/V + the paged copy
        if need > 0.7 * free:
            print(f"skip batch={batch} ctx={ctx}: needs {need / 1e9:.0f} GB of {free / 1e9:.0f} GB free")
            continue
        p = Problem(batch, ctx, device)
        # Graph timing rotates over enough input sets to spill the 60 MB L2 several times.
        rotation = [p] + [Problem(batch, ctx, device, seed=i) for i in range(1, min(64, -(-256_000_000 // p.bytes)))]
        rows.append(measure_shape(p, rotation, copy_bw, compiled_flex, device, args.fp8))
        if args.sweep and (batch, ctx) in SWEEP_SHAPES:
            sweep_rows += sweep_shape(p, rotation, copy_bw, rows[-1])
            if args.fp8:
                sweep_rows += sweep_shape(p, rotation, copy_bw, rows[-1], fp8=True)
        del p, rotation
        torch.cuda.empty_cache()

    cols = COLUMNS + ([("sweep_best_frac", "sweep best", ".2f")] if args.sweep else [])
    if args.sweep and args.fp8:
        cols += [("sweep_best_fp8_frac", "sweep best fp8", ".2f")]
    if args.fp8:
        cols += [
            ("fp8_shuffled_graph_us", "fp8 us", ".1f"),
            ("fp8_shuffled_graph_frac", "fp8 frac", ".2f"),
            ("fp8_speedup", "fp8 speed-up", ".2f"),
            ("fp8_err", "fp8 err", ".1e"),
        ]
    common.print_table(
        f"decode attention, bf16, fraction of copy bandwidth ({copy_bw / 1e12:.2f} TB/s); "
        "eager = do_bench with L2 flushed (host launch cost included where the GPU waits "
        "for it); graph = CUDA-graph replay over rotated inputs (as the engine runs decode)",
        rows,
        cols,
    )
    json_path, png_path = common.output_paths(args.out, "decode_attention_fp8" if args.fp8 else "decode_attention")
    payload = {
        "workload": "decode-attention",
        "device": info,
        "copy_bw": copy_bw,
        "config": list(DEFAULT_CONFIG),
        "results": rows,
        "sweep": sweep_rows,
    }
    common.write_json(json_path, payload)
    plot(png_path, rows)


if __name__ == "__main__":
    main()
