"""`tinyvllm serve`: flags here, server in tinyvllm.entrypoints.server (needs the [server] extra:
fastapi, uvicorn, prometheus-client, imported only when the command runs)."""

from __future__ import annotations

import argparse
import os
import sys

from tinyvllm.engine.args import add_engine_cli_args, engine_args_from_cli
from tinyvllm.engine.mp_client import DEFAULT_STEP_TIMEOUT_S
from tinyvllm.entrypoints.limits import ServerLimits, limits_from_cli
from tinyvllm.tool_parsers import TOOL_CALL_PARSERS


def _json_strings(text: str) -> list[str]:
    """A command-line value that must be a JSON list of strings (vLLM's spelling of the CORS flags)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


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
        help="after SIGINT/SIGTERM, new requests get 503 and those in flight get this many seconds to "
        "finish; then each remaining stream ends with an error event and [DONE] (a second signal: now)",
    )
    g.add_argument(
        "--engine-step-timeout",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="with requests in flight, an engine process that sends nothing for this many seconds is hung: "
        "it is killed, its requests fail and the server exits 1 (0: no deadline)",
    )
    g.add_argument("--keep-alive-timeout", type=int, default=5, help="seconds an idle connection stays open")
    g.add_argument(
        "--tokenizer-pool-size",
        type=int,
        default=2,
        help="threads that parse request bodies, render chat templates and tokenize (off the event loop)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": find the calls in the model\'s text with --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="the model's tool-call format: llama3_json (Llama 3.x) or hermes (Qwen2.5, Qwen3, Hermes)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_json_strings,
        default=["*"],
        help="origins whose web pages may call the API (CORS), a JSON list: '[\"https://app.example\"]'",
    )
    g.add_argument("--allowed-methods", type=_json_strings, default=["*"], help="CORS: allowed methods, a JSON list")
    g.add_argument("--allowed-headers", type=_json_strings, default=["*"], help="CORS: allowed headers, a JSON list")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    add_limit_cli_args(parser)
    g.add_argument(
        "--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    g.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the engine on a thread of the server process instead of in a process of its "
        "own (the engine's and the server's Python then share one GIL)",
    )


def add_limit_cli_args(parser: argparse.ArgumentParser) -> None:
    """Per-request limits (tinyvllm.entrypoints.limits.ServerLimits); each refusal is a 4xx naming the field."""
    d = _limit_defaults()
    g = parser.add_argument_group("request limits")
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=d["max_body_bytes"],
        help="larger bodies get 413 (a declared Content-Length at once, a chunked body when it passes the limit)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="prompts (or rendered chats) longer than this get 400 before tokenization; default: "
        "max_model_len x the longest token's length in bytes (longer cannot fit), 0: no limit",
    )
    g.add_argument("--max-n", type=int, default=d["max_n"], help="the largest `n`")
    g.add_argument("--max-stop-strings", type=int, default=d["max_stop_strings"], help="most strings in `stop`")
    g.add_argument(
        "--max-stop-string-chars", type=int, default=d["max_stop_string_chars"], help="longest string in `stop`"
    )
    g.add_argument("--max-logprobs", type=int, default=d["max_logprobs"], help="the largest logprobs/top_logprobs")
    g.add_argument(
        "--max-tools-bytes", type=int, default=d["max_tools_bytes"], help="largest `tools` (bytes of compact JSON)"
    )
    g.add_argument(
        "--max-json-depth", type=int, default=d["max_json_depth"], help="deepest nesting of objects and arrays"
    )
    g.add_argument(
        "--request-header-timeout",
        type=float,
        default=d["header_timeout_s"],
        help="seconds a request's line and headers may take to arrive (slow clients), then 408 and close",
    )
    g.add_argument(
        "--request-body-timeout",
        type=float,
        default=d["body_timeout_s"],
        help="seconds a request's body may take to arrive, then 408 and close",
    )


def _limit_defaults() -> dict:
    limits = ServerLimits()
    return {name: getattr(limits, name) for name in ServerLimits.__dataclass_fields__}


def cmd_serve(ns: argparse.Namespace) -> int:
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            print("tinyvllm serve: give the model once (positional or --model)", file=sys.stderr)
            return 2
        ns.model = ns.model_tag
    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 1:
        print("tinyvllm serve: --max-waiting-requests must be at least 1", file=sys.stderr)
        return 2
    if ns.engine_step_timeout < 0:
        print("tinyvllm serve: --engine-step-timeout must be at least 0 (0: no deadline)", file=sys.stderr)
        return 2
    try:
        parallel = engine_args_from_cli(ns).parallel_config()
    except ValueError as e:
        print(f"tinyvllm serve: {e}", file=sys.stderr)
        return 2
    if ns.engine_in_thread and parallel.data_parallel_size > 1:
        print("tinyvllm serve: -dp N runs N engine processes; drop --engine-in-thread", file=sys.stderr)
        return 2
    if ns.tokenizer_pool_size < 1:
        print("tinyvllm serve: --tokenizer-pool-size must be at least 1", file=sys.stderr)
        return 2
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        print(
            "tinyvllm serve: --enable-auto-tool-choice needs --tool-call-parser, one of "
            + ", ".join(TOOL_CALL_PARSERS),
            file=sys.stderr,
        )
        return 2
    try:
        limits_from_cli(ns)
    except ValueError as e:
        print(f"tinyvllm serve: {e}", file=sys.stderr)
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
