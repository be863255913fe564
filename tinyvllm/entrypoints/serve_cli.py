"""`tinyvllm serve`: flags here, server in tinyvllm.entrypoints.server (needs the [server] extra:
fastapi, uvicorn, prometheus-client, imported only when the command runs)."""

from __future__ import annotations

import argparse
import os
import sys

from tinyvllm.engine.args import add_engine_cli_args


def add_server_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $VLLM_API_KEY)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use as `model` (default: the --model argument)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 + Retry-After while this many requests wait to be scheduled",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before being aborted",
    )
    g.add_argument("--keep-alive-timeout", type=int, default=5)
    g.add_argument(
        "--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    g.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the engine on a thread of the server process instead of in a process of its "
        "own (the engine's and the server's Python then share one GIL)",
    )


def cmd_serve(ns: argparse.Namespace) -> int:
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            print("tinyvllm serve: give the model once (positional or --model)", file=sys.stderr)
            return 2
        ns.model = ns.model_tag
    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 1:
        print("tinyvllm serve: --max-waiting-requests must be at least 1", file=sys.stderr)
        return 2
    try:
        from tinyvllm.entrypoints.server import run_server
    except ImportError as e:
        print(f"tinyvllm serve needs the server extra ({e}): pip install 'tinyvllm[server]'", file=sys.stderr)
        return 1
    return run_server(ns)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `serve`: vllm serve's flags (engine options in vLLM's spelling, then the server's own)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the [server] extra)")
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model directory or dummy:<preset> (same as --model)",
    )
    add_engine_cli_args(p)
    add_server_cli_args(p)
    p.set_defaults(func=cmd_serve)
