"""The fused top-k / top-p / min-p sampler beside the full sampler and beside one read of the logits.

    python benchmarks/kernels/bench_top_p_sampling.py [--batches 1 256] [--vocab 128256] [--dtypes bfloat16]
        [--shapes randn peaked] [--out DIR]
    python benchmarks/kernels/bench_top_p_sampling.py --cpu-smoke   # tiny, on the CPU (Triton interpreter)
    python benchmarks/kernels/bench_top_p_sampling.py --sweep [--batches 256 64]   # the search's layouts
    python benchmarks/kernels/bench_top_p_sampling.py --reads [--rows 4] [--candidates 8]   # passes per row

Per (logits dtype, batch, logits shape, filters), at temperature 0.6 over random logits: "randn" is
randn · 2, "peaked" the same plus 30 tokens at random indices raised by 12 down to 4 (evenly spaced), an
instruct model's peaked rows:
  * fused: `sample_top_k_top_p` with the radix select on (it serves the top-k rows; the precheck and the
    threshold search the others; the thresholded Gumbel draw), as CUDA-graph replays; "search": with the
    radix select off (the precheck and the search for every row: the default), "no pre": with both off;
    "radix reads" the reads per row with the radix select (radix passes, statistics, check, search
    passes, and the draw's for rows not decided), "same ids" whether the three give every row the same id
    (they must, but for a row within float rounding of a top-p boundary);
  * search: `truncation_thresholds` alone (default: 8 candidates per pass, 10 passes split over rows ×
    chunks), and the passes over each row it made (mean, max); "pre": `truncation_plan` with the precheck
    (the radix select off),
    its reads per row (statistics, check, search passes), the fraction of rows it decided ("accepted"),
    and the reads per row with the draw's ("reads": search + 1 without the precheck; decided rows skip
    the draw); "per-row": every pass by one program per row with 8 candidates (split_passes=0), the
    search's earlier layout, for comparison;
  * full: today's torch sampler (sampling/sampler.py: sort, softmax, cumsum, exponential race), do_bench;
  * amax: `torch.amax(logits, -1)`, one read of the logits, as CUDA-graph replays;
  * floor: B·V·bytes at the measured read bandwidth (copy rate / 2), the time of one read.
Writes top_p_sampling_<gpu>.json (top_p_sampling_cpu.json with --cpu-smoke, timings meaningless there).

--sweep: `truncation_thresholds` alone (bf16 logits, CUDA-graph replays) for top_p=0.9 and
top_k=50,top_p=0.9 in each search layout: candidates NC ∈ {4, 8, 16} × lanes per iteration
BLOCK_E ∈ {128, 256} × skip (iterations without values in (lo, hi] skip the candidate compares) on or
off, and two blocks per iteration (unroll 2) for some (`SEARCH_LAYOUTS`); prints µs, the mean passes per
row (the statistics' read included), µs per pass, whether the other skip setting without the unroll
gave every threshold the same bits (it must), and the fastest layout per (batch, filters) and overall
(summed over the cases). Writes top_p_sweep_<gpu>.json.

--reads: the search's reads of each row, nothing timed (on the CPU under TRITON_INTERPRET=1 unless CUDA is
there): `truncation_thresholds` (no precheck), `truncation_plan` (precheck, radix select off) and
`truncation_plan` with the radix select and the precheck over --rows rows of V = 128,256 per shape, every filter
configuration; mean and max reads per row (the statistics' read included, and the check's with the
precheck; the radix passes' with the radix select), the fraction of rows the precheck decided and of rows
the radix select's run decided (drawn by the radix select or kept by the precheck). Shapes: randn and peaked in
bfloat16, randn in float32, and adversarial rows (bfloat16 unless said): "ties" (17 distinct values),
"heavy" (Student t, 3 degrees of freedom, · 2: tails far from Gaussian), "huge" (randn · 2 and one logit at
60: one token holds the mass), "equal" (every logit 0), "masked" (randn · 2, a bitmask allowing one token in
8), "tiny" (V = 37). Writes top_p_reads_<gpu>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

CONFIGS = {
    "top_p=0.9": dict(top_p=0.9),
    "top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9),
    "top_k=50": dict(top_k=50),
    "min_p=0.05": dict(min_p=0.05),
}
TEMPERATURE = 0.6
PER_ROW = dict(split_passes=0, candidates=8)  # every search pass by one program per row
SWEEP_FILTERS = ("top_p=0.9", "top_k=50,top_p=0.9")
SHAPES = ("randn", "peaked")


def make_logits(shape: str, batch: int, vocab: int, dev, gen, dtype):
    """[batch, vocab] logits of a shape (module docstring): randn · 2, or that plus 30 raised tokens."""
    import torch

    z = torch.randn(batch, vocab, device=dev, generator=gen) * 2
    if shape == "peaked":
        rise = torch.linspace(12.0, 4.0, 30, device=dev)
        for r in range(batch):
            idx = torch.randperm(vocab, device=dev, generator=gen)[:30]
            z[r, idx] += rise
    return z.to(dtype)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="logits dtypes (CUDA)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="logits shapes")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="batch 2 × 4,096 float32 on the CPU under TRITON_INTERPRET=1"
    )
    ap.add_argument("--sweep", action="store_true", help="time the search's layouts (NC × BLOCK_E × skip)")
    ap.add_argument("--reads", action="store_true", help="count the search's reads per row (no timing)")
    ap.add_argument("--rows", type=int, default=None, help="--reads: rows per shape (default 4 on the CPU, 64 on CUDA)")
    ap.add_argument("--candidates", type=int, default=None, help="--reads: candidates per pass (default: the kernel's)")
    ns = ap.parse_args()
    if ns.reads:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    if ns.cpu_smoke:
        ns.batches, ns.vocab = [2], 4096
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    return ns


def cpu_time_ms(fn, reps: int = 1) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sweep(ns: argparse.Namespace) -> None:
    """The search alone in every layout of `SEARCH_LAYOUTS` (module docstring, --sweep)."""
    import torch
    from common import bench_graph, device_info, output_paths, print_table, write_json

    from tinyvllm.kernels.top_p_sampling import SEARCH_LAYOUTS, truncation_thresholds

    cuda = torch.cuda.is_available() and not ns.cpu_smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layouts = SEARCH_LAYOUTS if cuda else SEARCH_LAYOUTS[::5]
    rows = []
    for batch in ns.batches:
        gen = torch.Generator(device=dev).manual_seed(batch)
        n_sets = 4 if cuda else 1  # rotated input sets: together more than the L2 cache
        logits = [(torch.randn(batch, ns.vocab, device=dev, generator=gen) * 2).to(dtype) for _ in range(n_sets)]
        for name in SWEEP_FILTERS:
            filters = CONFIGS[name]
            args = (
                torch.full((batch,), TEMPERATURE, device=dev),
                torch.full((batch,), filters.get("top_k", 0), dtype=torch.int32, device=dev),
                torch.full((batch,), filters.get("top_p", 1.0), device=dev),
                torch.zeros(batch, device=dev),
            )
            for layout in layouts:
                thr, passes = truncation_thresholds(logits[0], *args, **layout)
                other = dict(layout, skip=1 - layout["skip"], unroll=1)
                thr_other, _ = truncation_thresholds(logits[0], *args, **other)
                fns = [lambda z=z: truncation_thresholds(z, *args, **layout) for z in logits]
                us = bench_graph(fns, calls=4, replays=7) * 1e3 if cuda else cpu_time_ms(fns[0]) * 1e3
                mean_passes = float(passes.float().mean())
                rows.append(
                    {
                        "batch": batch,
                        "filters": name,
                        **layout,
                        "us": us,
                        "passes_mean": mean_passes,
                        "us_per_pass": us / mean_passes,
                        "same_bits": bool(torch.equal(thr, thr_other)),
                    }
                )
                print(f"  {batch} {name} {layout}: {us:.1f} µs, {mean_passes:.2f} passes", flush=True)
    print_table(
        f"threshold search layouts, V = {ns.vocab}, {str(dtype).removeprefix('torch.')} logits, T = {TEMPERATURE}"
        + ("" if cuda else " (CPU smoke)"),
        rows,
        [
            ("batch", "batch", "d"),
            ("filters", "filters", "s"),
            ("candidates", "NC", "d"),
            ("block_e", "BLOCK_E", "d"),
            ("skip", "skip", "d"),
            ("unroll", "unroll", "d"),
            ("us", "search µs", ".1f"),
            ("passes_mean", "passes", ".2f"),
            ("us_per_pass", "µs/pass", ".1f"),
            ("same_bits", "same thr", "d"),
        ],
    )
    best = {}
    for r in rows:
        key = (r["batch"], r["filters"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    for (batch, name), r in best.items():
        layout = f"NC={r['candidates']} BLOCK_E={r['block_e']} skip={r['skip']} unroll={r['unroll']}"
        print(f"best at batch {batch}, {name}: {layout}: {r['us']:.1f} µs")
    totals = {}
    for r in rows:
        key = (r["candidates"], r["block_e"], r["skip"], r["unroll"])
        totals[key] = totals.get(key, 0.0) + r["us"]
    ranked = sorted(totals.items(), key=lambda kv: kv[1])
    for (nc, be, skip, unroll), total in ranked[:3]:
        print(f"overall (sum over cases): NC={nc} BLOCK_E={be} skip={skip} unroll={unroll}: {total:.1f} µs")
    print(f"skip and unroll gave the same thresholds in every case: {all(r['same_bits'] for r in rows)}")
    json_path, _ = output_paths(ns.out, "top_p_sweep")
    info = device_info(dev) if cuda else {"gpu": None, "torch": torch.__version__}
    write_json(json_path, {"device": info, "vocab": ns.vocab, "temperature": TEMPERATURE, "results": rows})


def adversarial_logits(shape: str, rows: int, vocab: int, gen):
    """[rows, vocab] float32 logits of an adversarial shape (module docstring, --reads) and its bitmask allowing
    one token in 8 for "masked" (else None), on the CPU."""
    import torch

    from tinyvllm.sampling.bitmask import pack_bitmask

    bitmask = None
    if shape == "ties":
        z = torch.randint(-8, 9, (rows, vocab), generator=gen).float() * 0.25
    elif shape == "heavy":
        t = torch.distributions.StudentT(3.0)
        z = t.sample((rows, vocab)) * 2  # the global RNG, seeded by the caller
    elif shape == "huge":
        z = torch.randn(rows, vocab, generator=gen) * 2
        z[:, 7] = 60.0
    elif shape == "equal":
        z = torch.zeros(rows, vocab)
    elif shape == "masked":
        z = torch.randn(rows, vocab, generator=gen) * 2
        allowed = torch.rand(rows, vocab, generator=gen) < 0.125
        bitmask = torch.from_numpy(pack_bitmask(allowed.numpy()))
    else:  # "tiny": a short row
        z = torch.randn(rows, vocab, generator=gen) * 2
    return z, bitmask


def reads(ns: argparse.Namespace) -> None:
    """The search's reads per row for each (logits, filters), with and without the precheck (module
    docstring, --reads)."""
    import torch
    from common import device_info, output_paths, print_table, write_json

    from tinyvllm.kernels.top_p_sampling import truncation_plan, truncation_thresholds
    from tinyvllm.kernels.top_p_sampling.plan import _NC

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    n = ns.rows or (64 if cuda else 4)
    nc = ns.candidates or _NC
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    groups = []  # (dtype, [(shape, rows)], bitmask)
    for dtype in (torch.bfloat16, torch.float32):
        shapes = SHAPES if dtype == torch.bfloat16 else ("randn",)
        groups.append((dtype, [(s, make_logits(s, n, ns.vocab, "cpu", gen, torch.float32)) for s in shapes], None))
    adv = max(1, n // 2)
    shapes = [(s, adversarial_logits(s, adv, ns.vocab, gen)[0]) for s in ("ties", "heavy", "huge", "equal")]
    groups.append((torch.bfloat16, shapes, None))
    z, bitmask = adversarial_logits("masked", adv, ns.vocab, gen)
    groups.append((torch.bfloat16, [("masked", z)], bitmask))
    groups.append((torch.bfloat16, [("tiny", adversarial_logits("tiny", adv, 37, gen)[0])], None))
    rows = []
    for dtype, shapes, bitmask in groups:
        z = torch.cat([r for _, r in shapes]).to(dtype).to(dev)
        mask = None if bitmask is None else bitmask.to(dev)
        B = z.shape[0]
        for name, filters in CONFIGS.items():
            args = (
                torch.full((B,), filters.get("top_k", 0), dtype=torch.int32, device=dev),
                torch.full((B,), filters.get("top_p", 1.0), device=dev),
                torch.full((B,), filters.get("min_p", 0.0), device=dev),
            )
            t = torch.full((B,), TEMPERATURE, device=dev)
            seeds = torch.arange(B, device=dev) + 1
            t0 = time.perf_counter()
            _, passes = truncation_thresholds(z, t, *args, mask, candidates=nc)
            _, passes_pre, decided = truncation_plan(z, t, seeds, *args, mask, candidates=nc, radix=False)
            passes, passes_pre, decided = passes.cpu().float(), passes_pre.cpu().float(), decided.cpu()
            _, passes_radix, decided_radix = truncation_plan(z, t, seeds, *args, mask, candidates=nc, radix=True)
            passes_radix, decided_radix = passes_radix.cpu().float(), decided_radix.cpu()
            at = 0
            for shape, r in shapes:
                sl = slice(at, at + r.shape[0])
                at += r.shape[0]
                rows.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "shape": shape,
                        "vocab": z.shape[1],
                        "filters": name,
                        "rows": r.shape[0],
                        "passes_mean": float(passes[sl].mean()),
                        "passes_max": int(passes[sl].max()),
                        "passes_pre_mean": float(passes_pre[sl].mean()),
                        "passes_pre_max": int(passes_pre[sl].max()),
                        "accepted": float((decided[sl] >= 0).float().mean()),
                        "passes_radix_mean": float(passes_radix[sl].mean()),
                        "passes_radix_max": int(passes_radix[sl].max()),
                        "decided_radix": float((decided_radix[sl] >= 0).float().mean()),
                    }
                )
                print(f"  {rows[-1]}", flush=True)
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(
        f"search reads per row (statistics included), T = {TEMPERATURE}, NC = {nc}" + ("" if cuda else " (CPU)"),
        rows,
        [
            ("dtype", "logits", "s"),
            ("shape", "shape", "s"),
            ("vocab", "V", "d"),
            ("filters", "filters", "s"),
            ("rows", "rows", "d"),
            ("passes_mean", "reads", ".2f"),
            ("passes_max", "max", "d"),
            ("passes_pre_mean", "reads pre", ".2f"),
            ("passes_pre_max", "max pre", "d"),
            ("accepted", "accepted", ".2f"),
            ("passes_radix_mean", "reads radix", ".2f"),
            ("passes_radix_max", "max radix", "d"),
            ("decided_radix", "decided radix", ".2f"),
        ],
    )
    json_path, _ = output_paths(ns.out, "top_p_reads")
    info = device_info(dev) if cuda else {"gpu": None, "torch": torch.__version__}
    write_json(json_path, {"device": info, "candidates": nc, "temperature": TEMPERATURE, "results": rows})


def measure(ns, cuda, dev, copy, sampler, dtype, batch, shape, name, filters) -> dict:
    """One row of the table: (logits dtype, batch, logits shape, filters), timed and counted."""
    import torch
    from common import bench, bench_graph

    from tinyvllm.kernels.top_p_sampling import sample_top_k_top_p, truncation_plan, truncation_thresholds
    from tinyvllm.sampling.tensors import SamplingRow, SamplingTensors
    from tinyvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=TEMPERATURE, **filters)
    n_sets = 4 if cuda else 1  # rotated input sets: together more than the L2 cache
    gen = torch.Generator(device=dev).manual_seed(batch)
    sets = []
    for k in range(n_sets):
        sets.append(
            (
                make_logits(shape, batch, ns.vocab, dev, gen, dtype),
                torch.full((batch,), TEMPERATURE, device=dev),
                torch.arange(batch, device=dev) + 17 * k,
                torch.full((batch,), params.top_k, dtype=torch.int32, device=dev),
                torch.full((batch,), params.top_p, device=dev),
                torch.full((batch,), params.min_p, device=dev),
            )
        )
    tensors = SamplingTensors.from_rows([SamplingRow(params, [], [])] * batch, ns.vocab, dev)
    _, passes = truncation_thresholds(sets[0][0], *sets[0][1:2], *sets[0][3:])
    passes = passes.float()
    _, passes_pre, decided = truncation_plan(*sets[0], radix=False)
    passes_pre = passes_pre.float()
    undecided = (decided < 0).float()
    _, passes_radix, decided_radix = truncation_plan(*sets[0], radix=True)
    reads_radix = float((passes_radix.float() + (decided_radix < 0).float()).mean())
    _, passes_row = truncation_thresholds(sets[0][0], *sets[0][1:2], *sets[0][3:], **PER_ROW)
    # the ids of the three routes (equal but for rows within float rounding of a boundary)
    ids = [
        sample_top_k_top_p(*sets[0], radix=True),
        sample_top_k_top_p(*sets[0], radix=False),
        sample_top_k_top_p(*sets[0], radix=False, precheck=False),
    ]
    same_ids = all(bool(torch.equal(ids[0], other)) for other in ids[1:])

    def fused(s):
        return sample_top_k_top_p(*s, radix=True)

    def fused_search(s):
        return sample_top_k_top_p(*s, radix=False)

    def fused_nopre(s):
        return sample_top_k_top_p(*s, radix=False, precheck=False)

    def search(s):
        return truncation_thresholds(s[0], s[1], *s[3:])

    def search_pre(s):
        return truncation_plan(*s, radix=False)

    def search_row(s):
        return truncation_thresholds(s[0], s[1], *s[3:], **PER_ROW)

    def full(s):
        return sampler(s[0], tensors, gen).sampled_token_ids

    def amax(s):
        return torch.amax(s[0], dim=-1)

    timed = (fused, fused_search, fused_nopre, search, search_pre, search_row, amax)
    if cuda:
        fused_us, fused_search_us, fused_nopre_us, search_us, search_pre_us, search_row_us, amax_us = (
            bench_graph([lambda s=s, f=f: f(s) for s in sets]) * 1e3 for f in timed
        )
        full_us = bench(lambda: full(sets[0]))["ms"] * 1e3
        floor_us = batch * ns.vocab * sets[0][0].element_size() / (copy / 2) * 1e6
    else:
        fused_us, fused_search_us, fused_nopre_us, search_us, search_pre_us, search_row_us, amax_us, full_us = (
            cpu_time_ms(lambda f=f: f(sets[0])) * 1e3 for f in (*timed, full)
        )
        floor_us = None
    print(
        f"  {dtype} {batch} {shape} {name}: fused {fused_us:.1f} µs (radix off {fused_search_us:.1f}, "
        f"and no precheck {fused_nopre_us:.1f}; same ids {same_ids}), search {search_us:.1f} µs "
        f"(precheck {search_pre_us:.1f}), accepted {1 - float(undecided.mean()):.2f}",
        flush=True,
    )
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "shape": shape,
        "filters": name,
        "passes_mean": float(passes.mean()),
        "passes_max": int(passes.max()),
        "passes_pre_mean": float(passes_pre.mean()),
        "passes_pre_max": int(passes_pre.max()),
        "accepted": 1.0 - float(undecided.mean()),
        "reads_mean": float(passes.mean()) + 1.0,
        "reads_pre_mean": float((passes_pre + undecided).mean()),
        "reads_radix_mean": reads_radix,
        "same_ids": same_ids,
        "fused_us": fused_us,
        "fused_search_us": fused_search_us,
        "search/radix": fused_search_us / fused_us,
        "fused_nopre_us": fused_nopre_us,
        "nopre/pre": fused_nopre_us / fused_search_us,
        "search_us": search_us,
        "search_pre_us": search_pre_us,
        "passes_row_mean": float(passes_row.float().mean()),
        "search_row_us": search_row_us,
        "row/split": search_row_us / search_us,
        "full_us": full_us,
        "amax_us": amax_us,
        "floor_us": floor_us,
        "full/fused": full_us / fused_us,
        "fused/amax": fused_us / amax_us,
    }


def main() -> None:
    ns = parse()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if ns.sweep:
        sweep(ns)
        return
    if ns.reads:
        reads(ns)
        return

    import torch
    from common import copy_bandwidth, device_info, output_paths, print_table, write_json

    from tinyvllm.sampling.sampler import Sampler

    cuda = torch.cuda.is_available() and not ns.cpu_smoke
    dev = torch.device("cuda" if cuda else "cpu")
    copy = copy_bandwidth(dev) if cuda else None
    sampler = Sampler()
    rows = []
    for dtype in [getattr(torch, d) for d in ns.dtypes] if cuda else (torch.float32,):
        for batch in ns.batches:
            for shape in ns.shapes:
                for name, filters in CONFIGS.items():
                    rows.append(measure(ns, cuda, dev, copy, sampler, dtype, batch, shape, name, filters))
    print_table(
        f"top-k / top-p / min-p sampling, V = {ns.vocab}, T = {TEMPERATURE}" + (" (CPU smoke)" if not cuda else ""),
        rows,
        [
            ("dtype", "logits", "s"),
            ("batch", "batch", "d"),
            ("shape", "shape", "s"),
            ("filters", "filters", "s"),
            ("passes_mean", "passes", ".1f"),
            ("passes_max", "max", "d"),
            ("passes_pre_mean", "passes pre", ".1f"),
            ("accepted", "accepted", ".2f"),
            ("reads_mean", "reads", ".1f"),
            ("reads_pre_mean", "reads pre", ".1f"),
            ("reads_radix_mean", "reads radix", ".1f"),
            ("same_ids", "same ids", "d"),
            ("fused_us", "fused µs", ".1f"),
            ("fused_search_us", "fused radix off µs", ".1f"),
            ("search/radix", "radix off/on", ".2f"),
            ("fused_nopre_us", "fused no pre µs", ".1f"),
            ("nopre/pre", "no pre/pre", ".2f"),
            ("search_us", "search µs", ".1f"),
            ("search_pre_us", "search pre µs", ".1f"),
            ("passes_row_mean", "passes per-row", ".1f"),
            ("search_row_us", "search per-row µs", ".1f"),
            ("row/split", "per-row/split", ".2f"),
            ("full_us", "full µs", ".1f"),
            ("amax_us", "amax µs", ".1f"),
            ("floor_us", "floor µs", ".1f"),
            ("full/fused", "full/fused", ".2f"),
            ("fused/amax", "fused/amax", ".2f"),
        ],
    )
    json_path, _ = output_paths(ns.out, "top_p_sampling")
    info = device_info(dev) if cuda else {"gpu": None, "torch": torch.__version__}
    write_json(
        json_path, {"device": info, "copy_bw": copy, "vocab": ns.vocab, "temperature": TEMPERATURE, "results": rows}
    )


if __name__ == "__main__":
    main()
