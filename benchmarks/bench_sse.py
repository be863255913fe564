"""API-process CPU cost of streaming (SSE): µs per event and per token, on this CPU, no model.

The real `tinyvllm serve` app (build_app + uvicorn, MPAsyncLLMEngine: reader thread decoding the
core's messages and running the output processing, RequestStreams, SSE) runs in a server subprocess;
its engine process runs a fake
engine that, once requests are in, returns one token per running request every step, as fast as the
API side takes them (the output pipe's back-pressure paces it; `--step-ms` sleeps per step instead,
like a GPU step). `--concurrency` clients stream /v1/completions (a token-id prompt) or
/v1/chat/completions with stream_options.include_usage, `--max-tokens` tokens each, all at once.

Per endpoint it reports the server process's CPU seconds over the load (from /proc: all its threads;
the event loop's main thread apart), SSE events received (chunks with choices), tokens delivered
(from the usage chunks), tokens/s, API-process CPU µs per event and per token, and tokens per event
(how much the per-stream merging batches). `--profile` reruns each endpoint with cProfile (CPU time
per thread) in the server's main thread (the event loop) and its reader thread, and prints each
one's top 20 by total time.

    python -m benchmarks.bench_sse [--client httpx|raw] [--concurrency 256] [--max-tokens 512]
                                   [--profile] [--label NAME]

`httpx` is a common Python client; `raw` is a minimal asyncio HTTP/1.1 client (far less client CPU, so
on a small machine the server is less starved). Linux only (/proc). Writes sse_<label>_cpu.json, the
label by default `paced<N>ms` or `unpaced`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MODEL = "fake"


# ---------------------------------------------------------------------- the fake engine (engine process)
@dataclass
class FakeArgs:
    """What MPAsyncLLMEngine hands the engine factory (must pickle): the tokenizer's directory and
    the fake's pacing."""

    tokenizer: str
    vocab_size: int
    max_model_len: int = 4096
    step_ms: float = 0.0


@dataclass
class _Request:
    request_id: str
    max_tokens: int
    done: int = 0


@dataclass
class _Scheduler:
    waiting: list = field(default_factory=list)


@dataclass
class _Config:
    vocab_size: int = 0
    max_model_len: int = 0


class FakeEngine:
    """The LLMEngine surface EngineCore and EngineInfo use; `core_step()` gives every running request
    one random regular token (finish_reason "length" at its max_tokens)."""

    def __init__(self, args: FakeArgs) -> None:
        from tinyvllm.sampling_params import SamplingParams

        self.tokenizer = None  # the API process loads its own from args.tokenizer
        self.model_dir = args.tokenizer
        self.model_config = _Config(vocab_size=args.vocab_size)
        self.scheduler_config = _Config(max_model_len=args.max_model_len)
        self.default_sampling_params = SamplingParams()
        self.default_max_tokens = None
        self.max_tokens_cap = None
        self.scheduler = _Scheduler()
        self._step_s = args.step_ms / 1e3
        self._requests: dict[str, _Request] = {}
        rng = random.Random(0)
        self._ids = [rng.randrange(args.vocab_size - 512) for _ in range(4096)]
        self._k = 0

    def get_metrics(self) -> dict[str, float]:
        return {"num_requests_running": len(self._requests)}

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_idle_work(self) -> bool:
        return False

    def add_core_request(self, request_id: str, prompt: Any, params: Any, arrival_time: float | None = None) -> None:
        self._requests[request_id] = _Request(request_id, params.max_tokens or 256)

    def abort(self, command: Any) -> None:
        self._requests.pop(command.request_id, None)

    def core_step(self, early: Any = None) -> list:
        from tinyvllm.engine.messages import EngineCoreOutput, RequestTimes

        if self._step_s:
            time.sleep(self._step_s)
        outputs = []
        ids, k = self._ids, self._k
        for r in list(self._requests.values()):
            r.done += 1
            finished = r.done >= r.max_tokens
            times = RequestTimes(0.0, 0.0, 0.0) if finished or r.done == 1 else None
            outputs.append(
                EngineCoreOutput(r.request_id, [ids[k & 4095]], 0, 0, "length" if finished else None, times=times)
            )
            k += 1
            if finished:
                del self._requests[r.request_id]
        self._k = k
        return outputs


def fake_engine(args: FakeArgs) -> FakeEngine:
    """The engine factory (runs in the engine process)."""
    return FakeEngine(args)


# ---------------------------------------------------------------------- the server process
def _profiled_engine_class() -> type:
    from tinyvllm.engine.mp_client import MPAsyncLLMEngine

    class ProfiledMPAsyncLLMEngine(MPAsyncLLMEngine):
        """Profiles its reader thread (decoding, output processing, dispatching) with per-thread CPU time."""

        reader_profile: cProfile.Profile | None = None

        def _read(self) -> None:
            prof = cProfile.Profile(time.thread_time)
            prof.enable()
            try:
                super()._read()
            finally:
                prof.disable()
                self.reader_profile = prof

    return ProfiledMPAsyncLLMEngine


def serve(port: int, tokenizer_dir: str, vocab_size: int, step_ms: float, profile_path: str | None) -> None:
    """Run the app on 127.0.0.1:`port` around the fake engine until SIGINT; with `profile_path`, dump
    the main and reader threads' merged cProfile stats there."""
    import uvicorn

    from tinyvllm.engine.mp_client import MPAsyncLLMEngine
    from tinyvllm.entrypoints.server import ServerArgs, _signals_end_the_server, build_app, freeze_startup_heap

    cls = _profiled_engine_class() if profile_path else MPAsyncLLMEngine
    engine = cls(FakeArgs(tokenizer_dir, vocab_size, step_ms=step_ms), engine_factory=fake_engine).start(timeout=60)
    app = build_app(engine, ServerArgs([MODEL]))
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2, backlog=4096
    )
    freeze_startup_heap()  # as `tinyvllm serve` does
    prof = cProfile.Profile(time.thread_time) if profile_path else None
    if prof is not None:
        prof.enable()
    try:
        with _signals_end_the_server():
            uvicorn.Server(config).run()
    finally:
        if prof is not None:
            prof.disable()
        engine.shutdown()
    if profile_path and prof is not None:
        prof.dump_stats(profile_path + ".loop")
        if engine.reader_profile is not None:
            engine.reader_profile.dump_stats(profile_path + ".reader")


# ---------------------------------------------------------------------- clients
@dataclass
class Tally:
    events: int = 0  # SSE data chunks with choices
    tokens: int = 0  # completion tokens, from the usage chunks
    errors: list[str] = field(default_factory=list)

    def line(self, payload: bytes) -> None:
        """One `data: ...` payload."""
        if payload == b"[DONE]":
            return
        if payload.startswith(b'{"error"') or b'"choices":[]' in payload:
            data = json.loads(payload)
            if "error" in data:
                self.errors.append(str(data["error"]))
            elif data.get("usage"):
                self.tokens += data["usage"]["completion_tokens"]
            return
        self.events += 1


def _body(endpoint: str, max_tokens: int, i: int) -> dict:
    common = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "completions":
        return {**common, "prompt": [(i * 7 + j) % 1000 + 10 for j in range(16)]}
    return {**common, "messages": [{"role": "user", "content": f"Say something, number {i}."}]}


async def _httpx_one(client: Any, url: str, body: dict, tally: Tally) -> None:
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            tally.errors.append(f"HTTP {resp.status_code}")
            return
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                tally.line(line[6:].encode())


async def _raw_one(port: int, path: str, body: dict, tally: Tally) -> None:
    """POST over a fresh connection; reads the chunked SSE body line by line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
        + data
    )
    status = await reader.readline()
    if b" 200 " not in status:
        tally.errors.append(status.decode().strip())
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers
    buf = b""
    while True:
        size_line = await reader.readline()
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            break
        buf += await reader.readexactly(size + 2)
        buf = buf[:-2]
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                tally.line(line[6:])
    writer.close()


async def _load(client_kind: str, port: int, endpoint: str, concurrency: int, max_tokens: int) -> Tally:
    tally = Tally()
    path = ENDPOINTS[endpoint]
    if client_kind == "raw":
        await asyncio.gather(*(_raw_one(port, path, _body(endpoint, max_tokens, i), tally) for i in range(concurrency)))
        return tally
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as client:
        await asyncio.gather(
            *(_httpx_one(client, path, _body(endpoint, max_tokens, i), tally) for i in range(concurrency))
        )
    return tally


# ---------------------------------------------------------------------- orchestration
def _cpu_s(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all threads), or of one of its threads, in seconds."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(tokenizer_dir: str, vocab_size: int, step_ms: float, profile_path: str | None) -> tuple:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_sse",
        "--serve",
        str(port),
        "--tokenizer",
        tokenizer_dir,
        "--vocab-size",
        str(vocab_size),
        "--step-ms",
        str(step_ms),
    ]
    if profile_path:
        cmd += ["--profile-out", profile_path]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the fake engine process needs no torch
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark server did not start") from None
            time.sleep(0.1)


def _stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_endpoint(
    ns: argparse.Namespace, tokenizer_dir: str, vocab_size: int, endpoint: str, profile_path: str | None = None
) -> dict:
    """One server, a warm-up request, then the measured load; the row of the table."""
    proc, port = _start_server(tokenizer_dir, vocab_size, ns.step_ms, profile_path)
    try:
        asyncio.run(_load(ns.client, port, endpoint, 1, 8))  # warm-up
        cpu0, main0 = _cpu_s(proc.pid), _cpu_s(proc.pid, proc.pid)
        t0 = time.perf_counter()
        tally = asyncio.run(_load(ns.client, port, endpoint, ns.concurrency, ns.max_tokens))
        wall = time.perf_counter() - t0
        cpu, main = _cpu_s(proc.pid) - cpu0, _cpu_s(proc.pid, proc.pid) - main0
    finally:
        _stop_server(proc)
    expected = ns.concurrency * ns.max_tokens
    if tally.errors or tally.tokens != expected:
        print(
            f"warning: {endpoint}: {len(tally.errors)} errors {tally.errors[:3]}, tokens {tally.tokens} != {expected}",
            file=sys.stderr,
        )
    return {
        "endpoint": endpoint,
        "client": ns.client,
        "concurrency": ns.concurrency,
        "max_tokens": ns.max_tokens,
        "events": tally.events,
        "tokens": tally.tokens,
        "errors": len(tally.errors),
        "wall_s": wall,
        "tokens_per_s": tally.tokens / wall,
        "server_cpu_s": cpu,
        "main_thread_cpu_s": main,
        "us_per_event": cpu / max(tally.events, 1) * 1e6,
        "us_per_token": cpu / max(tally.tokens, 1) * 1e6,
        "tokens_per_event": tally.tokens / max(tally.events, 1),
    }


def _top(profile_path: str, n: int = 20) -> str:
    out = io.StringIO()
    for part, title in ((".loop", "event loop (main thread)"), (".reader", "reader thread")):
        out.write(f"---- {title}\n")
        pstats.Stats(profile_path + part, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def _tokenizer_dir(tmp: str) -> tuple[str, int]:
    """A dummy checkpoint's tokenizer files (Llama-3-like byte BPE, chat template) and its vocab size."""
    from tinyvllm.models.dummy_tokenizer import write_tokenizer_files

    vocab_size = 32000
    write_tokenizer_files(Path(tmp), vocab_size, 4096)
    return tmp, vocab_size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", choices=[*ENDPOINTS, "both"], default="both")
    p.add_argument("--client", choices=["httpx", "raw"], default="httpx")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--step-ms", type=float, default=0.0, help="sleep per fake step (0: paced by the API side)")
    p.add_argument("--profile", action="store_true", help="also a cProfile run per endpoint (top 20)")
    p.add_argument(
        "--label", default=None, help="names the result file sse_<label>_cpu.json (default: paced<N>ms or unpaced)"
    )
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.serve:
        serve(ns.serve, ns.tokenizer, ns.vocab_size, ns.step_ms, ns.profile_out)
        return
    endpoints = list(ENDPOINTS) if ns.endpoint == "both" else [ns.endpoint]
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir, vocab_size = _tokenizer_dir(tmp)
        for endpoint in endpoints:
            rows.append(run_endpoint(ns, tokenizer_dir, vocab_size, endpoint))
            if ns.profile:
                path = os.path.join(tmp, f"{endpoint}.prof")
                run_endpoint(ns, tokenizer_dir, vocab_size, endpoint, path)
                profiles[endpoint] = _top(path)
                print(f"==== cProfile of the API process (per-thread CPU time), {endpoint}\n{profiles[endpoint]}")
    _print(rows)
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = ns.label or (f"paced{ns.step_ms:g}ms" if ns.step_ms else "unpaced")
    path = out / f"sse_{label}_cpu.json"
    path.write_text(
        json.dumps(
            {
                "args": {k: v for k, v in vars(ns).items() if not k.startswith(("serve", "prof"))},
                "cpus": os.cpu_count(),
                "rows": rows,
                "profiles": profiles,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")


def _print(rows: list[dict]) -> None:
    cols = [
        ("endpoint", "endpoint", "{}"),
        ("client", "client", "{}"),
        ("events", "events", "{}"),
        ("tokens", "tokens", "{}"),
        ("tok/s", "tokens_per_s", "{:.0f}"),
        ("wall s", "wall_s", "{:.2f}"),
        ("API cpu s", "server_cpu_s", "{:.2f}"),
        ("loop cpu s", "main_thread_cpu_s", "{:.2f}"),
        ("us/event", "us_per_event", "{:.1f}"),
        ("us/token", "us_per_token", "{:.1f}"),
        ("tok/event", "tokens_per_event", "{:.2f}"),
    ]
    table = [[h for h, _, _ in cols]] + [[f.format(r[k]) for _, k, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


if __name__ == "__main__":
    main()
