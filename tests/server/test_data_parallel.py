"""Data parallelism behind one server, and the server's reaction to a dead or hung engine core.

DP=2 answers 64 concurrent requests exactly as DP=1 does (greedy, float32) and its /metrics add up
over the cores; a killed core fails the requests routed to it with an error naming it while the other
core serves on; a hung core is killed by the step deadline; `tinyvllm serve` exits 1 within 30 s of a
core's death."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.mp_client import MPAsyncLLMEngine
from tinyvllm.entrypoints.server import ServerArgs, build_app
from tinyvllm.entrypoints.shutdown import GracefulServer

from .conftest import ENGINE_DEFAULTS, MODEL_NAME
from .faults import failing_engine, hanging_engine
from .test_cli_and_shutdown import _children, _gone, _start_serve

NUM_REQUESTS = 64
MAX_TOKENS = 12
STREAM = {"model": MODEL_NAME, "max_tokens": 250, "temperature": 0.0, "ignore_eos": True, "stream": True}


def _prompt(i: int) -> str:
    return f"request {i}: " + " ".join(f"w{(i * 7 + k) % 23}" for k in range(i % 9 + 1))


async def _complete_all(url: str) -> list[tuple[str, str]]:
    """NUM_REQUESTS greedy completions at once: (text, finish_reason) each, in request order."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:

        async def one(i: int) -> tuple[str, str]:
            out = await client.completions.create(
                model=MODEL_NAME,
                prompt=_prompt(i),
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            return out.choices[0].text, out.choices[0].finish_reason

        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    finally:
        await client.close()


@pytest.fixture(scope="module")
def dp2(make_server):
    return make_server(data_parallel_size=2)


def test_dp2_answers_64_concurrent_requests_as_dp1_does(make_server, dp2):
    one = make_server()
    expected = asyncio.run(_complete_all(one.url))
    got = asyncio.run(_complete_all(dp2.url))
    assert got == expected
    assert all(reason == "length" for _, reason in got)
    assert len({text for text, _ in got}) > NUM_REQUESTS // 2  # the prompts lead to different texts
    per_core = [core.stats["generation_tokens"] for core in dp2.engine.cores]
    assert min(per_core) >= NUM_REQUESTS * MAX_TOKENS // 4, per_core  # both cores served a fair share
    assert dp2.metric("vllm:generation_tokens_total") == sum(per_core) == NUM_REQUESTS * MAX_TOKENS
    assert dp2.metric("tinyvllm:kv_cache_blocks") == sum(core.stats["num_kv_blocks"] for core in dp2.engine.cores)
    assert httpx.get(dp2.url + "/health").status_code == 200


def _open_stream(client: httpx.Client, prompt: str) -> tuple[httpx.Response, object, str]:
    """A streamed completion, read up to its first event (the connection stays open)."""
    resp = client.send(client.build_request("POST", "/v1/completions", json={**STREAM, "prompt": prompt}), stream=True)
    lines = resp.iter_lines()
    return resp, lines, next(line for line in lines if line.startswith("data: "))


def _rest(lines) -> list[str]:
    return [line for line in lines if line.startswith("data: ")]


def test_a_killed_core_fails_its_requests_and_the_other_core_serves_on(make_server):
    live = make_server(data_parallel_size=2, max_model_len=512)
    cores = live.engine.cores
    with live.client() as a, live.client() as b:
        resp0, lines0, _ = _open_stream(a, "the first stream")
        # Core 0 is stopped as soon as its stream has begun: the tiny model writes its 250 tokens in well
        # under a second, and opening the second stream may take longer, after which there would be no
        # request left on core 0 to fail.
        os.kill(cores[0].pid, signal.SIGSTOP)
        try:
            resp1, lines1, _ = _open_stream(b, "the second stream")
            assert [core.num_in_flight for core in cores] == [1, 1]  # the router put one on each core
        finally:
            os.kill(cores[0].pid, signal.SIGKILL)
        dead_events = _rest(lines0)
        assert dead_events[-1] == "data: [DONE]"
        error = json.loads(dead_events[-2][6:])["error"]
        assert error["code"] == 503
        assert "data-parallel core 0 of 2" in error["message"] and "died unexpectedly" in error["message"]
        assert "SIGKILL" in error["message"]
        assert httpx.get(live.url + "/health").status_code == 503
        later = httpx.post(live.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
        assert later.status_code == 503 and "core 0 of 2" in later.json()["error"]["message"]
        live_events = _rest(lines1)  # core 1 finishes its request
        assert live_events[-1] == "data: [DONE]"
        assert json.loads(live_events[-2][6:])["choices"][0]["finish_reason"] == "length"
        resp0.close()
        resp1.close()
    assert live.engine.is_dead and not cores[0].is_running and cores[1].is_running


def test_a_hung_core_is_killed_by_the_deadline_and_fails_its_requests(make_server):
    live = make_server(
        engine_factory=functools.partial(hanging_engine, after_steps=5),
        client_kw={"step_timeout_s": 2.0},
        max_model_len=512,
    )
    started = time.monotonic()
    with live.client() as c:
        resp, lines, _ = _open_stream(c, "a stream that hangs")
        events = _rest(lines)
        resp.close()
    assert time.monotonic() - started < 30
    assert events[-1] == "data: [DONE]"
    message = json.loads(events[-2][6:])["error"]["message"]
    assert "sent nothing for" in message and "hung" in message and "killed" in message
    assert httpx.get(live.url + "/health").status_code == 503
    assert live.engine.is_dead and not live.engine.is_running


def _post_stream(url: str, prompt: str) -> tuple[int, str]:
    """A streamed completion read to its end: (HTTP status, body)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        resp = client.post("/v1/completions", json={**STREAM, "prompt": prompt})
        return resp.status_code, resp.text


def _finished_by_length(status: int, body: str) -> bool:
    events = [line for line in body.splitlines() if line.startswith("data: ")]
    return status == 200 and events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]


def test_serve_exits_1_within_30_s_of_a_core_dying(model_dir):
    """`tinyvllm serve -dp 2`, SIGKILL to a core while a request is in flight on it: that request ends
    with the error naming the death, and the server exits 1 within 30 s (-dp 1 takes the same path:
    `GracefulServer` watches any engine client's `is_dead`).

    The core to be killed is stopped (SIGSTOP) before any request is sent, so that nothing routed to
    it can finish before the kill (the tiny model generates 250 tokens in well under a second, so a
    running core may well be done with its stream by then). Which request the router sends to it
    follows from the router's rule (`tinyvllm.engine.dp_router`: least requests in flight, ties taken
    in turn): of two requests routed one after the other from idle cores, one goes to each core; the
    live core's finishes (and leaves the count before its last event is sent). Of a third request and
    the unfinished one, whichever is routed first goes to the stopped core (it is then the least
    loaded, or tied with the turn on it) and the other to the live core. So once one of those two has
    finished, the other is certainly queued on the stopped core."""
    dp = 2
    proc, url = _start_serve(model_dir, "-dp", str(dp))
    engines: list[int] = []
    try:
        engines = _children(proc.pid)
        assert len(engines) == dp, engines
        stopped = engines[0]
        os.kill(stopped, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            pending = {pool.submit(_post_stream, url, f"stream {i}") for i in range(2)}
            finished = []
            for prompt in ("stream 2", None):
                done, pending = concurrent.futures.wait(pending, timeout=60, return_when="FIRST_COMPLETED")
                assert len(done) == 1 and len(pending) == 1, (done, pending)
                finished += [f.result() for f in done]
                if prompt is not None:
                    pending.add(pool.submit(_post_stream, url, prompt))
            assert all(_finished_by_length(*result) for result in finished), finished
            (queued,) = pending
            os.kill(stopped, signal.SIGKILL)
            killed_at = time.monotonic()
            status, body = queued.result(timeout=30)
        assert status == 503, body
        message = json.loads(body)["error"]["message"]
        assert "data-parallel core" in message and f"of {dp}: the engine process died unexpectedly" in message, message
        assert "SIGKILL" in message, message
        with contextlib.suppress(httpx.TransportError):  # or already gone
            assert httpx.get(url + "/health", timeout=2).status_code == 503
        assert proc.wait(timeout=30) == 1
        assert time.monotonic() - killed_at < 30
        assert all(_gone(pid, timeout=10) for pid in engines)
        assert b"the engine died" in proc.stdout.read()
    finally:
        for pid in engines:  # a stopped core would outlive a failed test: let it see its pipe close
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_that_raises_stops_the_server_with_engine_died(model_dir):
    """The core's step raises (a dead tensor-parallel worker surfaces this way): the stream ends with
    the error, and `GracefulServer` (what `tinyvllm serve` runs) drains and stops on its own with
    `engine_died` set, the exit status 1 of `run_server`."""
    args = EngineArgs(model=str(model_dir), **{**ENGINE_DEFAULTS, "max_model_len": 512})
    engine = MPAsyncLLMEngine(args, engine_factory=functools.partial(failing_engine, after_steps=5)).start(timeout=120)
    app = build_app(engine, ServerArgs([MODEL_NAME]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = GracefulServer(uvicorn.Config(app, log_level="warning"), app.state.drain, 60.0, engine=engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.01)
        with httpx.Client(base_url=url, timeout=60) as c:
            resp, lines, first = _open_stream(c, "a stream that fails")
            events = [first, *_rest(lines)]
            resp.close()
        assert events[-1] == "data: [DONE]" and "injected device failure" in events[-2]
        thread.join(30)
        assert not thread.is_alive() and server.engine_died
        assert "injected device failure" in app.state.drain.reason
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()


def test_serve_tp2_exits_1_within_30_s_of_a_worker_dying(model_dir):
    """`tinyvllm serve -tp 2`: SIGKILL to the tensor-parallel worker (rank 1, a child of the engine core)
    mid-stream fails the stream with an error naming the dead rank, /health turns 503, the server exits 1
    within 30 s and no process of it is left."""
    proc, url = _start_serve(model_dir, "-tp", "2")
    try:
        (core,) = _children(proc.pid)
        (worker,) = _children(core)
        with httpx.Client(base_url=url, timeout=60) as c:
            resp, lines, _ = _open_stream(c, "a stream on two ranks")
            os.kill(worker, signal.SIGKILL)
            killed_at = time.monotonic()
            events = _rest(lines)
            resp.close()
        assert events[-1] == "data: [DONE]"
        message = json.loads(events[-2][6:])["error"]["message"]
        assert "tensor-parallel worker died" in message and "rank 1" in message and "SIGKILL" in message
        with contextlib.suppress(httpx.TransportError):  # or already gone
            assert httpx.get(url + "/health", timeout=2).status_code == 503
        assert proc.wait(timeout=30) == 1
        assert time.monotonic() - killed_at < 30
        assert _gone(core, timeout=10) and _gone(worker, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
