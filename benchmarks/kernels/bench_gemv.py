"""The `gemv` workload: decode-sized matrix products, x [M, K] · Wᵀ with W [N, K] bf16 and M = 1..16
rows, at the projections of Llama-3.2-1B and Llama-3.1-8B; fused_gemv (kernels/gemv.py) against
torch's F.linear (cuBLAS), and each projection's fused variant against the op sequence it replaces.

A decode product reads every weight once and does 2·M FLOPs per 2-byte weight: memory-bound, so the
figure is GB/s of weights read and its fraction of the device-to-device copy bandwidth measured at the
start of the run (bytes read + written; a read-only kernel can pass 1.0). Timing is CUDA-graph replay
(as the engine runs decode) over enough weight copies to spill the 50 MB L2 (common.bench_graph).
Fused variants, by where the model uses them:
    qkv, gate_up:  fused_gemv(x, W, norm_weight=w)            vs  F.linear(rms_norm(x, w), W)
    o:             fused_gemv(x, W, residual=r)               vs  F.linear(x, W) + r
    down:          fused_gemv(h, W, silu_mul=True, residual=r) vs  F.linear(silu_and_mul(h), W) + r
The model check times whole decode steps of the 1B shape (16 layers, random weights, paged attention
at a 1k context, LM head): the fused small-batch path against the unfused one, both as CUDA graphs.

    python benchmarks/kernels/bench_gemv.py              # all shapes, M ∈ {1, 2, 4, 8, 16}, model check
    python benchmarks/kernels/bench_gemv.py --quick      # 1B shapes, M ∈ {1, 16}
    python benchmarks/kernels/bench_gemv.py --sweep      # also sweep configs (plain kernel, 1B shapes)
    python benchmarks/kernels/bench_gemv.py --quick --no-model --sweep --sweep-fused --sweep-m 1
                                                         # sweep the fused variants the model runs at M = 1

Writes gemv_<gpu>.json and a plot per shape, gemv_<gpu>.png (gemv_sweep_<gpu>.* with --sweep).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
# (model, projection, N, K, fused variant)
SHAPES = [
    ("1b", "qkv", 3072, 2048, "norm"),
    ("1b", "o", 2048, 2048, "residual"),
    ("1b", "gate_up", 16384, 2048, "norm"),
    ("1b", "down", 2048, 8192, "silu_residual"),
    ("1b", "lm_head", 128256, 2048, None),
    ("8b", "qkv", 6144, 4096, "norm"),
    ("8b", "o", 4096, 4096, "residual"),
    ("8b", "gate_up", 28672, 4096, "norm"),
    ("8b", "down", 4096, 14336, "silu_residual"),
]
BATCHES = [1, 2, 4, 8, 16]
ROTATE_BYTES = 256e6  # weight copies per shape: together ≥ 5× the L2
MODEL_PRESET = "llama-3.2-1b"  # the model check's shape (tinyvllm.models.presets.PRESETS)
EPS = 1e-5


class Problem:
    """One shape at one M: rotated weight copies and the (small, shared) activations."""

    def __init__(self, N: int, K: int, M: int, variant: str | None, device: torch.device):
        self.N, self.K, self.M, self.variant = N, K, M, variant
        self.bytes = N * K * 2
        copies = max(1, min(32, math.ceil(ROTATE_BYTES / self.bytes)))
        gen = torch.Generator(device=device).manual_seed(N + K + M)
        self.weights = [(torch.randn(N, K, generator=gen, device=device) / K**0.5).to(BF16) for _ in range(copies)]
        self.x = torch.randn(M, K, generator=gen, device=device).to(BF16)
        self.h = torch.randn(M, 2 * K, generator=gen, device=device).to(BF16)  # [gate | up]
        self.norm_w = (1 + 0.1 * torch.randn(K, generator=gen, device=device)).to(BF16)
        self.res = torch.randn(M, N, generator=gen, device=device).to(BF16)

    def ours(self, config=None):
        from tinyvllm.kernels.gemv import fused_gemv_fwd

        return [lambda w=w: fused_gemv_fwd(self.x, w, config=config) for w in self.weights]

    def fused_kwargs(self) -> tuple[torch.Tensor, dict]:
        kw = {
            "norm": dict(norm_weight=self.norm_w, eps=EPS),
            "residual": dict(residual=self.res),
            "silu_residual": dict(silu_mul=True, residual=self.res),
        }[self.variant]
        return (self.h if self.variant == "silu_residual" else self.x), kw

    def cublas(self):
        return [lambda w=w: F.linear(self.x, w) for w in self.weights]

    def fused(self, config=None):
        from tinyvllm.kernels.gemv import fused_gemv_fwd

        x, kw = self.fused_kwargs()
        return [lambda w=w: fused_gemv_fwd(x, w, config=config, **kw) for w in self.weights]

    def unfused(self):
        from tinyvllm.kernels import triton_ops as ops

        if self.variant == "norm":
            return [lambda w=w: F.linear(ops.rms_norm(self.x, self.norm_w, EPS), w) for w in self.weights]
        if self.variant == "residual":
            return [lambda w=w: F.linear(self.x, w) + self.res for w in self.weights]
        return [lambda w=w: F.linear(ops.silu_and_mul(self.h), w) + self.res for w in self.weights]


def err_into(row: dict, name: str, fn, ref_fn) -> None:
    """row[name] = relative error of fn() against ref_fn(); a failure is reported, not raised."""
    try:
        row[name] = common.rel_err(fn(), ref_fn())
    except Exception as e:
        print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)


def time_into(row: dict, name: str, fns: list, p: Problem, copy_bw: float) -> None:
    """CUDA-graph time of the rotated calls → row[name_us], row[name_frac] (weight bytes / time / copy)."""
    try:
        ms = common.bench_graph(fns)
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_GBs"] = p.bytes / (ms * 1e-3) / 1e9
        row[f"{name}_frac"] = p.bytes / (ms * 1e-3) / copy_bw
    except Exception as e:  # a config that does not compile (shared memory) or fails: report, go on
        print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)


def run_shape(model: str, proj: str, N: int, K: int, variant: str | None, M: int, device, copy_bw: float) -> dict:
    from tinyvllm.kernels.gemv import default_config
    from tinyvllm.kernels.launch import num_sms

    p = Problem(N, K, M, variant, device)
    cfg = default_config(M, N, K, num_sms(device))
    row = {
        "model": model,
        "proj": proj,
        "N": N,
        "K": K,
        "M": M,
        "MB": p.bytes / 1e6,
        "copies": len(p.weights),
        "config": list(cfg),
        "floor_us": p.bytes / copy_bw * 1e6,
    }
    err_into(row, "err_vs_cublas", p.ours()[0], p.cublas()[0])
    time_into(row, "ours", p.ours(), p, copy_bw)
    time_into(row, "cublas", p.cublas(), p, copy_bw)
    if row.get("ours_us") and row.get("cublas_us"):
        row["speedup"] = row["cublas_us"] / row["ours_us"]
    if variant:
        row["variant"] = variant
        err_into(row, "err_fused", p.fused()[0], p.unfused()[0])
        time_into(row, "fused", p.fused(), p, copy_bw)
        time_into(row, "unfused", p.unfused(), p, copy_bw)
        if row.get("fused_us") and row.get("unfused_us"):
            row["fused_speedup"] = row["unfused_us"] / row["fused_us"]
    print(
        f"{model} {proj:8s} M={M:2d}: ours {row.get('ours_us', 0):7.1f} us ({row.get('ours_frac', 0):.2f}), "
        f"cuBLAS {row.get('cublas_us', 0):7.1f} us ({row.get('cublas_frac', 0):.2f})"
        + (f", fused {row.get('fused_us', 0):.1f} vs unfused {row.get('unfused_us', 0):.1f} us" if variant else ""),
        flush=True,
    )
    del p
    torch.cuda.empty_cache()
    return row


def sweep_shape(proj: str, N: int, K: int, M: int, variant: str | None, device, copy_bw: float) -> list[dict]:
    """Time every candidate config on one shape: the plain kernel, or with `variant` its fused one."""
    from tinyvllm.kernels.gemv import candidate_configs, default_config
    from tinyvllm.kernels.launch import num_sms

    sms = num_sms(device)
    norm = variant == "norm"
    p = Problem(N, K, M, variant, device)
    default = default_config(M, N, K, sms, norm=norm)
    rows, best = [], None
    for cfg in candidate_configs(M, N, K, sms, norm=norm):
        r = {}
        time_into(r, "t", p.fused(cfg) if variant else p.ours(cfg), p, copy_bw)
        if r.get("t_us"):
            rows.append(
                {
                    "proj": proj,
                    "N": N,
                    "K": K,
                    "M": M,
                    "variant": variant or "plain",
                    "config": list(cfg),
                    "us": r["t_us"],
                    "frac": r["t_frac"],
                    "default": cfg == default,
                }
            )
            if best is None or r["t_us"] < best[1]:
                best = (cfg, r["t_us"], r["t_frac"])
    d = next((r for r in rows if r["default"]), None)
    if best:
        print(
            f"  sweep {proj} {variant or 'plain'} M={M}: best {tuple(best[0])} {best[1]:.1f} us "
            f"({best[2]:.2f} of copy); default " + (f"{d['us']:.1f} us ({d['frac']:.2f})" if d else "failed"),
            flush=True,
        )
    del p
    torch.cuda.empty_cache()
    return rows


def build_model(device: torch.device, max_positions: int):
    """MODEL_PRESET's shape, Triton ops, random weights made on the device (no checkpoint)."""
    from tinyvllm.config import ModelConfig
    from tinyvllm.kernels import get_ops
    from tinyvllm.models.decoder import CausalLM
    from tinyvllm.models.presets import PRESETS

    config = ModelConfig.from_dict(dict(PRESETS[MODEL_PRESET]))
    with torch.device("meta"):
        model = CausalLM(config, get_ops("triton"), max_positions, BF16)
    model = model.to_empty(device=device)
    model.init_rope_table()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return model.eval().requires_grad_(False)


def decode_batch(model, B: int, ctx: int, device) -> tuple:
    """Inputs of one decode step of B rows at context `ctx`: ids, positions, attention metadata over an
    in-order paged cache of 16-key blocks, and that cache's random K/V per layer."""
    from tinyvllm.kernels.attention_metadata import AttnMetadata

    block, c, i32 = 16, model.config, torch.int32
    nb = -(-ctx // block)
    tables = torch.arange(B * nb, device=device, dtype=i32).view(B, nb)
    slots = tables[:, (ctx - 1) // block].long() * block + (ctx - 1) % block
    meta = AttnMetadata(
        slot_mapping=slots,
        num_decode_tokens=B,
        decode_seq_lens=torch.full((B,), ctx, dtype=i32, device=device),
        decode_block_tables=tables,
        max_decode_seq_len=ctx,
        num_prefills=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=i32, device=device),
        prefill_seq_lens=torch.zeros(0, dtype=i32, device=device),
        prefill_block_tables=tables[:0],
        max_prefill_q_len=0,
        max_prefill_seq_len=0,
    )
    shape = (B * nb, c.num_key_value_heads, block, c.head_dim)
    kv = [tuple(torch.randn(shape, device=device, dtype=BF16) for _ in range(2)) for _ in range(c.num_hidden_layers)]
    ids = torch.randint(0, c.vocab_size, (B,), device=device)
    pos = torch.full((B,), ctx - 1, device=device)
    return ids, pos, meta, kv


def model_check(device, batches: list[int], ctx: int, copy_bw: float) -> list[dict]:
    """Whole decode steps (layers + final norm + LM head) of the 1B shape, fused vs unfused."""
    from tinyvllm.config import RunnerConfig
    from tinyvllm.engine.paths.executor import ModelExecutor

    model = build_model(device, ctx + 16)
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if not n.endswith("norm.weight")
    )
    rows = []
    for B in batches:
        ids, pos, meta, kv = decode_batch(model, B, ctx, device)
        row = {"batch": B, "ctx": ctx, "weights_GB": weight_bytes / 1e9, "floor_ms": weight_bytes / copy_bw * 1e3}
        logits = {}
        with torch.no_grad():
            for mode in ("unfused", "fused"):
                # the runner's paths with the fused path on for this batch (the kernels serve up to 16 rows)
                cfg = RunnerConfig(
                    fused_gemv=mode == "fused",
                    fused_max_tokens=min(B, 16),
                    decode_megakernel=False,
                    pruned_lm_head=False,
                )
                paths = ModelExecutor(model, cfg, device.type)

                def step(paths=paths):
                    return paths.lm_head.logits(paths.hidden_states(ids, pos, meta, kv), dtype=None)

                try:
                    logits[mode] = step().float()
                    row[f"{mode}_ms"] = common.bench_graph([step], calls=8)
                except Exception as e:
                    print(f"  model check {mode}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        if len(logits) == 2 and row.get("fused_ms") and row.get("unfused_ms"):
            row["speedup"] = row["unfused_ms"] / row["fused_ms"]
            row["err"] = common.rel_err(logits["fused"], logits["unfused"])
            print(
                f"model check, batch {B}, ctx {ctx}: unfused {row['unfused_ms']:.3f} ms, fused "
                f"{row['fused_ms']:.3f} ms ({row['speedup']:.2f}x; floor {row['floor_ms']:.3f} ms), "
                f"logits rel. diff {row['err']:.1e}",
                flush=True,
            )
        rows.append(row)
    return rows


def plot(path: Path, rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot written")
        return
    models = sorted({r["model"] for r in rows})
    projs = [p for p in ("qkv", "o", "gate_up", "down", "lm_head") if any(r["proj"] == p for r in rows)]
    fig, axes = plt.subplots(len(models), len(projs), figsize=(4 * len(projs), 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, proj in enumerate(projs):
            ax = axes[i][j]
            rs = sorted((r for r in rows if r["model"] == model and r["proj"] == proj), key=lambda r: r["M"])
            if not rs:
                ax.axis("off")
                continue
            for key, label in (
                ("ours", "ours"),
                ("cublas", "cuBLAS"),
                ("fused", "ours fused"),
                ("unfused", "unfused ops"),
            ):
                pts = [(r["M"], r[f"{key}_frac"]) for r in rs if r.get(f"{key}_frac") is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.1)
            ax.set_title(f"{model} {proj} ({rs[0]['N']}x{rs[0]['K']})", fontsize=9)
            ax.set_xlabel("M (rows)")
            ax.set_ylabel("weight bytes / time / copy bw")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES, help="values of M (≤ 16)")
    ap.add_argument("--models", nargs="+", default=["1b", "8b"], choices=["1b", "8b"])
    ap.add_argument("--quick", action="store_true", help="1B shapes, M ∈ {1, 16}")
    ap.add_argument("--sweep", action="store_true", help="time the candidate configs (plain kernel, 1B shapes)")
    ap.add_argument("--sweep-m", type=int, nargs="+", default=[1, 16], help="values of M for --sweep")
    ap.add_argument(
        "--sweep-proj",
        nargs="+",
        default=["qkv", "o", "gate_up", "down", "lm_head"],
        choices=["qkv", "o", "gate_up", "down", "lm_head"],
        help="1B projections for --sweep",
    )
    ap.add_argument(
        "--sweep-fused",
        action="store_true",
        help="sweep each projection's fused variant (as the model calls it) instead of the plain kernel",
    )
    ap.add_argument("--no-model", action="store_true", help="skip the whole-model decode check")
    ap.add_argument("--model-batches", type=int, nargs="+", default=[1], help="decode batches of the model check")
    ap.add_argument("--model-ctx", type=int, default=1024, help="context length of the model check")
    ap.add_argument("--out", default=None, help="directory for the JSON and PNG (default benchmarks/results)")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.models = [1, 16], ["1b"]
    if any(not 1 <= m <= 16 for m in args.batches + args.sweep_m + args.model_batches):
        ap.error("M and the model-check batches must be in 1..16 (the fused path's range)")
    return args


COLUMNS = [
    ("model", "model", "s"),
    ("proj", "proj", "s"),
    ("N", "N", "d"),
    ("K", "K", "d"),
    ("M", "M", "d"),
    ("floor_us", "floor us", ".1f"),
    ("ours_us", "ours us", ".1f"),
    ("ours_frac", "ours", ".2f"),
    ("cublas_us", "cuBLAS us", ".1f"),
    ("cublas_frac", "cuBLAS", ".2f"),
    ("speedup", "ours/cuBLAS", ".2f"),
    ("variant", "fused variant", "s"),
    ("fused_us", "fused us", ".1f"),
    ("unfused_us", "unfused us", ".1f"),
    ("fused_speedup", "fused gain", ".2f"),
    ("err_vs_cublas", "err", ".1e"),
]
MODEL_COLUMNS = [
    ("batch", "B", "d"),
    ("ctx", "ctx", "d"),
    ("floor_ms", "floor", ".3f"),
    ("unfused_ms", "unfused", ".3f"),
    ("fused_ms", "fused", ".3f"),
    ("speedup", "gain", ".2f"),
    ("err", "logits diff", ".1e"),
]


def main() -> None:
    args = parse_args()
    device = common.require_cuda()
    info = common.device_info(device)
    print(f"{info['gpu']} ({info['sms']} SMs), torch {info['torch']}, triton {info['triton']}", flush=True)
    start = time.perf_counter()
    copy_bw = common.copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s", flush=True)

    shapes = [s for s in SHAPES if s[0] in args.models]
    rows = [run_shape(*shape, M, device, copy_bw) for shape in shapes for M in args.batches]
    sweep_rows = []
    if args.sweep:
        for model, proj, N, K, variant in SHAPES:
            if model == "1b" and proj in args.sweep_proj:
                for M in args.sweep_m:
                    sweep_rows += sweep_shape(proj, N, K, M, variant if args.sweep_fused else None, device, copy_bw)
    model_rows = [] if args.no_model else model_check(device, args.model_batches, args.model_ctx, copy_bw)
    torch.cuda.empty_cache()

    common.print_table(
        f"decode GEMV, bf16, CUDA-graph replay over rotated weights; fraction = weight bytes / "
        f"time / copy bandwidth ({copy_bw / 1e12:.2f} TB/s)",
        rows,
        COLUMNS,
    )
    if model_rows:
        common.print_table(
            "decode step of the Llama-3.2-1B shape (16 layers + LM head), ms per step", model_rows, MODEL_COLUMNS
        )
    json_path, png_path = common.output_paths(args.out, "gemv_sweep" if args.sweep else "gemv")
    payload = {
        "workload": "gemv",
        "device": info,
        "copy_bw": copy_bw,
        "results": rows,
        "sweep": sweep_rows,
        "model_check": model_rows,
        "seconds": time.perf_counter() - start,
    }
    common.write_json(json_path, payload)
    plot(png_path, rows)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
