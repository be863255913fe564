"""`tinyvllm serve`: registered here, implemented in tinyvllm.entrypoints.server (needs the [server] extra)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Placeholder until the server lands: no sub-command yet."""
