"""The `prefill-attention` workload (docs/workloads.md): causal attention forward, batch × L = 16384 tokens,
hidden 2048 (head dim 64 → 32 heads, 128 → 16 heads), L in 512..16k, bf16; TFLOP/s counting
4·L²·d·heads·batch / 2.

Ours reads K/V from a paged cache (blocks in order, page size --block-sizes) through the block table,
as in serving; the baselines get contiguous [B, H, L, D] tensors: SDPA with the FlashAttention-2
backend and the cuDNN backend, and FlexAttention (torch.compile, causal block mask). Every shape
also checks ours against SDPA's output.

    python benchmarks/kernels/bench_prefill_attention.py                 # the workload (~2-3 min)
    python benchmarks/kernels/bench_prefill_attention.py --quick         # 3 lengths, head dim 64
    python benchmarks/kernels/bench_prefill_attention.py --sweep         # also try every candidate tile config
    python benchmarks/kernels/bench_prefill_attention.py --sweep --block-sizes 256 16   # sweep at page 256

The sweep runs at the first page size.

Writes prefill_attention_<gpu>.json and a plot of the TFLOP/s, prefill_attention_<gpu>.png.
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

from tinyvllm.kernels.prefill_attention import (
    CANDIDATE_CONFIGS,
    PrefillConfig,
    default_config,
    prefill_attention_fwd,
)

TOKENS, HIDDEN = 16384, 2048
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]


def causal_flops(batch: int, heads: int, length: int, d: int) -> float:
    return 4 * length * length * d * heads * batch / 2


class Problem:
    """One shape: contiguous q/k/v for the baselines and the same K/V as an in-order paged cache."""

    def __init__(self, length: int, d: int, device: torch.device):
        self.length, self.d = length, d
        self.heads, self.batch = HIDDEN // d, TOKENS // length
        B, H, L = self.batch, self.heads, length
        gen = torch.Generator(device=device).manual_seed(length + d)
        self.q, self.k, self.v = (
            torch.randn(B, H, L, d, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(3)
        )
        self.scale = d**-0.5
        self.q_packed = self.q.transpose(1, 2).reshape(B * L, H, d).contiguous()
        self.cu = torch.arange(0, B + 1, device=device, dtype=torch.int32) * L
        self.seq_lens = torch.full((B,), L, device=device, dtype=torch.int32)
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def paged(self, block_size: int):
        if block_size not in self.caches:
            B, H, L, d = self.batch, self.heads, self.length, self.d
            nb = L // block_size

            def to_cache(x):  # [B, H, L, d] → [B·nb, H, block_size, d], blocks in order
                return (
                    x.view(B, H, nb, block_size, d)
                    .permute(0, 2, 1, 3, 4)
                    .reshape(B * nb, H, block_size, d)
                    .contiguous()
                )

            tables = torch.arange(B * nb, device=self.q.device, dtype=torch.int32).view(B, nb)
            self.caches = {block_size: (to_cache(self.k), to_cache(self.v), tables)}  # keep one at a time
        return self.caches[block_size]

    def ours(self, block_size: int, config: PrefillConfig | None = None):
        kc, vc, tables = self.paged(block_size)
        return lambda: prefill_attention_fwd(
            self.q_packed, kc, vc, self.cu, self.seq_lens, tables, self.scale, self.length, config=config
        )[0]

    def ours_as_bhld(self, out: torch.Tensor) -> torch.Tensor:
        return out.view(self.batch, self.length, self.heads, self.d).transpose(1, 2)


def sdpa_fn(p: Problem, backend):
    from torch.nn.attention import sdpa_kernel

    def fn():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(p.q, p.k, p.v, is_causal=True, scale=p.scale)

    return fn


def flex_fn(p: Problem, compiled_flex, device):
    from torch.nn.attention.flex_attention import create_block_mask

    mask = create_block_mask(
        lambda b, h, q, kv: q >= kv, B=None, H=None, Q_LEN=p.length, KV_LEN=p.length, device=device
    )
    return lambda: compiled_flex(p.q, p.k, p.v, block_mask=mask, scale=p.scale)


def try_time(name: str, fn, flops: float, ref: torch.Tensor | None, row: dict, reshape=None) -> None:
    """Time fn into row[name] (TFLOP/s); on failure print why and leave it empty."""
    try:
        out = fn()
        torch.cuda.synchronize()
        if ref is not None:
            got = reshape(out) if reshape else out
            row[f"{name}_err"] = common.rel_err(got, ref)
        t = common.bench(fn)
        row[name] = flops / (t["ms"] * 1e-3) / 1e12
        row[f"{name}_ms"] = t["ms"]
    except Exception as e:  # a backend that does not support the shape must not stop the run
        print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        row[name] = None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    ap.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=[16, 256],
        help="page sizes of our paged cache (the first is the headline)",
    )
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile config per shape")
    ap.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="M,N,WARPS,STAGES",
        help="sweep these tile configs instead of the candidates (repeatable)",
    )
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (saves its compile time)")
    ap.add_argument("--quick", action="store_true", help="lengths 1k, 4k, 16k at head dim 64")
    ap.add_argument("--out", default=None, help="directory for the JSON and PNG (default benchmarks/results)")
    args = ap.parse_args()
    if args.quick:
        args.head_dims, args.lengths = [64], [1024, 4096, 16384]
    if args.config:
        args.sweep = True
    return args


def parse_config(text: str) -> PrefillConfig:
    """A --config value, M,N,WARPS,STAGES, as a PrefillConfig."""
    fields = [int(x) for x in text.split(",")]
    if len(fields) != 4:
        raise ValueError(f"--config wants M,N,WARPS,STAGES, got {text!r}")
    return PrefillConfig(*fields)


def measure_shape(p: Problem, block_sizes: list[int], compiled_flex, device, matmul: float) -> tuple[dict, object]:
    """One shape's row (ours at each page size, SDPA flash and cuDNN, FlexAttention) and the reference
    output (SDPA flash) the sweep checks against."""
    from torch.nn.attention import SDPBackend

    d, length = p.d, p.length
    flops = causal_flops(p.batch, p.heads, length, d)
    cfg = default_config(d, torch.bfloat16, length, device)
    row = {"d": d, "L": length, "batch": p.batch, "heads": p.heads, "config": list(cfg)}
    print(f"d={d} L={length} batch={p.batch} heads={p.heads} config={tuple(cfg)}", flush=True)
    ref = sdpa_fn(p, SDPBackend.FLASH_ATTENTION)()
    for bs in block_sizes:
        if length % bs == 0:
            try_time(f"ours_bs{bs}", p.ours(bs), flops, ref, row, p.ours_as_bhld)
    try_time("flash", sdpa_fn(p, SDPBackend.FLASH_ATTENTION), flops, None, row)
    try_time("cudnn", sdpa_fn(p, SDPBackend.CUDNN_ATTENTION), flops, ref, row)
    if compiled_flex is not None:
        try_time("flex", flex_fn(p, compiled_flex, device), flops, ref, row)
    ours = row.get(f"ours_bs{block_sizes[0]}")
    for base in ("flash", "cudnn", "flex"):
        if ours and row.get(base):
            row[f"ours/{base}"] = ours / row[base]
    row["ours_best"] = max((row.get(f"ours_bs{b}") or 0) for b in block_sizes) or None
    row["of_matmul"] = (row["ours_best"] or 0) / matmul
    return row, ref


def sweep_shape(p: Problem, block_size: int, candidates, ref, row: dict) -> list[dict]:
    """Every candidate tile config on one shape; the fastest correct one goes into `row`."""
    flops = causal_flops(p.batch, p.heads, p.length, p.d)
    sweep_rows, best = [], None
    for c in candidates:
        r: dict = {}
        try_time("t", p.ours(block_size, c), flops, ref, r, p.ours_as_bhld)
        if not r.get("t"):
            continue
        ok = r["t_err"] < 2e-2
        sweep_rows.append({"d": p.d, "L": p.length, "config": list(c), "tflops": r["t"], "err": r["t_err"]})
        print(f"  sweep {tuple(c)}: {r['t']:.0f} TFLOP/s err {r['t_err']:.1e}{'' if ok else ' WRONG'}", flush=True)
        if ok and (best is None or r["t"] > best[1]):
            best = (c, r["t"])
    if best:
        print(f"  best config d={p.d} L={p.length}: {tuple(best[0])} at {best[1]:.0f} TFLOP/s", flush=True)
        row["sweep_best"], row["sweep_best_tflops"] = list(best[0]), best[1]
    return sweep_rows


def report(args: argparse.Namespace, rows: list[dict], matmul: float) -> None:
    bs0 = args.block_sizes[0]
    cols = [("d", "d", "d"), ("L", "L", "d"), ("batch", "B", "d")]
    cols += [(f"ours_bs{b}", f"ours bs{b}", ".0f") for b in args.block_sizes]
    cols += [
        ("flash", "flash", ".0f"),
        ("cudnn", "cudnn", ".0f"),
        ("flex", "flex", ".0f"),
        ("ours/flash", "ours/flash", ".2f"),
        ("ours/cudnn", "ours/cudnn", ".2f"),
        ("ours/flex", "ours/flex", ".2f"),
        (f"ours_bs{bs0}_err", "err vs sdpa", ".1e"),
    ]
    if args.sweep:
        cols.append(("sweep_best_tflops", "sweep best", ".0f"))
    common.print_table(
        f"prefill attention, causal bf16, TFLOP/s (matmul ceiling {matmul:.0f}); ratios use ours at block size {bs0}",
        rows,
        cols,
    )


def plot(png_path, rows: list[dict], head_dims: list[int], block_sizes: list[int]) -> None:
    names = [f"ours_bs{b}" for b in block_sizes] + ["flash", "cudnn", "flex"]
    panels = []
    for d in head_dims:
        rs = [r for r in rows if r["d"] == d]
        series = {n: ([r["L"] for r in rs], [r.get(n) for r in rs]) for n in names}
        panels.append((f"causal prefill, head dim {d}", "sequence length", "TFLOP/s", series))
    common.plot_lines(png_path, panels)


def main() -> None:
    args = parse_args()
    candidates = [parse_config(c) for c in args.config] if args.config else CANDIDATE_CONFIGS
    device, info, compiled_flex = common.start(args.no_flex)
    matmul = common.matmul_tflops(device)
    print(f"bf16 matmul 8192³: {matmul:.0f} TFLOP/s", flush=True)

    rows, sweep_rows = [], []
    for d in args.head_dims:
        for length in args.lengths:
            p = Problem(length, d, device)
            row, ref = measure_shape(p, args.block_sizes, compiled_flex, device, matmul)
            rows.append(row)
            if args.sweep:
                sweep_rows += sweep_shape(p, args.block_sizes[0], candidates, ref, row)
            del p, ref
            torch.cuda.empty_cache()

    report(args, rows, matmul)
    json_path, png_path = common.output_paths(args.out, "prefill_attention")
    payload = {
        "workload": "prefill-attention",
        "device": info,
        "matmul_tflops": matmul,
        "results": rows,
        "sweep": sweep_rows,
    }
    common.write_json(json_path, payload)
    plot(png_path, rows, args.head_dims, args.block_sizes)


if __name__ == "__main__":
    main()
