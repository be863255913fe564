"""The OpenAI-compatible HTTP server (FastAPI), a drop-in for `vllm serve`. Needs the [server] extra.

`build_app(engine, args)` makes the app around a started engine client (tests run it on uvicorn in a
thread); `run_server(ns)` starts the engine process (`MPAsyncLLMEngine`; with `--engine-in-thread`, an
engine thread in this process instead) and serves until SIGINT/SIGTERM: uvicorn stops accepting,
in-flight requests get `--shutdown-timeout` seconds to finish (then they are cancelled, which aborts
them), the engine stops, and the process exits 0.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (503 once the
engine has died), GET /metrics (Prometheus), POST /tokenize, POST /detokenize, GET /version.
Errors are OpenAI-shaped JSON (`tinyvllm.entrypoints.errors`); with an API key set, /v1/* need
`Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinyvllm
from tinyvllm.engine.async_llm import AsyncLLMEngine, EngineClient
from tinyvllm.entrypoints.errors import APIError, error_body
from tinyvllm.entrypoints.metrics import make_registry
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tinyvllm.entrypoints.serving import ServingContext
from tinyvllm.entrypoints.serving_chat import create_chat_completion, render_chat
from tinyvllm.entrypoints.serving_completions import create_completion

logger = logging.getLogger(__name__)


@dataclass
class ServerArgs:
    served_model_names: list[str]
    api_key: str | None = None
    model_root: str | None = None  # shown as `root` in /v1/models
    created: int = field(default_factory=lambda: int(time.time()))


def build_app(engine: EngineClient, args: ServerArgs) -> FastAPI:
    """The app for a started engine; the caller owns the engine (starts and shuts it down)."""
    app = FastAPI(title="tinyvllm", version=tinyvllm.__version__)
    ctx = ServingContext(engine, list(args.served_model_names))
    registry, recorder = make_registry(lambda: engine.stats, ctx.model_name)
    engine.add_stats_listener(recorder)
    app.state.ctx = ctx
    _add_error_handlers(app)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    _add_generation_routes(app, ctx)
    _add_status_routes(app, ctx, args, registry)
    _add_tokenizer_routes(app, ctx)
    return app


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)


def _add_status_routes(app: FastAPI, ctx: ServingContext, args: ServerArgs, registry: CollectorRegistry) -> None:
    """GET /v1/models, /health, /metrics (from `registry`) and /version."""
    engine = ctx.engine

    @app.get("/v1/models")
    async def models() -> dict:
        data = [
            {
                "id": name,
                "object": "model",
                "created": args.created,
                "owned_by": "tinyvllm",
                "root": args.model_root or name,
                "parent": None,
                "max_model_len": ctx.max_model_len,
            }
            for name in ctx.served_model_names
        ]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.is_dead else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": tinyvllm.__version__}


def _add_tokenizer_routes(app: FastAPI, ctx: ServingContext) -> None:
    """POST /tokenize (a prompt or chat messages) and /detokenize."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        text = body.prompt
        if body.messages is not None:
            text = render_chat(
                ctx,
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
            )
        ids = ctx.tokenizer.encode(text, add_special_tokens=body.add_special_tokens and body.messages is None)
        strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx.check_model(body.model)
        ids = ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(ids)}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.param), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(e.errors())
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), 500)


def _describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """(message, param) of pydantic's errors; param is the dotted path of the first bad field."""
    parts, param = [], None
    for err in list(errors)[:3]:
        loc = _field_path(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        path = ".".join(loc)
        param = param or path or None
        parts.append(f"{path}: {err.get('msg')}" if path else f"body: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: Any) -> list[str]:
    """pydantic's error location without "body" and without the union-member tags it inserts
    ("str", "list[int]", "TextPart", ...): ("body", "prompt", "list[int]", 2) -> ["prompt"]."""
    path = []
    for item in loc:
        if item == "body" and not path:
            continue
        text = str(item)
        if not isinstance(item, int) and (text in _TYPE_TAGS or "[" in text or text[:1].isupper()):
            break
        path.append(text)
    return path


class APIKeyMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): /v1/* need the bearer key."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self._expected):
                body = error_body(401, "Incorrect or missing API key (send Authorization: Bearer KEY)")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------- `tinyvllm serve`
def run_server(ns: argparse.Namespace) -> int:
    """Start the engine from the CLI flags, serve until SIGINT/SIGTERM, shut down cleanly; returns 0
    (1 when the engine could not be built)."""
    import uvicorn

    from tinyvllm.engine.args import DEFAULT_MODEL, engine_args_from_cli
    from tinyvllm.engine.mp_client import EngineStartError, MPAsyncLLMEngine

    engine_args = engine_args_from_cli(ns)
    engine: EngineClient
    if ns.engine_in_thread:
        from tinyvllm.engine.llm_engine import LLMEngine

        core = LLMEngine(engine_args, show_progress=True)
        engine = AsyncLLMEngine(core, max_waiting_requests=ns.max_waiting_requests).start()
    else:
        try:
            engine = MPAsyncLLMEngine(
                engine_args, max_waiting_requests=ns.max_waiting_requests, show_progress=True
            ).start()
        except EngineStartError as e:
            print(f"tinyvllm serve: the engine could not start: {e}", file=sys.stderr)
            return 1
    names = ns.served_model_name or [engine_args.model or DEFAULT_MODEL]
    app = build_app(engine, ServerArgs(names, api_key=ns.api_key, model_root=engine.info.model_dir))
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.uvicorn_log_level,
        timeout_graceful_shutdown=ns.shutdown_timeout,
        timeout_keep_alive=ns.keep_alive_timeout,
    )
    try:
        with _signals_end_the_server():
            uvicorn.Server(config).run()
    finally:
        engine.shutdown()
    logger.info("server stopped")
    return 0


@contextmanager
def _signals_end_the_server() -> Iterator[None]:
    """uvicorn handles SIGINT/SIGTERM itself, then re-raises the signal under the handler it found:
    give it a no-op one, so a signalled shutdown ends with exit status 0 rather than death by signal."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
