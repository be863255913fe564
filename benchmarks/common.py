"""Small shared helpers for the GPU benchmarks: timing, hardware ceilings, a printed table, JSON and
PNG output. Each benchmark measures its ceilings in the same run and reports ratios against them."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda")


def bench(fn, warmup_ms: float = 25, rep_ms: float = 100) -> dict[str, float]:
    """Median and 20th/80th percentile of fn's GPU time in milliseconds (triton.testing.do_bench:
    CUDA events around each call, L2 flushed before each call, warm-up first)."""
    from triton.testing import do_bench

    p50, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return {"ms": p50, "ms_p20": p20, "ms_p80": p80}


def bench_graph(fns: list, calls: int | None = None, replays: int = 15) -> float:
    """Median GPU time per call in milliseconds, measured as CUDA-graph replays (no host launch
    overhead, as the engine runs its decode steps). `fns` are the same call over different input
    sets, rotated so that together they exceed the L2 cache; `calls` rounds of them go into one graph."""
    calls = calls or max(2, 64 // len(fns))
    for f in fns:  # compile and warm up outside the capture
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:  # warm the graph pool's allocations
            f()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(calls):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (calls * len(fns)))
    del graph
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    from tinyvllm.bench.roofline import copy_bandwidth as measure

    rate = measure(device, nbytes)
    torch.cuda.empty_cache()
    return rate


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    """bf16 n³ matrix product rate through torch (random data), TFLOP/s."""
    from tinyvllm.bench.roofline import matmul_rate

    rate = matmul_rate(device, n) / 1e12
    torch.cuda.empty_cache()
    return rate


def device_info(device: torch.device) -> dict:
    import triton

    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec); missing values print as '-'."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}\n{line}")
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print(line)
    print(line, flush=True)


def output_paths(out_dir: str | Path | None, name: str) -> tuple[Path, Path]:
    """Where a bench writes its JSON and plot: `<out_dir>/<name>_<gpu>.json` and `.png` (e.g.
    benchmarks/results/gemv_h200.json), `<name>_cpu` without CUDA. A later run on the same GPU replaces
    the files; its predecessors stay in git."""
    from tinyvllm.bench.report import device_tag

    d = Path(out_dir) if out_dir else RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{device_tag()}"
    return d / f"{stem}.json", d / f"{stem}.png"


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1, default=float))
    print(f"wrote {path}")


def plot_lines(path: Path, panels: list[tuple[str, str, str, dict[str, tuple[list, list]]]], logx: bool = True) -> None:
    """panels: (title, xlabel, ylabel, {series name: (xs, ys)}) side by side; written as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot written")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, xlabel, ylabel, series) in zip(axes[0], panels):
        for name, (xs, ys) in series.items():
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def configure_dynamo_for_flex() -> None:
    """Let torch.compile recompile flex_attention for every shape instead of silently falling back
    to the (slow, unfused) eager path when its recompile limit is hit."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 4096)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    cfg.suppress_errors = False


def start(no_flex: bool):
    """Shared start of the attention benchmarks: the CUDA device, its description (printed), and,
    unless `no_flex`, FlexAttention compiled with a recompile budget large enough never to fall back."""
    device = require_cuda()
    info = device_info(device)
    print(f"{info['gpu']} ({info['sms']} SMs), torch {info['torch']}, triton {info['triton']}", flush=True)
    compiled_flex = None
    if not no_flex:
        configure_dynamo_for_flex()
        from torch.nn.attention.flex_attention import flex_attention

        compiled_flex = torch.compile(flex_attention, dynamic=False)
    return device, info, compiled_flex
