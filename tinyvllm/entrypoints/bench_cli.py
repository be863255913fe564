"""`tinyvllm bench <workload>`: the benchmarks of WORKLOADS.md, each a sub-command."""
from __future__ import annotations

import argparse

from tinyvllm.engine.args import add_engine_cli_args


def _offline(sub: argparse._SubParsersAction, name: str, help: str, func_name: str, **defaults) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    add_engine_cli_args(p)
    p.set_defaults(model="dummy:llama-3.2-1b", dtype="bfloat16", **defaults)
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="also run Hugging Face transformers' generate on the same weights")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--name", default=None, help="JSON file name (default: the workload's)")

    def run(ns: argparse.Namespace) -> int:
        from tinyvllm.bench import offline

        getattr(offline, func_name)(ns)
        return 0

    p.set_defaults(func=run)
    return p


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (WORKLOADS.md): ours, the baseline and the floor")
    workloads = bench.add_subparsers(dest="workload", required=True)

    lat = _offline(workloads, "latency", "batch 1: TTFT and decode tokens/s", "run_latency")
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=512)
    lat.add_argument("--iters", type=int, default=3)
    lat.add_argument("--baseline-output-len", type=int, default=128,
                     help="tokens transformers generates (its rate is per token; fewer saves time)")

    thr = _offline(workloads, "throughput", "256 random requests, output tokens/s", "run_throughput")
    thr.add_argument("--num-prompts", type=int, default=256)
    thr.add_argument("--baseline-requests", type=int, default=32,
                     help="transformers runs the first N requests as one padded static batch")
    thr.add_argument("--profile", action="store_true", help="also break a decode step down by kernel class")

    sp = _offline(workloads, "shared-prefix", "prefix caching on vs off", "run_shared_prefix")
    sp.add_argument("--num-prompts", type=int, default=256)
