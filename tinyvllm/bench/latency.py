"""`tinyvllm bench latency`: batch 1, 128 prompt tokens, 512 greedy output tokens (docs/workloads.md);
`--batch-size N`: N such rows decoding together."""

from __future__ import annotations

import argparse

HELP = "batch 1: time to first token and decode tokens/s, beside transformers and the floor"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from tinyvllm.bench.offline import add_common_cli_args

    add_common_cli_args(p)
    p.add_argument("--batch-size", type=int, default=1, help="rows decoding together (1: the latency workload)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also break a decode step down by kernel class")
    p.add_argument(
        "--baseline-output-len",
        type=int,
        default=128,
        help="tokens transformers generates (its rate is per token; fewer saves time)",
    )


def run(ns: argparse.Namespace) -> int:
    from tinyvllm.bench.offline import run_latency

    run_latency(ns)
    return 0
