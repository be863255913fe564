"""Where a decode step's time goes: GEMMs, attention, sampling, other kernels, and the gaps in between.

The workload's requests are prefilled, then `steps` decode steps are timed without the profiler (wall
time per step) and `steps` more with it (device time per kernel). Device time is classified by kernel
name; whatever of the wall time no kernel covers is host/launch gap. Writes a PNG bar chart.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

from tinyvllm.bench.workloads import Workload
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

_CATEGORIES = [
    ("decoder layers (megakernel)", re.compile(r"megakernel", re.I)),
    (
        "attention",
        re.compile(r"attention|attn|flash|_fwd|decode_kernel|prefill_kernel|prefix_kernel|merge_kernel", re.I),
    ),
    ("GEMM", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|cublas|splitk|sm90_|score_bounds|pruned_product", re.I)),
    ("sampling", re.compile(r"sample|argmax|topk|sort", re.I)),
    ("copies", re.compile(r"memcpy|memset", re.I)),
]


def classify(name: str) -> str:
    for label, pattern in _CATEGORIES:
        if pattern.search(name):
            return label
    return "other kernels"


def short_name(name: str, width: int = 48) -> str:
    """A kernel or copy name cut to something a table can hold (templates' arguments dropped)."""
    name = name.split("(")[0].split("<")[0].strip() or name
    return name if len(name) <= width else name[: width - 1] + "…"


def device_gaps(activities: list[tuple[str, float, float]], steps: int) -> list[tuple[str, float]]:
    """Idle device time between consecutive device activities, by what came before and after it.

    activities: (name, start µs, end µs) of every kernel and copy in the profiled window (any order).
    Sorted by start, the busy intervals are merged (overlapping activities hide each other's gaps); each
    idle stretch is charged to "previous → next", the activity that ended last before it and the one that
    starts it. Returns [(label, µs per step)] for `steps` profiled steps, largest first; the sum is the
    window's idle time, which `profile_steps` reports as host/launch gaps (less the untimed ends)."""
    gaps: dict[str, float] = {}
    ordered = sorted(activities, key=lambda a: a[1])
    if not ordered:
        return []
    last_name, busy_until = ordered[0][0], ordered[0][2]
    for name, start, end in ordered[1:]:
        if start > busy_until:
            label = f"{short_name(last_name)} → {short_name(name)}"
            gaps[label] = gaps.get(label, 0.0) + (start - busy_until) / steps
        if end >= busy_until:
            last_name, busy_until = name, end
    return sorted(gaps.items(), key=lambda kv: -kv[1])


def _device_activities(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of the profile's device kernels and copies."""
    from torch.autograd import DeviceType

    out = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) == DeviceType.CUDA and evt.time_range.end > evt.time_range.start:
            out.append((evt.name, float(evt.time_range.start), float(evt.time_range.end)))
    return out


def _decode_steps(engine, n: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def profile_steps(llm, w: Workload, out_dir: str | None, png_name: str, steps: int = 30) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    ids = [
        engine.add_request(
            None,
            {"prompt_token_ids": p},
            SamplingParams(
                temperature=w.temperature, max_tokens=10_000, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            ),
        )  # as LLM.generate
        for p in w.prompts
    ]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    batch = len(engine.scheduler.running)
    wall = _decode_steps(engine, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _decode_steps(engine, steps)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    per_category: dict[str, float] = {}
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(evt, "self_cuda_time_total", 0)
        if device_us <= 0:
            continue
        label = classify(evt.key)
        per_category[label] = per_category.get(label, 0.0) + device_us / 1e3 / steps
    kernel_ms = sum(per_category.values())
    per_category["host/launch gaps"] = max(0.0, wall * 1e3 - kernel_ms)
    gaps = device_gaps(_device_activities(prof), steps)
    result = {
        "batch": batch,
        "wall_ms_per_step": wall * 1e3,
        "ms_per_step": per_category,
        "gaps_us_per_step": gaps[:12],
        "top_kernels": [
            (e.key, getattr(e, "self_device_time_total", 0) / 1e3 / steps)
            for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:15]
        ],
    }
    _plot(result, Path(out_dir or "benchmarks/results") / png_name)
    print(
        f"decode step at batch {batch}: {wall * 1e3:.2f} ms wall; "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in per_category.items())
    )
    print(
        "idle device time per step, by the activities around it: "
        + "; ".join(f"{label} {us:.1f} µs" for label, us in gaps[:8])
    )
    return result


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = result["ms_per_step"]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    left = 0.0
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
    for (label, ms), color in zip(parts.items(), colors):
        ax.barh([0], [ms], left=left, color=color, label=f"{label}: {ms:.2f} ms")
        left += ms
    ax.set_yticks([])
    ax.set_xlabel("milliseconds per decode step")
    ax.set_title(f"Decode step at batch {result['batch']}: {result['wall_ms_per_step']:.2f} ms wall")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
