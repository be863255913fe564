"""A target for Nsight Compute: batch-1 decode megakernel launches on the `llama-3.2-1b` shape (bf16).

    ncu --clock-control none --kernel-name regex:decode_megakernel --launch-skip 3 --launch-count 1 \
        --section WarpStateStats --section SourceCounters -o mk python3 scripts/ncu_megakernel.py --context 640

Builds the random-weight model and the benchmark's KV cache (benchmarks/kernels/bench_megakernel.py),
then runs `--launches` megakernel steps (the decoder layers and final norm of one token, no LM head),
so that a profiler can sample where the kernel's warps stall (scripts/ncu_lines.py). Prints the mean
step time of the launches as CUDA events see them (meaningless under a profiler's replay).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"))

import torch
from bench_megakernel import parse_config, run, setup, step_inputs

from tinyvllm.engine.paths.megakernel import DecodeMegakernel


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--variant", default="", metavar="FIELD=VALUE,...", help="MegakernelConfig fields (default: none)")
    ns = ap.parse_args()
    dev = torch.device("cuda")
    model, kv = setup(dev, torch.bfloat16, ns.context)
    cfg = parse_config(ns.variant)
    mk = DecodeMegakernel(model).variant(cfg)
    ids, pos, meta = step_inputs(dev, ns.context, kv.shape[2])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run(model, mk, ids, pos, meta, kv, logits=False)  # compile
    torch.cuda.synchronize()
    start.record()
    for _ in range(ns.launches):
        run(model, mk, ids, pos, meta, kv, logits=False)
    end.record()
    torch.cuda.synchronize()
    print(f"{ns.launches} launches, {start.elapsed_time(end) / ns.launches * 1e3:.1f} us per step (eager)")


if __name__ == "__main__":
    main()
