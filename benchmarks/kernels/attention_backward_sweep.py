"""The tile sweep of the attention backward (`bench_attention_backward.py --sweep`): for each head dim and
length, every candidate of each kernel timed alone, and the winners printed as the tables of
`flash_attention_op` (HOPPER_BACKWARD, the deterministic default; HOPPER_BACKWARD_ATOMIC; and the training
forward's HOPPER_FORWARD), ready to paste.

The backward's pieces are swept independently, so the candidates add up instead of multiplying:
  * "dkdv": the dK/dV kernel alone (dkdv_m query rows streamed past dkdv_n keys held in registers);
  * "dq": the separate dQ pass alone (dq_m query rows held, dq_n keys streamed);
  * "atomic", "ordered": the whole fused backward (preprocess, dK/dV with dQ adds, dQ conversion);
  * "fwd": the training forward (`flash_forward`), whose winner over all lengths fills HOPPER_FORWARD.
Each kind's candidates are a grid of tiles, warps and stages with pointer loads, then a few configs
with the Hopper options (`BackwardConfig`'s dkdv_tma, dq_tma: tensor-descriptor loads; dkdv_ws, dq_ws:
warp-specialised loops), HOPPER_* below. The "separate" mode's time is preprocess + best dkdv + best
dq (each with its own options). Per length range (up to
SHORT_SEQLEN, and beyond it) the winner is the candidate with the least geometric-mean time over the
range's lengths; the deterministic table takes "separate" or "ordered", whichever is faster.

Every candidate is compiled first by a pool of worker processes (one CUDA context each) on a small
problem with the same strides, so the timing process finds each kernel in Triton's on-disk cache
instead of compiling about 230 kernel variants one after another; a candidate that fails to compile
(or crashes its worker) is left out of the timing. Each candidate's outputs are checked against the
float32 reference slice before it is timed; a wrong or failing candidate is left out.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable

import torch

from tinyvllm.kernels.flash_attention_op import (
    HOPPER_BACKWARD,
    HOPPER_BACKWARD_ATOMIC,
    HOPPER_FORWARD,
    SHORT_SEQLEN,
    BackwardConfig,
    ForwardConfig,
    flash_attention_fwd,
)
from tinyvllm.kernels.flash_backward import BackwardLaunch
from tinyvllm.kernels.flash_forward import flash_forward

WARPS = (4, 8)
STAGES = (2, 3, 4)
DKDV_TILES = ((32, 64), (32, 128), (64, 64), (64, 128))  # (query rows streamed, keys held)
DQ_TILES = ((64, 32), (128, 32), (64, 64), (128, 64))  # (query rows held, keys streamed)
FUSED_TILES = ((32, 64), (32, 128), (64, 64), (64, 128))
FUSED_STAGES = (2, 3)
# The Hopper options (`BackwardConfig`'s *_tma, *_ws), swept on a few tiles each instead of the whole
# grid: (rows, keys, warps, stages, descriptor loads, warp-specialised loop). Warp specialisation needs
# the descriptor loads; Triton 3.9 specialises these kernels with 4 warps only, and the dK/dV kernel
# only with 64 keys (tests/kernels/test_flash_backward_codegen.py): 8 warps and the fused mode are
# tried once each, in case the GPU's Triton does better.
HOPPER_DKDV = (
    (32, 128, 4, 3, True, False), (64, 64, 4, 2, True, False), (64, 64, 4, 3, True, False),
    (64, 128, 8, 2, True, False), (64, 128, 8, 3, True, False),
    (32, 64, 4, 3, True, True), (64, 64, 4, 2, True, True), (64, 64, 4, 3, True, True),
    (128, 64, 4, 2, True, True), (128, 64, 4, 3, True, True), (64, 128, 8, 3, True, True),
)  # fmt: skip
HOPPER_DKDV_WIDE = ((128, 128, 8, 2, True, False), (128, 128, 8, 3, True, False))
HOPPER_DQ = (
    (64, 64, 4, 2, True, False), (64, 64, 4, 3, True, False), (128, 64, 4, 3, True, False),
    (128, 64, 8, 2, True, False), (128, 64, 8, 3, True, False), (128, 128, 8, 2, True, False),
    (64, 64, 4, 3, True, True), (64, 128, 4, 3, True, True), (128, 64, 4, 2, True, True),
    (128, 64, 4, 3, True, True), (128, 128, 4, 2, True, True), (128, 64, 8, 3, True, True),
)  # fmt: skip
HOPPER_FUSED = ((64, 128, 8, 2, True, False), (64, 128, 8, 3, True, False), (64, 64, 4, 2, True, False),
                (32, 128, 4, 3, True, False), (64, 64, 4, 2, True, True))  # fmt: skip
# The training forward (`flash_forward`, HOPPER_FORWARD): besides the table's entry, (block_m, block_n,
# warps, stages), the prefill sweep's best tiles among them (docs/perf.md section 3).
FWD_TILES = ((128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 5), (128, 128, 8, 2), (128, 128, 8, 5), (64, 64, 4, 3))
KINDS = ("dkdv", "dq", "atomic", "ordered")
HOPPER_FIELDS = ("dkdv_tma", "dkdv_ws", "dq_tma", "dq_ws")  # BackwardConfig's options
PLACEHOLDER = BackwardConfig(32, 128, 4, 2, 128, 32, 4, 2)  # the other kernel's tiles while one is swept


def hopper_candidates(d: int) -> dict[str, list[BackwardConfig]]:
    """Per kind, the Hopper options' configs at head dim d (HOPPER_*; the 128 × 128 dK/dV tiles only up
    to d 64, where their float32 dK and dV fit the registers of 8 warps); "ordered" takes no warp
    specialisation (`BackwardLaunch` refuses it)."""
    wide = HOPPER_DKDV_WIDE if d <= 64 else ()
    dkdv = [PLACEHOLDER._replace(dkdv_m=m, dkdv_n=n, dkdv_warps=w, dkdv_stages=s, dkdv_tma=t, dkdv_ws=ws)
            for m, n, w, s, t, ws in (*HOPPER_DKDV, *wide)]  # fmt: skip
    dq = [PLACEHOLDER._replace(dq_m=m, dq_n=n, dq_warps=w, dq_stages=s, dq_tma=t, dq_ws=ws)
          for m, n, w, s, t, ws in HOPPER_DQ]  # fmt: skip
    fused = [BackwardConfig(m, n, w, s, 0, 0, 0, 0, dkdv_tma=t, dkdv_ws=ws) for m, n, w, s, t, ws in HOPPER_FUSED]
    return {
        "dkdv": sorted(dkdv),
        "dq": sorted(dq),
        "atomic": [c._replace(dq_mode="atomic") for c in sorted(fused)],
        "ordered": [c._replace(dq_mode="ordered") for c in sorted(fused) if not c.dkdv_ws],
    }


def _tile_candidates(d: int) -> dict[str, list[BackwardConfig]]:
    """Per kind, the tile grid (WARPS × STAGES × *_TILES) and the tables' entries, pointer loads."""
    table = [c for c in HOPPER_BACKWARD[d]]
    dkdv = {PLACEHOLDER._replace(dkdv_m=m, dkdv_n=n, dkdv_warps=w, dkdv_stages=s)
            for m, n in DKDV_TILES for w in WARPS for s in STAGES}  # fmt: skip
    dkdv |= {PLACEHOLDER._replace(dkdv_m=c.dkdv_m, dkdv_n=c.dkdv_n, dkdv_warps=c.dkdv_warps, dkdv_stages=c.dkdv_stages,
                                  dkdv_tma=c.dkdv_tma, dkdv_ws=c.dkdv_ws)
             for c in table if c.dq_mode == "separate"}  # fmt: skip
    dq = {PLACEHOLDER._replace(dq_m=m, dq_n=n, dq_warps=w, dq_stages=s)
          for m, n in DQ_TILES for w in WARPS for s in STAGES}  # fmt: skip
    dq |= {PLACEHOLDER._replace(dq_m=c.dq_m, dq_n=c.dq_n, dq_warps=c.dq_warps, dq_stages=c.dq_stages,
                                dq_tma=c.dq_tma, dq_ws=c.dq_ws) for c in table if c.dq_mode == "separate"}  # fmt: skip
    fused = {BackwardConfig(m, n, w, s, 0, 0, 0, 0) for m, n in FUSED_TILES for w in WARPS for s in FUSED_STAGES}
    fused |= {
        BackwardConfig(*c[:4], 0, 0, 0, 0, dkdv_tma=c.dkdv_tma, dkdv_ws=c.dkdv_ws)
        for c in (*HOPPER_BACKWARD_ATOMIC[d], *table)
        if c.dq_mode != "separate"
    }
    return {
        "dkdv": sorted(dkdv),
        "dq": sorted(dq),
        "atomic": [c._replace(dq_mode="atomic") for c in sorted(fused)],
        "ordered": [c._replace(dq_mode="ordered") for c in sorted(fused)],
    }


def _options_first(cs: list, fields: tuple[str, ...] = HOPPER_FIELDS) -> list:
    """cs with the first config of each combination of the Hopper options (`fields`) ahead of the rest,
    so that a cut (the smoke run's) keeps every combination it can."""
    firsts = {tuple(getattr(c, f) for f in fields): c for c in reversed(cs)}
    return list(dict.fromkeys([*sorted(firsts.values()), *cs]))


def forward_candidates(d: int, limit: int | None = None) -> list[ForwardConfig]:
    """The training forward's configs at head dim d: HOPPER_FORWARD's entry, then FWD_TILES; limit: the
    entry and `limit` others (the smoke run)."""
    table, rest = HOPPER_FORWARD[d], [ForwardConfig(*t) for t in FWD_TILES]
    return list(dict.fromkeys([table, *rest[:limit]]))


def candidates(d: int, limit: int | None = None) -> dict[str, list[BackwardConfig]]:
    """Per kind, the configs to time at head dim d: the tile grid (the tables' current entries
    included), then `hopper_candidates`; limit: the first few of each, the CPU smoke run (of the
    Hopper ones, one per combination of the options first)."""
    hopper = hopper_candidates(d)
    return {kind: list(dict.fromkeys(cs[:limit] + _options_first(hopper[kind])[:limit]))
            for kind, cs in _tile_candidates(d).items()}  # fmt: skip


# ------------------------------------------------------------------------------------------ timed pieces
def launch_fn(launch: BackwardLaunch, kind: str) -> Callable[[], None]:
    """What is timed for one kind: the dK/dV kernel, the dQ pass, or the whole fused backward."""
    return {"dkdv": launch.dkdv, "dq": launch.dq_pass}.get(kind, launch.run)


def run_once(launch: BackwardLaunch, kind: str) -> list[torch.Tensor]:
    """Run a kind once from a fresh preprocess; the outputs it produced (dq, dk, dv or a subset)."""
    launch.preprocess()
    if kind == "dkdv":
        launch.dkdv()
        return [launch.dk, launch.dv]
    if kind == "dq":
        launch.dq_pass()
        return [launch.dq]
    launch.dkdv()
    launch.convert()
    return [launch.dq, launch.dk, launch.dv]


# ------------------------------------------------------------------------------------------ compile pool
def _compile_job(job: tuple[int, int, str, tuple]) -> str | None:
    """Worker: run one candidate on a small problem with the real one's strides (hidden // d heads of
    head dim d, packed rows), which compiles it into Triton's cache; the error, or None."""
    d, hidden, kind, cfg_tuple = job
    cfg = (ForwardConfig if kind == "fwd" else BackwardConfig)(*cfg_tuple)
    try:
        T, H = 1024, hidden // d  # ⌈T / 16..64⌉ ≡ 0 mod 16, as at the swept lengths: the same specialisation
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(T, H, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        if kind == "fwd":
            flash_forward(q, k, v, cu, T, d**-0.5, True, *cfg)
        else:
            out, lse = flash_attention_fwd(q, k, v, True, cu, d**-0.5, max_seqlen=T, backend="triton")
            run_once(BackwardLaunch(do, q, k, v, out, lse, cu, T, d**-0.5, True, cfg), kind)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # a config that does not fit: reported, and left out of the timing
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


STALL_S = 90  # no compile finished for this long: the jobs still out lost their workers (or hang)


def pool_errors(fn: Callable, jobs: dict, workers: int, stall_s: float = STALL_S) -> dict:
    """Run fn(job) for every job (values of `jobs`) in a pool of spawned worker processes, fn returning
    an error message or None; {key: error} of the jobs that failed. A job whose worker dies (a compiler
    crash: an abort inside an MLIR pass) or hangs (a kernel that never finishes) is never answered; the
    pool replaces a dead worker, the jobs still unanswered after stall_s seconds in which none finished
    count as failed, and leaving the pool terminates the workers still running."""
    failed = {}
    with mp.get_context("spawn").Pool(workers) as pool:
        pending = {key: pool.apply_async(fn, (job,)) for key, job in jobs.items()}
        last = time.perf_counter()
        while pending:
            done = [key for key, r in pending.items() if r.ready()]
            for key in done:
                err = pending.pop(key).get()
                if err:
                    failed[key] = err
            if done:
                last = time.perf_counter()
            elif time.perf_counter() - last > stall_s:
                failed |= {key: "no answer: its worker died (a compiler crash?)" for key in pending}
                break
            time.sleep(0.05)
    return failed


def precompile(head_dims: list[int], hidden: int, workers: int) -> set[tuple[str, int, BackwardConfig]]:
    """Compile every candidate in a pool of worker processes (`pool_errors`); the (kind, d, config)
    that failed, to be left out of the timing."""
    kinds = {d: {**candidates(d), "fwd": forward_candidates(d)} for d in head_dims}
    jobs = {(kind, d, c): (d, hidden, kind, tuple(c)) for d in head_dims for kind, cs in kinds[d].items()
            for c in cs}  # fmt: skip
    t0 = time.perf_counter()
    failed = pool_errors(_compile_job, jobs, workers)
    print(f"  compiled {len(jobs)} candidates in {time.perf_counter() - t0:.0f} s with {workers} workers; "
          f"{len(failed)} failed, left out of the timing", flush=True)  # fmt: skip
    for (kind, d, c), err in failed.items():
        print(f"    {kind} d{d} {tuple(c)}: {err}", flush=True)
    return set(failed)


# ------------------------------------------------------------------------------------------ timing
def time_ms(fn: Callable[[], None]) -> float:
    """Median ms per call: do_bench (short warm-up and repetition: there are many candidates) on CUDA,
    one wall-clock call under the interpreter."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25, return_mode="median")


def sweep_shape(
    p, ref: list[torch.Tensor], flops: float, max_err: float, rel_err, limit: int | None = None, skip=frozenset()
) -> dict:
    """Time every candidate on one problem (the bench's `Problem`: packed qp, kp, vp, dop, cu; ref the
    float32 reference's out, dq, dk, dv of batch 0, heads 0..1 as [h, L, D]); per kind, [(config, ms)]
    of the correct candidates, fastest first, and the preprocess's ms. skip: (kind, d, config) that
    failed to compile, not tried again."""
    out, lse = flash_attention_fwd(p.qp, p.kp, p.vp, True, p.cu, p.scale, max_seqlen=p.length, backend="triton")
    args = (p.dop, p.qp, p.kp, p.vp, out, lse, p.cu, p.length, p.scale, True)
    want = {"dkdv": ref[2:], "dq": ref[1:2], "atomic": ref[1:], "ordered": ref[1:]}
    result: dict = {"L": p.length, "d": p.d}
    pre = BackwardLaunch(*args, PLACEHOLDER)
    result["pre_ms"] = time_ms(pre.preprocess)

    def backward(kind: str, c: BackwardConfig):
        launch = BackwardLaunch(*args, c)
        return lambda: run_once(launch, kind), launch_fn(launch, kind)

    def forward(c: ForwardConfig):
        fn = lambda: flash_forward(p.qp, p.kp, p.vp, p.cu, p.length, p.scale, True, *c)  # noqa: E731
        return lambda: [fn()[0]], fn

    kinds = {kind: (cs, lambda c, k=kind: backward(k, c)) for kind, cs in candidates(p.d, limit).items()}
    kinds["fwd"] = (forward_candidates(p.d, limit), forward)
    want["fwd"] = ref[:1]
    for kind, (cs, make) in kinds.items():
        timed = _time_checked(p, kind, [c for c in cs if (kind, p.d, c) not in skip], make, want[kind], max_err,
                              rel_err)  # fmt: skip
        result[kind] = timed
        if timed:
            c, ms = timed[0]
            print(
                f"  d={p.d} L={p.length} {kind:8s} best {_label(c, kind)} {ms:.3f} ms ({len(timed)} ok of {len(cs)})",
                flush=True,
            )
    if result.get("dkdv") and result.get("dq"):
        sep = result["pre_ms"] + result["dkdv"][0][1] + result["dq"][0][1]
        line = f"  d={p.d} L={p.length} TFLOP/s: separate {flops / sep / 1e9:.0f}"
        for kind in ("atomic", "ordered"):
            if result.get(kind):
                line += f", {kind} {flops / result[kind][0][1] / 1e9:.0f}"
        if result.get("fwd"):
            line += f"; forward {flops / FWD_SHARE / result['fwd'][0][1] / 1e9:.0f}"
        print(line, flush=True)
    return result


FWD_SHARE = 2.5  # the backward's FLOPs over the forward's (the bench's convention)


def _time_checked(p, kind: str, cs: list, make, want: list[torch.Tensor], max_err: float, rel_err) -> list:
    """[(config, ms)] of the candidates cs of one kind whose outputs match `want` (the reference slices
    [h, L, D]), fastest first. make(c) -> (run once returning the outputs packed, the function to time)."""
    timed = []
    for c in cs:
        try:
            once, fn = make(c)
            errs = [rel_err(p.bhld(g)[0, : w.shape[0]], w) for g, w in zip(once(), want)]
            if max(errs) > max_err:
                print(f"  {kind} {tuple(c)}: WRONG, relative errors {[f'{e:.1e}' for e in errs]}", flush=True)
                continue
            timed.append((c, time_ms(fn)))
        except Exception as e:
            print(f"  {kind} {tuple(c)}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
    return sorted(timed, key=lambda t: t[1])


# ------------------------------------------------------------------------------------------ winners
def _geomean_best(results: list[dict], kind: str) -> tuple[tuple, float] | None:
    """The config of `kind` with the least geometric-mean time over the results (the shapes it ran
    correctly at all of them); (config, geometric-mean ms)."""
    per: dict[tuple, list[float]] = {}
    for r in results:
        for c, ms in r.get(kind, []):
            per.setdefault(c, []).append(ms)
    full = {c: math.exp(sum(map(math.log, t)) / len(t)) for c, t in per.items() if len(t) == len(results)}
    return min(full.items(), key=lambda kv: kv[1]) if full else None


def winners(results: list[dict]) -> dict:
    """For one head dim and length range: the best separate config (best dkdv + best dq tiles), the
    best atomic and ordered configs, and the deterministic choice; each with its geometric-mean ms."""
    out = {}
    dkdv, dq = _geomean_best(results, "dkdv"), _geomean_best(results, "dq")
    if dkdv and dq:
        pre = math.exp(sum(math.log(r["pre_ms"]) for r in results) / len(results))
        q = dq[0]
        c = dkdv[0]._replace(dq_m=q.dq_m, dq_n=q.dq_n, dq_warps=q.dq_warps, dq_stages=q.dq_stages, dq_tma=q.dq_tma,
                             dq_ws=q.dq_ws)  # fmt: skip
        out["separate"] = (c, pre + dkdv[1] + dq[1])
    for kind in ("atomic", "ordered"):
        best = _geomean_best(results, kind)
        if best:
            out[kind] = best
    det = [out[k] for k in ("separate", "ordered") if k in out]
    if det:
        out["deterministic"] = min(det, key=lambda t: t[1])
    return out


def _cfg_literal(c: BackwardConfig) -> str:
    """The config as Python to paste into the tables: positional tiles, then the dQ mode and the Hopper
    options that are on, by keyword."""
    args = [str(x) for x in c[:9]]
    if c.dq_mode != "separate":
        args.append(f'"{c.dq_mode}"')
    args += [f"{f}=True" for f in HOPPER_FIELDS if getattr(c, f)]
    return f"BackwardConfig({', '.join(args)})"


def _label(c, kind: str) -> str:
    """The swept kernel's part of a config, for the progress lines: its tiles, warps, stages and options."""
    if kind == "fwd":
        tiles, flags = tuple(c)[:4], []
    else:
        part = "dq" if kind == "dq" else "dkdv"
        tiles = tuple(c)[4:8] if kind == "dq" else tuple(c)[:4]
        flags = [f for f in ("tma", "ws") if getattr(c, f"{part}_{f}")]
    return f"{tiles}{'+' + '+'.join(flags) if flags else ''}"


def _fwd_literal(c: ForwardConfig) -> str:
    """A forward config as Python to paste: tiles, warps, stages."""
    return f"ForwardConfig({', '.join(map(str, c))})"


def print_tables(all_results: list[dict], head_dims: list[int]) -> dict:
    """Per head dim and length range the winners; then both tables as Python to paste into
    flash_attention_op (head dims not swept keep their entries). Returns the winners for the JSON."""
    chosen: dict = {}
    for d in head_dims:
        for rng, pick in (("short", lambda L: L <= SHORT_SEQLEN), ("long", lambda L: L > SHORT_SEQLEN)):
            rs = [r for r in all_results if r["d"] == d and pick(r["L"])]
            if rs:
                w = winners(rs)
                chosen[(d, rng)] = w
                lens = ",".join(str(r["L"]) for r in rs)
                for kind, (c, ms) in w.items():
                    print(f"  best d={d} {rng} (L {lens}) {kind:13s} {_cfg_literal(c)}  geomean {ms:.3f} ms")
    for name, table, kind in (("HOPPER_BACKWARD", HOPPER_BACKWARD, "deterministic"),
                              ("HOPPER_BACKWARD_ATOMIC", HOPPER_BACKWARD_ATOMIC, "atomic")):  # fmt: skip
        print(f"{name}: dict[int, tuple[BackwardConfig, BackwardConfig]] = {{")
        for d, (short, long) in table.items():
            short = chosen.get((d, "short"), {}).get(kind, (short,))[0]
            long = chosen.get((d, "long"), {}).get(kind, (long,))[0]
            print(f"    {d}: (\n        {_cfg_literal(short)},\n        {_cfg_literal(long)},\n    ),")
        print("}")
    fwd = {d: _geomean_best([r for r in all_results if r["d"] == d], "fwd") for d in head_dims}
    print("HOPPER_FORWARD: dict[int, ForwardConfig] = {  # the geometric mean over every swept length")
    for d, entry in HOPPER_FORWARD.items():
        best = fwd.get(d)
        note = f"  # {best[1]:.3f} ms" if best else ""
        print(f"    {d}: {_fwd_literal(best[0] if best else entry)},{note}")
    print("}")
    out = {f"d{d} {rng}": {k: [list(c), ms] for k, (c, ms) in w.items()} for (d, rng), w in chosen.items()}
    out |= {f"d{d} forward": [list(b[0]), b[1]] for d, b in fwd.items() if b}
    return out


def run(make_problem, head_dims: list[int], lengths: list[int], hidden: int, flops_of, max_err: float, rel_err,
        reference_of, limit: int | None = None) -> dict:  # fmt: skip
    """The whole sweep: compile in parallel (CUDA), time each (d, L), print the winners and tables.
    make_problem(L, d) -> the bench's Problem; flops_of, reference_of: its backward FLOPs and float32
    reference slice; rel_err(got, want); limit: candidates per kind (None: all)."""
    skip: set = set()
    if torch.cuda.is_available():
        skip = precompile(head_dims, hidden, max(1, min(12, (os.cpu_count() or 2) - 2)))
    results = []
    for d in head_dims:
        for length in lengths:
            t0 = time.perf_counter()
            p = make_problem(length, d)
            results.append(sweep_shape(p, reference_of(p), flops_of(p), max_err, rel_err, limit, skip))
            print(f"  (d={d} L={length}: {time.perf_counter() - t0:.0f} s)", flush=True)
            del p
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    best = print_tables(results, head_dims)
    plain = [{k: ([[list(c), ms] for c, ms in v] if isinstance(v, list) else v) for k, v in r.items()} for r in results]
    return {"shapes": plain, "winners": best}
