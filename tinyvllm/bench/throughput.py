"""`tinyvllm bench throughput`: the 256-request offline workload (docs/workloads.md), output tokens/s."""

from __future__ import annotations

import argparse

HELP = "256 random requests: output tokens/s, beside transformers and the floor"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from tinyvllm.bench.offline import add_common_cli_args

    add_common_cli_args(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument(
        "--baseline-requests",
        type=int,
        default=32,
        help="transformers runs the first N requests as one padded static batch",
    )
    p.add_argument("--profile", action="store_true", help="also break a decode step down by kernel class")
    p.add_argument("--top-p", type=float, default=None, help="every request samples with this top_p")
    p.add_argument("--top-k", type=int, default=None, help="every request samples with this top_k")
    p.add_argument("--min-p", type=float, default=None, help="every request samples with this min_p")


def run(ns: argparse.Namespace) -> int:
    from tinyvllm.bench.offline import run_throughput

    run_throughput(ns)
    return 0
