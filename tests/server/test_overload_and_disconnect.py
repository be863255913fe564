"""A full waiting queue is a 503 with Retry-After; a client that goes away aborts its request at once
and every KV block returns to the pool (seen through /metrics); a dead engine is a 503 everywhere."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import MODEL_NAME
from .faults import failing_engine

LONG = {
    "model": MODEL_NAME,
    "prompt": "Once upon a time",
    "max_tokens": 2000,
    "temperature": 1.0,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def slow_server(make_server):
    """One sequence at a time, one waiting at most: a 2000-token request keeps it busy for seconds."""
    return make_server(max_model_len=2048, max_num_seqs=1, max_waiting_requests=1)


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _pool_is_free(live) -> bool:
    return (
        live.metric("tinyvllm:kv_cache_free_blocks") == live.metric("tinyvllm:kv_cache_blocks")
        and live.metric("vllm:num_requests_running") == 0
        and live.metric("vllm:num_requests_waiting") == 0
    )


def _first_event(resp: httpx.Response) -> str:
    """Read up to the first SSE event, keeping the connection open (closing an httpx line iterator
    early closes the connection, which would abort the request)."""
    lines = resp.iter_lines()
    resp.extensions["tinyvllm_lines"] = lines  # keep the iterator alive as long as the response
    return next(line for line in lines if line.startswith("data: "))


def test_full_queue_is_a_503_with_retry_after(slow_server):
    with (
        slow_server.client() as a,
        slow_server.client() as b,
        a.stream("POST", "/v1/completions", json=LONG) as running,
    ):
        assert running.status_code == 200 and _first_event(running)  # running now
        with b.stream("POST", "/v1/completions", json=LONG) as waiting:
            assert waiting.status_code == 200  # accepted: it waits behind the running one
            refused = httpx.post(slow_server.url + "/v1/completions", json={**LONG, "stream": False})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == 503
            chat = httpx.post(
                slow_server.url + "/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            )
            assert chat.status_code == 503
    assert _wait_until(lambda: _pool_is_free(slow_server))


def test_streaming_disconnect_aborts_and_frees_every_block(slow_server):
    aborted = (
        slow_server.metric('vllm:request_success_total{finished_reason="abort",model_name="tiny"}')
        if "abort" in httpx.get(slow_server.url + "/metrics").text
        else 0.0
    )
    with slow_server.client() as c, c.stream("POST", "/v1/completions", json=LONG) as resp:
        assert _first_event(resp)
        assert slow_server.metric("tinyvllm:kv_cache_free_blocks") < slow_server.metric("tinyvllm:kv_cache_blocks")
        started = time.monotonic()
        # leaving the block closes the connection mid-stream
    assert _wait_until(lambda: _pool_is_free(slow_server), timeout=5)
    assert time.monotonic() - started < 3.0  # sooner than the 2000 tokens take; the abort count proves it
    after = slow_server.metric('vllm:request_success_total{finished_reason="abort",model_name="tiny"}')
    assert after == aborted + 1


def test_non_streaming_disconnect_aborts_too(slow_server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", json={**LONG, "stream": False}, timeout=0.5)
    assert _wait_until(lambda: _pool_is_free(slow_server), timeout=5)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_dead_engine_is_a_503_and_fails_in_flight_requests(make_server, mode):
    live = make_server(mode, engine_factory=functools.partial(failing_engine, after_steps=5), max_model_len=2048)
    with live.client() as c, c.stream("POST", "/v1/completions", json=LONG) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert "injected device failure" in events[-2] and events[-1] == "data: [DONE]"
    assert httpx.get(live.url + "/health").status_code == 503
    resp = httpx.post(live.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
    assert resp.status_code == 503 and "injected device failure" in resp.json()["error"]["message"]
    assert live.engine.is_dead


def test_killed_engine_process_is_a_503_and_fails_in_flight_requests(make_server):
    """SIGKILL the engine process mid-stream: the stream ends with an in-band error and [DONE], a
    non-streaming request in flight gets a 503, /health turns 503 and so does every later request."""
    live = make_server(max_model_len=2048)
    pid = live.engine.pid

    def non_streaming() -> httpx.Response:
        return httpx.post(live.url + "/v1/completions", json={**LONG, "stream": False}, timeout=30)

    with ThreadPoolExecutor(1) as pool, live.client() as c, c.stream("POST", "/v1/completions", json=LONG) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        pending = pool.submit(non_streaming)
        assert _wait_until(
            lambda: live.metric("vllm:num_requests_running") + live.metric("vllm:num_requests_waiting") == 2
        )
        os.kill(pid, signal.SIGKILL)
        events = [first] + [line for line in lines if line.startswith("data: ")]
        other = pending.result()
    assert events[-1] == "data: [DONE]" and "died unexpectedly" in events[-2] and "SIGKILL" in events[-2]
    assert json.loads(events[-2][6:])["error"]["code"] == 503
    assert other.status_code == 503 and "died unexpectedly" in other.json()["error"]["message"]
    assert httpx.get(live.url + "/health").status_code == 503
    later = httpx.post(live.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
    assert later.status_code == 503 and later.json()["error"]["code"] == 503
    assert live.engine.is_dead and not live.engine.is_running
