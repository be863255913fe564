"""Decode steps of 2–16 rows: the rows megakernel against the layer loop the engine runs them through today.

    python benchmarks/kernels/bench_rows_megakernel.py [--preset llama-3.2-1b] [--batches 1 2 4 8 16]
        [--context 640] [--variant chunk=128,stages=6 ...] [--fp8] [--fp8-kv] [--trace] [--out DIR]

A random-weight model of the preset's shape (bf16) on the GPU; each of `--batches` rows a sequence whose
context is `--context` keys (distinct cache blocks). Timed as CUDA-graph replays of a whole step
(decoder layers + final norm + LM head, no sampling) and of the layers alone:
  * `layers`: the layer loop (cuBLAS products, ~10 kernels a layer), the engine's path at 2–16 rows;
  * `rows <fields>`: the rows megakernel per RowsConfig (the default, then `--variant`s or VARIANTS);
  * at one row, `megakernel`: the batch-1 megakernel (the engine's path there), which the rows kernel's
    tensor-core products might beat with FP8 weights (its phase D reduces on the CUDA cores).
Floor: the bytes a step must read (every weight once, each row's K/V, the LM head) at the copy bandwidth
measured at the start; the products' FLOPs at these batches take under a tenth of that time.
Correctness, per batch: each variant's hidden states and logits against the layer loop's (relative error,
argmax), its new K/V, the rest of the cache untouched, and a second launch bitwise equal to the first.
`--trace`: per batch and megakernel path, TRACE_REPS traced launches (the global timer at every grid
barrier, decode_megakernel/grid_sync.py's layout; elementwise medians) give each phase's time per layer
(program 0's barrier exits, as bench_megakernel.phase_trace; means over the middle layers), against the
bytes the phase must read (A, C, D, E: that product's weights and FP8 row scales; B: every row's K/V at
the context) at the copy bandwidth; and the programs' arrivals at the barrier ending the phase: the last
one's after the phase opened, and the spread (last − first: load imbalance). Their sum over the layers
against the exit, and the graph-timed layers and step.
Writes rows_megakernel[_<preset>][_fp8][_fp8kv]_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_megakernel import BLOCK, phase_trace, setup
from common import (
    bench_graph,
    copy_bandwidth,
    device_info,
    output_paths,
    print_table,
    rel_err,
    require_cuda,
    write_json,
)

from tinyvllm.config import RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.engine.paths.megakernel import DecodeMegakernel, stack_weights
from tinyvllm.engine.paths.rows_megakernel import RowsMegakernel
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.decode_megakernel import TRACE_BASE, TRACE_BLOCK
from tinyvllm.kernels.rows_megakernel import RowsConfig

R = RowsConfig
VARIANTS = [
    R(),
    R(kv_align=1),  # phase B's K/V tiles as 16-byte cp.async copies, one tile ahead (waited at once)
    R(kv_align=1, kv_stages=5),  # ... two tiles ahead
    R(kv_align=1, kv_stages=7),  # ... three tiles ahead
    R(attn_splits=4),  # more, shorter phase B units (8 rows: 4 splits of 2-3 tiles)
    R(attn_splits=8),  # (8 rows: 5 splits of 2 tiles, 2-3 units a program)
    R(kv_align=1, kv_stages=5, attn_splits=4),
    R(chunk=128),
]


def name_of(cfg: RowsConfig) -> str:
    """A variant's label: every field that differs from its default."""
    diff = ",".join(f"{k}={v}" for k, v in cfg._asdict().items() if v != R._field_defaults[k])
    return "rows " + (diff or "default")


def parse_config(text: str) -> RowsConfig:
    """`field=value,...` → RowsConfig."""
    return R(**{k: int(v) for k, v in (item.split("=") for item in filter(None, text.split(",")))})


def step_inputs(dev: torch.device, rows: int, ctx: int, num_blocks: int):
    """(ids, positions, meta) of a decode step of `rows` sequences of `ctx` keys each, on distinct blocks."""
    pages = -(-ctx // BLOCK)
    order = torch.randperm(num_blocks, device=dev).to(torch.int32)
    table = order[: rows * pages].view(rows, pages)
    pos = ctx - 1
    slots = table[:, pos // BLOCK].long() * BLOCK + pos % BLOCK
    i32 = torch.int32
    meta = AttnMetadata(
        slot_mapping=slots,
        num_decode_tokens=rows,
        decode_seq_lens=torch.full((rows,), ctx, dtype=i32, device=dev),
        decode_block_tables=table.contiguous(),
        max_decode_seq_len=ctx,
        num_prefills=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=i32, device=dev),
        prefill_seq_lens=torch.zeros(0, dtype=i32, device=dev),
        prefill_block_tables=table[:0],
        max_prefill_q_len=0,
        max_prefill_seq_len=0,
    )
    ids = torch.randint(0, 500, (rows,), device=dev)  # within every preset's vocabulary (tiny: 512)
    return ids, torch.full((rows,), pos, device=dev), meta


def run(paths: ModelExecutor, ids, pos, meta, kv, logits: bool = True):
    views = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    hidden = paths.hidden_states(ids, pos, meta, views)
    return (hidden, paths.lm_head.logits(hidden, dtype=None)) if logits else (hidden, None)


def executor(model, rows: RowsMegakernel | None, batch1: DecodeMegakernel | None = None) -> ModelExecutor:
    """The runner's paths with the rows megakernel `rows` (None: the layer loop), or at one row the batch-1
    megakernel `batch1`. The rows kernel serves one row only when called directly (the runner gives a
    batch-1 step to the batch-1 kernel), so at one row it stands in for the batch-1 kernel here."""
    paths = ModelExecutor(model, RunnerConfig(decode_megakernel=False, pruned_lm_head=False), "cuda")
    paths.rows_megakernel = rows
    paths.megakernel = batch1
    if rows is not None:  # its call is the batch-1 path's: (input_ids, positions, meta, kv_caches)
        paths.megakernel = rows
    return paths


@torch.no_grad()
def check(model, kv, weights, batches: list[int], ctx: int, variants: list[RowsConfig]) -> list[dict]:
    dtype = model.embed_tokens.weight.dtype
    out = []
    for b in batches:
        ids, pos, meta = step_inputs(kv.device, b, ctx, kv.shape[2])
        kv_ref = kv.clone()
        h_ref, l_ref = run(executor(model, None), ids, pos, meta, kv_ref)
        for cfg in variants:
            paths = executor(model, RowsMegakernel(model, weights, cfg))
            kv_mk = kv.clone()
            h, lg = run(paths, ids, pos, meta, kv_mk)
            h2, _ = run(paths, ids, pos, meta, kv_mk.clone())
            blk, off = meta.slot_mapping // BLOCK, meta.slot_mapping % BLOCK
            new = kv_mk[:, :, blk, :, off]
            kv_err = rel_err(new, kv_ref[:, :, blk, :, off])
            kv_mk[:, :, blk, :, off] = kv_ref[:, :, blk, :, off]
            out.append(
                {
                    "dtype": str(dtype).replace("torch.", ""),
                    "batch": b,
                    "variant": name_of(cfg),
                    "hidden_rel_err": rel_err(h, h_ref),
                    "logits_rel_err": rel_err(lg, l_ref),
                    "kv_rel_err": kv_err,
                    "argmax_equal": bool((lg.argmax(-1) == l_ref.argmax(-1)).all()),
                    "rest_of_cache_equal": bool(torch.equal(kv_mk.view(torch.uint8), kv_ref.view(torch.uint8))),
                    "relaunch_bitwise": bool(torch.equal(h, h2)),
                }
            )
            print(out[-1], flush=True)
    return out


@torch.no_grad()
def time_steps(model, weights, kv, batches: list[int], ctx: int, variants: list[RowsConfig], copy: float):
    cfg = model.config
    layer_bytes = sum(t.numel() * t.element_size() for t in (weights.qkv, weights.o, weights.gate_up, weights.down))
    head_bytes = model.lm_head_weight.numel() * model.lm_head_weight.element_size()
    rows_out = []
    for b in batches:
        ids, pos, meta = step_inputs(kv.device, b, ctx, kv.shape[2])
        kv_bytes = b * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * ctx * cfg.head_dim * kv.element_size()
        floor_layers = (layer_bytes + kv_bytes) / copy * 1e6
        floor_step = floor_layers + head_bytes / copy * 1e6
        paths = [("layers", executor(model, None))]
        if b == 1:
            paths.append(("megakernel", executor(model, None, DecodeMegakernel(model, weights=weights))))
        paths += [(name_of(c), executor(model, RowsMegakernel(model, weights, c))) for c in variants]
        for name, p in paths:
            step_us = bench_graph([lambda p=p: run(p, ids, pos, meta, kv)], calls=16, replays=9) * 1e3
            layers_us = bench_graph([lambda p=p: run(p, ids, pos, meta, kv, False)], calls=16, replays=9) * 1e3
            rows_out.append(
                {
                    "batch": b,
                    "path": name,
                    "step_us": step_us,
                    "layers_us": layers_us,
                    "tok_per_s": b * 1e6 / step_us,
                    "floor_step_us": floor_step,
                    "of_floor": floor_step / step_us,
                    "layers_of_floor": floor_layers / layers_us,
                }
            )
            print(rows_out[-1], flush=True)
    for r in rows_out:
        base = next(x for x in rows_out if x["batch"] == r["batch"] and x["path"] == "layers")
        r["speedup"] = base["step_us"] / r["step_us"]
    return rows_out


TRACE_REPS = 10  # traced launches per path; medians of their readings
PHASES = {"A": "A qkv", "B": "B attn", "C": "C out", "D": "D gate/up", "E": "E down"}


def phase_bytes(weights, kv, rows: int, ctx: int) -> dict[str, float]:
    """Bytes a layer's phase must read: A, C, D, E that product's weights (FP8: 1-byte) and FP8 row scales;
    B every row's K and V at `ctx` keys (the cache's element size)."""
    L, _, _, hk, _, d = kv.shape
    size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    w = weights
    out = {
        "A": size(w.qkv) + size(w.qkv_scale),
        "C": size(w.o) + size(w.o_scale),
        "D": size(w.gate_up) + size(w.gate_up_scale),
        "E": size(w.down) + size(w.down_scale),
    }
    out = {k: v / L for k, v in out.items()}
    out["B"] = rows * 2 * hk * ctx * d * kv.element_size()
    return {k: out[k] for k in "ABCDE"}


def traced(launch, trace_of, num_layers: int, programs: int, reps: int = TRACE_REPS):
    """`reps` traced launches (after one that compiles): the elementwise medians, in µs from program 0's
    start, of program 0's barrier exits [5L + 1] (grid_sync.py: [0] start, [5l + k + 1] after phase k of
    layer l, [5L] the exit), every program's waits [P, 5L] ([p, 0] its start) and arrivals [P, 5L + 1]
    ([p, b] at barrier b, [p, 5L] its exit); and the spread (last − first arrival) at each barrier [5L + 1]."""
    n = 5 * num_layers
    launch()
    torch.cuda.synchronize()
    g, waits, arrivals, spread = [], [], [], []
    for _ in range(reps):
        launch()
        t = trace_of().double().cpu()
        zero = t[0]
        blocks = t[TRACE_BASE : TRACE_BASE + programs * TRACE_BLOCK].view(programs, TRACE_BLOCK)
        g.append(t[: n + 1] - zero)
        waits.append(blocks[:, :n] - zero)
        arr = blocks[:, 400 : 401 + n]
        arrivals.append(arr - zero)
        spread.append(arr.max(0).values - arr.min(0).values)
    med = lambda xs: torch.stack(xs).median(0).values / 1e3  # noqa: E731
    return med(g), med(waits), med(arrivals), med(spread)


def trace_summary(launch, trace_of, num_layers: int, programs: int, nbytes: dict, copy: float) -> dict:
    """Per phase kind, means over the middle layers (all where L ≤ 2) of the traced launches' medians:
    program 0's time (from its exit of the barrier opening the phase to its exit of the one ending it), the
    last program's arrival at the ending barrier after the first left the opening one, the arrivals' spread;
    the phase's bytes and their rate against the copy bandwidth. Totals: the sum over every layer's phases
    (the exit; layer 0's A from the launch's start, the last E to the exit, also apart)."""
    L = num_layers
    g, waits, arrivals, spread = traced(launch, trace_of, L, programs)
    per_layer = (g[1:] - g[:-1]).view(L, 5)
    opened = waits.min(0).values  # [5L]: barrier b's first exit (b = 0: the first program's start)
    last = (arrivals.max(0).values[1:] - opened).view(L, 5)
    spread = spread[1:].view(L, 5)
    mid = slice(1, L - 1) if L > 2 else slice(None)
    phases = []
    for k, kind in enumerate("ABCDE"):
        us = float(per_layer[mid, k].mean())
        phases.append(
            {
                "phase": PHASES[kind],
                "us": us,
                "last_arrival_us": float(last[mid, k].mean()),
                "spread_us": float(spread[mid, k].mean()),
                "mb": nbytes[kind] / 1e6,
                "gbps": nbytes[kind] / us / 1e3,
                "of_copy": nbytes[kind] / (us * 1e-6) / copy,
            }
        )
    layer_bytes = sum(nbytes.values()) * L
    return {
        "layers": L,
        "reps": TRACE_REPS,
        "phases": phases,
        "phases_x_layers_us": L * sum(p["us"] for p in phases),
        "traced_us": float(g[-1]),
        "layer0_A_from_start_us": float(per_layer[0, 0]),
        "last_E_to_exit_us": float(per_layer[-1, -1]),
        "traced_of_copy": layer_bytes / (float(g[-1]) * 1e-6) / copy,
    }


@torch.no_grad()
def trace_steps(model, weights, kv, batches: list[int], ctx: int, variants: list[RowsConfig], copy, timings):
    """trace_summary per batch and megakernel path (at one row also the batch-1 megakernel, with
    bench_megakernel.phase_trace's split of its phase B), with the graph-timed step and layers."""
    views = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    L = kv.shape[0]
    out = []
    for b in batches:
        ids, pos, meta = step_inputs(kv.device, b, ctx, kv.shape[2])
        nbytes = phase_bytes(weights, kv, b, ctx)
        paths = [(name_of(c), RowsMegakernel(model, weights, c)) for c in variants]
        if b == 1:
            paths.insert(0, ("megakernel", DecodeMegakernel(model, weights=weights)))
        for name, mk in paths:
            launch = lambda mk=mk: mk(ids, pos, meta, views, trace=True)  # noqa: E731
            row = {"batch": b, "path": name}
            row |= trace_summary(launch, lambda mk=mk: mk.workspace.trace, L, mk.workspace.programs, nbytes, copy)
            timed = next((t for t in timings if t["batch"] == b and t["path"] == name), {})
            row["step_us"], row["layers_us"] = timed.get("step_us"), timed.get("layers_us")
            if name == "megakernel":
                row["batch1_phase_trace"] = phase_trace(model, mk, ids, pos, meta, kv)
            out.append(row)
            print({k: v for k, v in row.items() if k != "batch1_phase_trace"}, flush=True)
    return out


def print_traces(traces: list[dict], title: str) -> None:
    flat = [{"batch": t["batch"], "path": t["path"], **p} for t in traces for p in t["phases"]]
    print_table(f"{title}: per-layer phases (traced, means over middle layers)", flat, TRACE_COLUMNS)
    print_table(f"{title}: traced totals against the graph-timed layers and step", traces, TRACE_TOTAL_COLUMNS)


CHECK_COLUMNS = [
    ("dtype", "dtype", ""),
    ("batch", "rows", "d"),
    ("variant", "variant", ""),
    ("hidden_rel_err", "hidden err", ".2e"),
    ("logits_rel_err", "logits err", ".2e"),
    ("kv_rel_err", "new K/V err", ".2e"),
    ("argmax_equal", "argmax =", ""),
    ("rest_of_cache_equal", "rest of cache =", ""),
    ("relaunch_bitwise", "relaunch =", ""),
]
STEP_COLUMNS = [
    ("batch", "rows", "d"),
    ("path", "path", ""),
    ("step_us", "step µs", ".1f"),
    ("layers_us", "layers µs", ".1f"),
    ("tok_per_s", "tok/s", ".0f"),
    ("speedup", "× layers", ".2f"),
    ("floor_step_us", "floor µs", ".1f"),
    ("of_floor", "of floor", ".2f"),
    ("layers_of_floor", "layers of floor", ".2f"),
]

TRACE_COLUMNS = [
    ("batch", "rows", "d"),
    ("path", "path", ""),
    ("phase", "phase", ""),
    ("us", "µs (p0)", ".2f"),
    ("last_arrival_us", "last arrival µs", ".2f"),
    ("spread_us", "arrival spread µs", ".2f"),
    ("mb", "MB read", ".2f"),
    ("gbps", "GB/s", ".0f"),
    ("of_copy", "of copy", ".2f"),
]
TRACE_TOTAL_COLUMNS = [
    ("batch", "rows", "d"),
    ("path", "path", ""),
    ("phases_x_layers_us", "Σ phases × L µs", ".1f"),
    ("traced_us", "traced exit µs", ".1f"),
    ("layer0_A_from_start_us", "layer 0 A µs", ".2f"),
    ("last_E_to_exit_us", "last E µs", ".2f"),
    ("traced_of_copy", "traced of copy", ".2f"),
    ("layers_us", "layers µs (graph)", ".1f"),
    ("step_us", "step µs (graph)", ".1f"),
]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.2-1b", help="the model shape (tinyvllm.models.presets)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--variant", action="append", default=[], help="a RowsConfig as field=value,... (repeatable)")
    ap.add_argument("--fp32", action=argparse.BooleanOptionalAction, default=True, help="also check in float32")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (per-row scales) from the random bf16 ones")
    ap.add_argument("--fp8-kv", action="store_true", help="an FP8 (e4m3) KV cache")
    ap.add_argument("--trace", action="store_true", help="traced launches: each phase's time, bytes and imbalance")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    return ap.parse_args()


def main() -> None:
    ns = parse_args()
    variants = [R()] + ([parse_config(v) for v in ns.variant] if ns.variant else VARIANTS[1:])
    dev = require_cuda()
    info = device_info(dev)
    copy = copy_bandwidth(dev)
    print(f"{info}\ncopy bandwidth {copy / 1e12:.2f} TB/s")
    max_ctx = ns.context * max(ns.batches)
    checks = []
    if ns.fp32:
        model, kv = setup(dev, torch.float32, max_ctx, ns.preset, ns.fp8, ns.fp8_kv)
        checks += check(model, kv, stack_weights(model), ns.batches, ns.context, variants[:1])
        del model, kv
        torch.cuda.empty_cache()
    model, kv = setup(dev, torch.bfloat16, max_ctx, ns.preset, ns.fp8, ns.fp8_kv)
    weights = stack_weights(model)
    torch.cuda.empty_cache()
    checks += check(model, kv, weights, ns.batches, ns.context, variants)
    print_table("correctness against the layer loop", checks, CHECK_COLUMNS)
    rows = time_steps(model, weights, kv, ns.batches, ns.context, variants, copy)
    what = "bf16" + (", FP8 weights" if ns.fp8 else "") + (", FP8 KV cache" if ns.fp8_kv else "")
    print_table(f"decode steps of 2-16 rows, {ns.preset} shape, {what} ({info['gpu']})", rows, STEP_COLUMNS)
    traces = trace_steps(model, weights, kv, ns.batches, ns.context, variants, copy, rows) if ns.trace else []
    if traces:
        print_traces(traces, f"{ns.preset} shape, {what}, context {ns.context} ({info['gpu']})")
    name = "rows_megakernel" + ("" if ns.preset == "llama-3.2-1b" else f"_{ns.preset}")
    name += ("_fp8" if ns.fp8 else "") + ("_fp8kv" if ns.fp8_kv else "")
    json_path, _ = output_paths(ns.out, name)
    write_json(
        json_path,
        {
            "preset": ns.preset,
            "context": ns.context,
            "fp8_weights": ns.fp8,
            "fp8_kv_cache": ns.fp8_kv,
            "device": info,
            "copy_bandwidth": copy,
            "checks": checks,
            "timings": rows,
            "phase_trace": traces,
        },
    )


if __name__ == "__main__":
    main()
