"""`tinyvllm bench`: latency and throughput benchmarks."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Placeholder until the benchmarks land: no sub-command yet."""
