"""Time the sampler per configuration: host time of SamplingTensors.from_rows, device time of Sampler.

    python -m benchmarks.bench_sampler [--device cuda] [--vocab 128256] [--out-dir DIR]

Prints one line per (configuration, batch size) with medians and the 10/90% quantiles
over the repetitions, and the memory traffic of one [B, V] float32 pass as a yardstick.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from tinyvllm.bench.report import device_tag
from tinyvllm.sampling.sampler import Sampler
from tinyvllm.sampling.tensors import SamplingRow, SamplingTensors, make_generator
from tinyvllm.sampling_params import SamplingParams

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.8),
    "top_k=50": dict(temperature=0.8, top_k=50),
    "top_p=0.9": dict(temperature=0.8, top_p=0.9),
    "top_k+top_p+min_p": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "penalties": dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2),
    "seeded": dict(temperature=0.8, seed=0),
    "logprobs=5": dict(temperature=0.8, logprobs=5),
}


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p10": xs[len(xs) // 10], "p90": xs[(9 * len(xs)) // 10]}


def bench(name: str, kwargs: dict, batch: int, vocab: int, device: torch.device, reps: int) -> dict:
    params = SamplingParams(**kwargs)
    rows = [
        SamplingRow(
            params,
            prompt_token_ids=list(range(i, i + 500)),
            output_token_ids=list(range(i, i + 200)),
            generator=make_generator(i, device) if params.seed is not None else None,
            min_tokens_banned_ids=frozenset({128001}),
        )
        for i in range(batch)
    ]
    logits = torch.randn(batch, vocab, device=device, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    sampler = Sampler()
    host_ms, device_ms = [], []
    peak_mib = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for rep in range(reps + 3):
        t0 = time.perf_counter()
        tensors = SamplingTensors.from_rows(rows, vocab, device)
        t1 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sampler(logits, tensors, gen)
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t2 = time.perf_counter()
            sampler(logits, tensors, gen)
            elapsed = (time.perf_counter() - t2) * 1e3
        if rep >= 3:
            host_ms.append((t1 - t0) * 1e3)
            device_ms.append(elapsed)
    if device.type == "cuda":
        peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return {"config": name, "batch": batch, "vocab": vocab, "from_rows_ms": quantiles(host_ms),
            "sampler_ms": quantiles(device_ms), "peak_extra_mib": peak_mib}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out-dir", default="benchmarks/results", help="writes sampler_<gpu>.json there")
    args = parser.parse_args()
    device = torch.device(args.device)
    results = []
    for batch in args.batches:
        pass_ms = batch * args.vocab * 4 * 2 / 4.3e12 * 1e3  # one read + write of [B, V] fp32 at ~4.3 TB/s
        for name, kwargs in CONFIGS.items():
            r = bench(name, kwargs, batch, args.vocab, device, args.reps)
            results.append(r)
            print(f"B={batch:4d} {name:20s} sampler {r['sampler_ms']['median']:8.3f} ms "
                  f"(p10 {r['sampler_ms']['p10']:.3f}, p90 {r['sampler_ms']['p90']:.3f})  "
                  f"from_rows {r['from_rows_ms']['median']:7.3f} ms  peak {r['peak_extra_mib'] or 0:7.0f} MiB  "
              f"[one fp32 pass ~{pass_ms:.3f} ms]", flush=True)  # fmt: skip
    tag = device_tag() if device.type == "cuda" else "cpu"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"sampler_{tag}.json", {"device": str(device), "torch": torch.__version__, "results": results})


if __name__ == "__main__":
    main()
