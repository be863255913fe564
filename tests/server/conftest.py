"""A live server on loopback: uvicorn in a background thread around a tiny random-weight model.

`make_server(mode, **engine_overrides, max_waiting_requests=..., api_key=..., engine_factory=...,
server_kw={ServerArgs fields}, model=another checkpoint directory, client_kw={more client arguments})`
starts an engine (mode "process": MPAsyncLLMEngine, the default of `tinyvllm serve`, its engine in a
spawned process, or DPAsyncLLMEngine with data_parallel_size > 1; "thread": AsyncLLMEngine around an
LLMEngine built here) and an app, and serves it on a free port. `server` is the shared default one,
in both modes (module tests reuse it).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import uvicorn

from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.async_llm import AsyncLLMEngine, EngineClient
from tinyvllm.engine.dp_client import DPAsyncLLMEngine
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.mp_client import MPAsyncLLMEngine
from tinyvllm.entrypoints.server import ServerArgs, build_app
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

MODEL_NAME = "tiny"
ENGINE_DEFAULTS = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=512, max_num_batched_tokens=512)


@dataclass
class LiveServer:
    url: str
    engine: EngineClient
    uvicorn_server: uvicorn.Server
    thread: threading.Thread

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kw)

    def metric(self, name: str) -> float:
        """The value of one unlabelled-or-model-labelled sample from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-serve")
    write_dummy_checkpoint(path, make_config("tiny"), seed=7, init_std=0.1, dtype="float32")
    return path


def start_server(engine: EngineClient, api_key: str | None = None, **server_kw) -> LiveServer:
    """Serve `engine`; `server_kw`: more ServerArgs fields (tool_call_parser, reasoning_parser, ...)."""
    app = build_app(engine, ServerArgs([MODEL_NAME], api_key=api_key, **server_kw))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return LiveServer(f"http://127.0.0.1:{port}", engine, server, thread)


@pytest.fixture(scope="session")
def make_server(model_dir) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def make(
        mode: str = "process",
        max_waiting_requests: int | None = None,
        api_key: str | None = None,
        engine_factory=None,
        server_kw: dict | None = None,
        model: str | None = None,
        client_kw: dict | None = None,
        **engine_kw,
    ) -> LiveServer:
        args = EngineArgs(model=model or str(model_dir), **{**ENGINE_DEFAULTS, **engine_kw})
        if mode == "thread":
            core = engine_factory(args) if engine_factory is not None else LLMEngine(args)
            engine: EngineClient = AsyncLLMEngine(core, max_waiting_requests=max_waiting_requests).start()
        else:
            client = DPAsyncLLMEngine if args.data_parallel_size > 1 else MPAsyncLLMEngine
            engine = client(
                args, max_waiting_requests=max_waiting_requests, engine_factory=engine_factory, **(client_kw or {})
            ).start(timeout=120)
        live = start_server(engine, api_key, **(server_kw or {}))
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


@pytest.fixture(scope="session", params=["process", "thread"])
def server(make_server, request) -> LiveServer:
    return make_server(request.param)
