"""`tinyvllm bench shared-prefix`: 256 requests sharing a 1,024-token prefix, prefix caching on vs off."""

from __future__ import annotations

import argparse

HELP = "prefix caching on vs off: total time and time to first token"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from tinyvllm.bench.offline import add_common_cli_args

    add_common_cli_args(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument(
        "--profile", action="store_true", help="also break a decode step (prefix caching on) down by kernel class"
    )


def run(ns: argparse.Namespace) -> int:
    from tinyvllm.bench.offline import run_shared_prefix

    run_shared_prefix(ns)
    return 0
