"""Decode steps of 2–16 rows through the fused path with programmatic dependent launch (kernels/pdl.py),
against the layer loop the engine runs them through by default.

    python benchmarks/kernels/bench_pdl.py [--preset llama-3.2-1b] [--batches 2 4 8 16] [--context 640]
        [--out DIR]

A random-weight model of the preset's shape (bf16) on the GPU; each of `--batches` rows a sequence of
`--context` keys (distinct cache blocks). Timed as CUDA-graph replays of a whole step (decoder layers,
final norm, LM head; no sampling), 16 steps a graph, by path:
  * `layers`: the layer loop (cuBLAS products, ~10 kernels a layer), the engine's default at 2–16 rows;
  * `fused`: the fused path (our matrix-vector kernels with the norm, SwiGLU and residual folded in;
    cuBLAS for gate/up), `--fused-max-tokens 16`;
  * `ours`: the fused path with every product on our kernel, launched the ordinary way;
  * `pdl`: the same kernels launched as PDL dependents (`--pdl`);
  * `layers pdl`: the layer loop under `--pdl` (our kernels between cuBLAS's as dependents).
Floor: every weight read once, each row's K/V and the LM head, at the copy bandwidth measured at the start.
Correctness per batch: each path's hidden states and logits against the layer loop's (relative error,
argmax); `pdl` against `ours` and `layers pdl` against `layers` bitwise (the same kernels, only their
launches differ).
Writes pdl[_<preset>]_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_megakernel import setup
from bench_rows_megakernel import step_inputs
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
from tinyvllm.engine.paths.fused import fused_forward
from tinyvllm.kernels.pdl import programmatic_launches

TWINS = {"pdl": "ours", "layers pdl": "layers"}  # a PDL path and its ordinary launches

STEP_COLUMNS = [
    ("batch", "rows", ""),
    ("path", "path", ""),
    ("step_us", "µs/step", ".1f"),
    ("tok_per_s", "tok/s", ".0f"),
    ("floor_step_us", "floor µs", ".1f"),
    ("of_floor", "of floor", ".3f"),
    ("speedup", "× layers", ".3f"),
]
CHECK_COLUMNS = [
    ("batch", "rows", ""),
    ("path", "path", ""),
    ("hidden_rel_err", "hidden err", ".1e"),
    ("logits_rel_err", "logits err", ".1e"),
    ("argmax_equal", "argmax =", ""),
    ("bitwise_as_twin", "= without PDL", ""),
]


class StepPath:
    """One way of running a step: `layers` / `fused` through the executor, `ours` / `pdl` through
    `fused_forward(pdl=True)` and the LM head's fused product (with PDL for the latter)."""

    def __init__(self, model, name: str) -> None:
        self.name = name
        fused = not name.startswith("layers")
        cfg = RunnerConfig(
            fused_max_tokens=16 if fused else 1,
            decode_megakernel=False,
            pruned_lm_head=False,
            pdl=name == "layers pdl",
        )
        self.paths = ModelExecutor(model, cfg, "cuda")
        self.model = model

    def __call__(self, ids, pos, meta, kv, logits: bool = True):
        views = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
        if self.name in ("layers", "layers pdl", "fused"):
            hidden = self.paths.hidden_states(ids, pos, meta, views)
            return hidden, self.paths.lm_head.logits(hidden, dtype=None) if logits else None
        pdl = self.name == "pdl"
        self.paths.lm_head.pdl = pdl
        with programmatic_launches(pdl):
            hidden = fused_forward(self.model, ids, pos, meta, views, pdl=True)
        return hidden, self.paths.lm_head.logits(hidden, dtype=None) if logits else None


def paths_for(model) -> list[StepPath]:
    return [StepPath(model, name) for name in ("layers", "layers pdl", "fused", "ours", "pdl")]


@torch.no_grad()
def check(model, kv, batches: list[int], ctx: int) -> list[dict]:
    out = []
    for b in batches:
        ids, pos, meta = step_inputs(kv.device, b, ctx, kv.shape[2])
        results = {}
        for p in paths_for(model):
            results[p.name] = p(ids, pos, meta, kv.clone())
        h_ref, l_ref = results["layers"]
        for name, (h, lg) in results.items():
            twin = TWINS.get(name)  # the same kernels launched the ordinary way
            same = None if twin is None else torch.equal(h, results[twin][0]) and torch.equal(lg, results[twin][1])
            out.append(
                {
                    "batch": b,
                    "path": name,
                    "hidden_rel_err": rel_err(h, h_ref),
                    "logits_rel_err": rel_err(lg, l_ref),
                    "argmax_equal": bool((lg.argmax(-1) == l_ref.argmax(-1)).all()),
                    "bitwise_as_twin": same,
                }
            )
    return out


@torch.no_grad()
def time_steps(model, kv, batches: list[int], ctx: int, copy: float) -> list[dict]:
    cfg = model.config
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2
    )
    head_bytes = model.lm_head_weight.numel() * model.lm_head_weight.element_size()
    rows = []
    for b in batches:
        ids, pos, meta = step_inputs(kv.device, b, ctx, kv.shape[2])
        kv_bytes = b * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * ctx * cfg.head_dim * kv.element_size()
        floor = (weight_bytes + kv_bytes + head_bytes) / copy * 1e6
        for p in paths_for(model):
            step_us = bench_graph([lambda p=p: p(ids, pos, meta, kv)], calls=16, replays=9) * 1e3
            rows.append(
                {
                    "batch": b,
                    "path": p.name,
                    "step_us": step_us,
                    "tok_per_s": b * 1e6 / step_us,
                    "floor_step_us": floor,
                    "of_floor": floor / step_us,
                }
            )
            print(rows[-1], flush=True)
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["path"] == "layers")
        r["speedup"] = base["step_us"] / r["step_us"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.2-1b", help="the model shape (tinyvllm.models.presets)")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ns = ap.parse_args()
    dev = require_cuda()
    info = device_info(dev)
    copy = copy_bandwidth(dev)
    print(f"{info}\ncopy bandwidth {copy / 1e12:.2f} TB/s")
    model, kv = setup(dev, torch.bfloat16, ns.context * max(ns.batches), ns.preset)
    checks = check(model, kv, ns.batches, ns.context)
    print_table("correctness against the layer loop", checks, CHECK_COLUMNS)
    rows = time_steps(model, kv, ns.batches, ns.context, copy)
    print_table(f"decode steps of 2-16 rows, {ns.preset} shape, bf16 ({info['gpu']})", rows, STEP_COLUMNS)
    name = "pdl" + ("" if ns.preset == "llama-3.2-1b" else f"_{ns.preset}")
    json_path, _ = output_paths(ns.out, name)
    payload = {"preset": ns.preset, "context": ns.context, "device": info, "copy_bandwidth": copy}
    write_json(json_path, {**payload, "checks": checks, "timings": rows})


if __name__ == "__main__":
    main()
