"""The `attention-backward` workload (docs/workloads.md): the `prefill-attention` shapes (batch × L = 16384
tokens, hidden 2048: head dim 64 → 32 heads, 128 → 16 heads, L in 512..16k, causal, bf16), the backward
alone and forward + backward, our `flash_attention` beside SDPA's FlashAttention-2 and cuDNN backends,
in one run. TFLOP/s count the forward as 4·L²·d·heads·batch / 2 (causal) and the backward as 2.5× that
(the FlashAttention-2 paper's convention: 5 matrix products against the forward's 2). Our backward is
timed in its three dQ modes (`flash_backward`): the default (deterministic, the HOPPER_BACKWARD table),
"atomic" (`deterministic=False`, HOPPER_BACKWARD_ATOMIC) and "ordered" (deterministic; the atomic
table's tiles).

Before timing, each implementation's out, dq, dk, dv are checked against the float32 reference
(`reference.attention` under autograd) on batch entry 0, heads 0..1 (the heads are independent, so
the slice of the full computation's gradients is exact).

    python benchmarks/kernels/bench_attention_backward.py             # the workload
    python benchmarks/kernels/bench_attention_backward.py --sweep     # the tile sweep instead (with the
                                                                      # Hopper options and the forward)
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_attention_backward.py --smoke [--sweep]   # the CPU, tiny shapes

Writes attention_backward_<gpu>.json and a plot of the TFLOP/s, attention_backward_<gpu>.png (--sweep:
attention_backward_sweep_<gpu>.json; --smoke: into a temporary directory unless --out is given).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attention_backward_sweep
import common
import torch
import torch.nn.functional as F

from tinyvllm.kernels import flash_attention, reference
from tinyvllm.kernels.flash_attention_op import (
    BackwardConfig,
    default_configs,
    flash_attention_bwd,
    flash_attention_fwd,
)

TOKENS, HIDDEN = 16384, 2048
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
SWEEP_LENGTHS = [1024, 4096, 16384]
BWD_FACTOR = 2.5
IMPLS = ("ours", "flash", "cudnn")
VARIANTS = ("atomic", "ordered")  # our backward's other dQ modes, timed alone
CHECK_HEADS = 2
MAX_ERR = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # relative, against the float32 reference


def causal_flops(batch: int, heads: int, length: int, d: int) -> float:
    return 4 * length * length * d * heads * batch / 2


class Problem:
    """One shape: q, k, v, dO as [B, H, L, D] for SDPA and the same values packed [B·L, H, D] for ours."""

    def __init__(self, length: int, d: int, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.length, self.d = length, d
        self.heads, self.batch = hidden // d, tokens // length
        B, H, L = self.batch, self.heads, length
        gen = torch.Generator(device=device).manual_seed(length + d)
        self.q, self.k, self.v, self.do = (
            torch.randn(B, H, L, d, generator=gen, device=device, dtype=dtype) for _ in range(4)
        )
        self.scale = d**-0.5
        packed = [t.transpose(1, 2).reshape(B * L, H, d).contiguous() for t in (self.q, self.k, self.v, self.do)]
        self.qp, self.kp, self.vp, self.dop = packed
        self.cu = torch.arange(0, B + 1, device=device, dtype=torch.int32) * L

    def bhld(self, packed: torch.Tensor) -> torch.Tensor:
        return packed.view(self.batch, self.length, self.heads, self.d).transpose(1, 2)

    # ours -----------------------------------------------------------------------------------------
    def ours_fwd_bwd(self, bwd_config: BackwardConfig | None = None):
        inputs = [t.detach().requires_grad_() for t in (self.qp, self.kp, self.vp)]

        def fn():
            out = flash_attention(
                *inputs, True, self.cu, self.scale, max_seqlen=self.length, backend="triton", bwd_config=bwd_config
            )
            return (out, *torch.autograd.grad(out, inputs, self.dop))

        return fn

    def ours_bwd(self, bwd_config: BackwardConfig | None = None, deterministic: bool = True):
        out, lse = flash_attention_fwd(
            self.qp, self.kp, self.vp, True, self.cu, self.scale, max_seqlen=self.length, backend="triton"
        )

        def fn():
            grads = flash_attention_bwd(
                self.dop,
                self.qp,
                self.kp,
                self.vp,
                out,
                lse,
                self.cu,
                self.length,
                self.scale,
                True,
                bwd_config,
                deterministic,
            )
            return (out, *grads)

        return fn

    # SDPA -----------------------------------------------------------------------------------------
    def sdpa_fwd_bwd(self, backend):
        from torch.nn.attention import sdpa_kernel

        inputs = [t.detach().requires_grad_() for t in (self.q, self.k, self.v)]

        def fn():
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(*inputs, is_causal=True, scale=self.scale)
                return (out, *torch.autograd.grad(out, inputs, self.do))

        return fn

    def sdpa_bwd(self, backend):
        from torch.nn.attention import sdpa_kernel

        inputs = [t.detach().requires_grad_() for t in (self.q, self.k, self.v)]
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(*inputs, is_causal=True, scale=self.scale)

        def fn():
            with sdpa_kernel([backend]):
                return (out, *torch.autograd.grad(out, inputs, self.do, retain_graph=True))

        return fn

    def reference_slice(self) -> list[torch.Tensor]:
        """out, dq, dk, dv of batch 0, heads 0..CHECK_HEADS−1 in float32 through the reference: [h, L, D]."""
        L = self.length
        sl = [t[0, :CHECK_HEADS].transpose(0, 1).float().detach().requires_grad_() for t in (self.q, self.k, self.v)]
        cu = torch.tensor([0, L], dtype=torch.int32, device=self.q.device)
        out = reference.attention(*sl, cu, self.scale, True)
        out.backward(self.do[0, :CHECK_HEADS].transpose(0, 1).float())
        return [t.detach().transpose(0, 1) for t in (out, *(x.grad for x in sl))]


def check(name: str, result, ref: list[torch.Tensor], packed: bool, p: Problem, row: dict) -> None:
    """Relative error of out, dq, dk, dv (the worst of the four) on the checked slice, into row."""
    errs = []
    for got, want in zip(result, ref):
        got = p.bhld(got) if packed else got
        errs.append(common.rel_err(got[0, :CHECK_HEADS], want))
    row[f"{name}_err"] = max(errs)
    if max(errs) > MAX_ERR.get(p.q.dtype, 2e-2):
        print(f"  {name}: WRONG, relative errors out/dq/dk/dv {[f'{e:.1e}' for e in errs]}", flush=True)


def timed_ms(fn) -> float:
    """Median milliseconds per call: triton.testing.do_bench on CUDA, wall clock on the CPU."""
    if torch.cuda.is_available():
        return common.bench(fn)["ms"]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def try_time(name: str, make, flops: float, ref, packed: bool, p: Problem, row: dict) -> None:
    """Check and time one implementation into row[name] (TFLOP/s); a backend that fails on this shape
    or device leaves None and the run goes on."""
    try:
        fn = make()
        result = fn()
        check(name, result, ref, packed, p, row)
        del result
        ms = timed_ms(fn)
        row[name], row[f"{name}_ms"] = flops / (ms * 1e-3) / 1e12, ms
    except Exception as e:
        print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        row[name] = None


def measure_shape(p: Problem) -> tuple[dict, list[torch.Tensor]]:
    """One shape's row: backward alone and forward + backward for ours, SDPA flash and cuDNN."""
    from torch.nn.attention import SDPBackend

    fwd = causal_flops(p.batch, p.heads, p.length, p.d)
    cfg_f, cfg_b = default_configs(p.d, p.q.dtype, p.q.device, p.length)
    cfg_atomic = default_configs(p.d, p.q.dtype, p.q.device, p.length, deterministic=False)[1]
    cfg_ordered = cfg_atomic._replace(dq_mode="ordered")
    row = {"d": p.d, "L": p.length, "batch": p.batch, "heads": p.heads, "fwd_config": list(cfg_f)}
    row["bwd_config"], row["atomic_config"], row["ordered_config"] = list(cfg_b), list(cfg_atomic), list(cfg_ordered)
    print(f"d={p.d} L={p.length} batch={p.batch} heads={p.heads} bwd config={tuple(cfg_b)}", flush=True)
    ref = p.reference_slice()
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    try_time("ours_bwd", p.ours_bwd, BWD_FACTOR * fwd, ref, True, p, row)
    try_time("atomic_bwd", lambda: p.ours_bwd(cfg_atomic, False), BWD_FACTOR * fwd, ref, True, p, row)
    try_time("ordered_bwd", lambda: p.ours_bwd(cfg_ordered), BWD_FACTOR * fwd, ref, True, p, row)
    try_time("ours_fwdbwd", p.ours_fwd_bwd, (1 + BWD_FACTOR) * fwd, ref, True, p, row)
    for name, backend in backends.items():
        try_time(f"{name}_bwd", lambda b=backend: p.sdpa_bwd(b), BWD_FACTOR * fwd, ref, False, p, row)
        try_time(f"{name}_fwdbwd", lambda b=backend: p.sdpa_fwd_bwd(b), (1 + BWD_FACTOR) * fwd, ref, False, p, row)
    for part in ("bwd", "fwdbwd"):
        for base in backends:
            if row.get(f"ours_{part}") and row.get(f"{base}_{part}"):
                row[f"ours/{base}_{part}"] = row[f"ours_{part}"] / row[f"{base}_{part}"]
    ours = [row.get(f"{i}_bwd") for i in ("ours", *VARIANTS)]
    if any(ours):
        row["best_bwd"] = max(t for t in ours if t)
        for base in backends:
            if row.get(f"{base}_bwd"):
                row[f"best/{base}_bwd"] = row["best_bwd"] / row[f"{base}_bwd"]
    return row, ref


def report(rows: list[dict], ceiling: float | None) -> None:
    cols = [("d", "d", "d"), ("L", "L", "d"), ("batch", "B", "d")]
    for part, label in (("bwd", "bwd"), ("fwdbwd", "f+b")):
        cols += [(f"{i}_{part}", f"{i} {label}", ".0f") for i in IMPLS]
        if part == "bwd":
            cols += [(f"{v}_bwd", v, ".0f") for v in VARIANTS]
        cols += [(f"ours/{b}_{part}", f"/{b} {label}", ".2f") for b in ("flash", "cudnn")]
        if part == "bwd":
            cols += [(f"best/{b}_bwd", f"best/{b}", ".2f") for b in ("flash", "cudnn")]
    cols.append(("ours_bwd_err", "err", ".1e"))
    ceiling_note = f" (matmul ceiling {ceiling:.0f})" if ceiling else ""
    common.print_table(f"attention backward, causal, TFLOP/s{ceiling_note}", rows, cols)


def plot(png_path: Path, rows: list[dict], head_dims: list[int]) -> None:
    panels = []
    for d in head_dims:
        rs = [r for r in rows if r["d"] == d]
        for part, title in (("bwd", "backward"), ("fwdbwd", "forward + backward")):
            series = {i: ([r["L"] for r in rs], [r.get(f"{i}_{part}") for r in rs]) for i in IMPLS}
            panels.append((f"causal {title}, head dim {d}", "sequence length", "TFLOP/s", series))
    common.plot_lines(png_path, panels)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    ap.add_argument("--sweep", action="store_true", help="the tile sweep (attention_backward_sweep.py) instead")
    ap.add_argument("--sweep-lengths", type=int, nargs="+", default=SWEEP_LENGTHS)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--out", default=None, help="directory for the JSON and PNG (default benchmarks/results)")
    args = ap.parse_args()
    args.tokens, args.hidden, args.dtype = TOKENS, HIDDEN, torch.bfloat16
    if args.smoke:
        args.head_dims, args.lengths, args.tokens, args.hidden = [16, 32], [32, 64], 64, 64
        args.sweep_lengths = [32, 64]
        args.out = args.out or tempfile.mkdtemp(prefix="attention-backward-")
    return args


def sweep(args: argparse.Namespace, device: torch.device, info: dict) -> None:
    """`--sweep`: every candidate of each backward kernel at the sweep lengths; prints the tables."""
    result = attention_backward_sweep.run(
        make_problem=lambda length, d: Problem(length, d, args.tokens, args.hidden, args.dtype, device),
        head_dims=args.head_dims,
        lengths=args.sweep_lengths,
        hidden=args.hidden,
        flops_of=lambda p: BWD_FACTOR * causal_flops(p.batch, p.heads, p.length, p.d),
        max_err=MAX_ERR.get(args.dtype, 2e-2),
        rel_err=common.rel_err,
        reference_of=lambda p: p.reference_slice(),
        limit=2 if args.smoke else None,
    )
    json_path, _ = common.output_paths(args.out, "attention_backward_sweep")
    common.write_json(json_path, {"workload": "attention-backward sweep", "device": info, **result})


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        device = common.require_cuda()
        info = common.device_info(device)
        ceiling = None if args.sweep else common.matmul_tflops(device)
        print(f"{info['gpu']} ({info['sms']} SMs)" + (f"; bf16 matmul 8192³: {ceiling:.0f} TFLOP/s" if ceiling else ""))
    elif args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        device, info, ceiling = torch.device("cpu"), {"gpu": "cpu (Triton interpreter)"}, None
    else:
        sys.exit("this benchmark needs a CUDA GPU, or --smoke with TRITON_INTERPRET=1 on the CPU")
    if args.sweep:
        sweep(args, device, info)
        return
    rows = []
    for d in args.head_dims:
        for length in args.lengths:
            p = Problem(length, d, args.tokens, args.hidden, args.dtype, device)
            row, ref = measure_shape(p)
            rows.append(row)
            del p, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report(rows, ceiling)
    json_path, png_path = common.output_paths(args.out, "attention_backward")
    payload = {
        "workload": "attention-backward",
        "device": info,
        "matmul_tflops": ceiling,
        "flops": "forward 4·L²·d·heads·batch/2 (causal); backward 2.5× the forward",
        "results": rows,
    }
    common.write_json(json_path, payload)
    plot(png_path, rows, args.head_dims)


if __name__ == "__main__":
    main()
