"""The OpenAI-compatible HTTP server (FastAPI), a drop-in for `vllm serve`. Needs the [server] extra.

`build_app(engine, args)` makes the app around a started engine client (tests run it on uvicorn in a
thread); `run_server(ns)` starts the engine process (`MPAsyncLLMEngine`; with `-dp N`, N of them behind
`DPAsyncLLMEngine`; with `--engine-in-thread`, an engine thread in this process instead) and serves
until SIGINT/SIGTERM, then shuts down as `tinyvllm.entrypoints.shutdown` describes (new requests 503,
in-flight ones get `--shutdown-timeout` seconds, then end with an error event), stops the engine and
exits 0. If the engine dies, the server shuts down the same way on its own and exits 1.

Every request first passes `RequestGuard` (body size and time limits, the drain, internal errors);
POST bodies are parsed and validated on a worker pool (`ServingContext.parse`, limits in
`tinyvllm.entrypoints.limits`).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (503 once the
engine has died), GET /metrics (Prometheus), POST /tokenize, POST /detokenize, GET /version.
Errors are OpenAI-shaped JSON (`tinyvllm.entrypoints.errors`); with an API key set, /v1/* need
`Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
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
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinyvllm
from tinyvllm.engine.async_llm import AsyncLLMEngine, EngineClient
from tinyvllm.entrypoints.errors import APIError, error_body
from tinyvllm.entrypoints.guard import RequestGuard, header_timeout_protocol
from tinyvllm.entrypoints.limits import ServerLimits, check_prompt_chars, limits_from_cli
from tinyvllm.entrypoints.metrics import make_registry
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tinyvllm.entrypoints.serving import ServingContext
from tinyvllm.entrypoints.serving_chat import create_chat_completion, render_chat
from tinyvllm.entrypoints.serving_completions import create_completion
from tinyvllm.entrypoints.shutdown import Drain, GracefulServer
from tinyvllm.reasoning import check_reasoning_parser
from tinyvllm.tool_parsers import check_tool_call_parser

logger = logging.getLogger(__name__)


@dataclass
class ServerArgs:
    served_model_names: list[str]
    api_key: str | None = None
    model_root: str | None = None  # shown as `root` in /v1/models
    created: int = field(default_factory=lambda: int(time.time()))
    limits: ServerLimits = field(default_factory=ServerLimits)
    tokenizer_workers: int = 2
    reasoning_parser: str | None = None  # the engine's --reasoning-parser (tinyvllm.reasoning)
    tool_call_parser: str | None = None  # --tool-call-parser (tinyvllm.tool_parsers)
    enable_auto_tool_choice: bool = False
    # CORS (browsers calling the API from a page of another origin): vLLM's flags and defaults
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        check_reasoning_parser(self.reasoning_parser)
        check_tool_call_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (llama3_json or hermes)")


def build_app(engine: EngineClient, args: ServerArgs) -> FastAPI:
    """The app for a started engine; the caller owns the engine (starts and shuts it down).
    `app.state.drain` is its shutdown state (`GracefulServer` drives it)."""
    app = FastAPI(title="tinyvllm", version=tinyvllm.__version__)
    drain = Drain()
    ctx = ServingContext(
        engine,
        list(args.served_model_names),
        args.limits,
        drain,
        args.tokenizer_workers,
        args.reasoning_parser,
        args.tool_call_parser,
        args.enable_auto_tool_choice,
    )
    registry, recorder = make_registry(lambda: engine.stats, ctx.model_name)
    engine.add_stats_listener(recorder)
    app.state.ctx = ctx
    app.state.drain = drain
    _add_error_handlers(app)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    # Outside the key check: a browser's preflight carries no key, and a 401 must carry the CORS
    # headers for the page to read it.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )
    app.add_middleware(RequestGuard, limits=args.limits, drain=drain)  # outermost
    _add_generation_routes(app, ctx)
    _add_status_routes(app, ctx, args, registry)
    _add_tokenizer_routes(app, ctx)
    _document_bodies(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest])
    return app


def _body(model: type[BaseModel]) -> dict:
    """openapi_extra of a route that parses its own body (on the worker pool) as `model`."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the request models in the OpenAPI document's components (routes refer to them by `_body`)."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = base()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, await ctx.parse(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, await ctx.parse(request, ChatCompletionRequest), request)


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

    def tokenize_body(body: TokenizeRequest) -> dict:
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
        else:
            check_prompt_chars(text, ctx.max_prompt_chars, "prompt")
        ids = ctx.tokenizer.encode(text, add_special_tokens=body.add_special_tokens and body.messages is None)
        strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize_body(body: DetokenizeRequest) -> dict:
        ctx.check_model(body.model)
        ids = ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(ids)}

    @app.post("/tokenize", openapi_extra=_body(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        return await ctx.run(tokenize_body, await ctx.parse(request, TokenizeRequest))

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        return await ctx.run(detokenize_body, await ctx.parse(request, DetokenizeRequest))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.param), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(e.errors())
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(ValidationError)
    async def invalid_body(_: Request, e: ValidationError) -> JSONResponse:
        message, param = _describe_validation_error(e.errors(include_url=False))
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code, headers=e.headers)

    # Other exceptions: RequestGuard logs them once and answers 500 on a connection that stays open.


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
    """Start the engine from the CLI flags, serve until SIGINT/SIGTERM, shut down cleanly; returns 0,
    1 when the engine could not be built or died, 2 for an impossible placement of its cores."""
    import uvicorn

    from tinyvllm.engine.args import DEFAULT_MODEL, engine_args_from_cli
    from tinyvllm.engine.dp_client import DPAsyncLLMEngine
    from tinyvllm.engine.mp_client import EngineStartError, MPAsyncLLMEngine

    engine_args = engine_args_from_cli(ns)
    step_timeout = ns.engine_step_timeout or None
    engine: Any
    if ns.engine_in_thread:
        from tinyvllm.engine.llm_engine import LLMEngine

        core = LLMEngine(engine_args, show_progress=True)
        engine = AsyncLLMEngine(core, max_waiting_requests=ns.max_waiting_requests).start()
    else:
        try:
            if engine_args.data_parallel_size > 1:
                engine = DPAsyncLLMEngine(
                    engine_args,
                    max_waiting_requests=ns.max_waiting_requests,
                    show_progress=True,
                    step_timeout_s=step_timeout,
                )
            else:
                engine = MPAsyncLLMEngine(
                    engine_args,
                    max_waiting_requests=ns.max_waiting_requests,
                    show_progress=True,
                    step_timeout_s=step_timeout,
                )
        except ValueError as e:
            print(f"tinyvllm serve: {e}", file=sys.stderr)
            return 2
        try:
            engine.start()
        except EngineStartError as e:
            print(f"tinyvllm serve: the engine could not start: {e}", file=sys.stderr)
            return 1
    names = ns.served_model_name or [engine_args.model or DEFAULT_MODEL]
    limits = limits_from_cli(ns)
    server_args = ServerArgs(
        names,
        api_key=ns.api_key,
        model_root=engine.info.model_dir,
        limits=limits,
        tokenizer_workers=ns.tokenizer_pool_size,
        reasoning_parser=getattr(engine_args, "reasoning_parser", None),
        tool_call_parser=ns.tool_call_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        allowed_origins=ns.allowed_origins,
        allowed_methods=ns.allowed_methods,
        allowed_headers=ns.allowed_headers,
        allow_credentials=ns.allow_credentials,
    )
    app = build_app(engine, server_args)
    protocol = header_timeout_protocol(limits.header_timeout_s)
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.uvicorn_log_level,
        timeout_graceful_shutdown=1,  # the drain has already waited --shutdown-timeout
        timeout_keep_alive=ns.keep_alive_timeout,
        **({"http": protocol} if protocol is not None else {}),
    )
    _return_freed_memory()
    freeze_startup_heap()
    server = GracefulServer(config, app.state.drain, ns.shutdown_timeout, engine=engine)
    try:
        with _signals_end_the_server():
            server.run()
    finally:
        engine.shutdown()
    if app.state.drain.draining:
        logger.warning(app.state.drain.summary())
    if server.engine_died:
        logger.error("server stopped: the engine died (%s)", engine.dead_error)
        return 1
    logger.info("server stopped")
    return 0


SERVING_GC_THRESHOLD = 10_000  # the youngest generation's collection threshold while serving (Python's: 700)


def freeze_startup_heap() -> None:
    """Collect once, then move every object start-up made (the app, the tokenizer, the imported
    modules) out of the collector's way (`gc.freeze()`): they live as long as the server, and each
    full collection would otherwise walk them all while requests stream (vLLM's API server does the
    same). Streaming allocates a few short-lived containers per token (the core's token ids, deltas,
    futures): the youngest generation is collected every `SERVING_GC_THRESHOLD` net allocations
    rather than 700, a pass that costs about what the objects still alive at that moment do."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if young:  # 0: automatic collection is off, and stays off
        gc.set_threshold(max(young, SERVING_GC_THRESHOLD), middle, old)


def _return_freed_memory() -> None:
    """Have glibc serve every allocation of 128 KiB or more with its own mmap, so that the memory of
    a large request body goes back to the system once freed. (glibc otherwise raises this threshold
    to the largest block freed so far, and later large blocks come from a heap it rarely shrinks.)"""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 128 * 1024)


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
