"""Hostile and careless clients against a live `tinyvllm serve` on loopback: what each gets, how fast,
and whether the server is whole afterwards.

Each case in `CASES` plays one client (oversized bodies and fields, unicode edge cases, deep JSON,
slowloris headers and bodies, a reader that never reads, bursts, disconnects at every point of a
stream) and returns a `CaseResult` (the status codes it saw, the time to the answer, notes); it raises
AssertionError when the server misbehaves. After every case `check_whole` asserts the server answers
a greedy request exactly as it did before the suite and every KV block is free again.
`shutdown_case` sends SIGTERM under load to a server of its own. tests/server/test_adversarial.py runs
the same cases in CI.

    python -m benchmarks.bench_adversarial [--model tinyvllm/models/demo]

prints a table and writes benchmarks/results/adversarial_cpu.json (per case: status codes, seconds
to answer; /health latency while the largest requests are processed; RSS of the API and engine
processes before and after the suite). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "adversarial_cpu.json"
DEMO = REPO / "tinyvllm" / "models" / "demo"
MODEL = "m"

# Small limits and timeouts, so that every case runs in seconds.
BODY_LIMIT = 1 << 20
HEADER_TIMEOUT_S = 3.0  # generous: the burst case's 64 client threads share one GIL
BODY_TIMEOUT_S = 3.0
SERVE_FLAGS = [
    "--device", "cpu", "--max-model-len", "512", "--num-gpu-blocks-override", "128",
    "--max-num-seqs", "16", "--served-model-name", MODEL, "--uvicorn-log-level", "warning",
    "--max-request-body-bytes", str(BODY_LIMIT), "--request-header-timeout", str(HEADER_TIMEOUT_S),
    "--request-body-timeout", str(BODY_TIMEOUT_S), "--keep-alive-timeout", "5",
]  # fmt: skip


# ---------------------------------------------------------------------- the server process
@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_pids(self) -> list[int]:
        out = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                    out.append(int(child))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log: Path, *extra: str) -> Server:
    """`tinyvllm serve MODEL` with SERVE_FLAGS, its output to `log`; returns once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", model, "--port", str(port), *SERVE_FLAGS, *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, port, log)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("the server did not start")
        time.sleep(0.2)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)
    return out


# ---------------------------------------------------------------------- raw HTTP
def connect(port: int, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def request_bytes(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked) from `s`: (status, headers, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response ({buf[:200]!r})")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    status = int(status_line.split()[1])
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("closed mid-body")
            rest += chunk
        return status, headers, rest[:n]
    body = b""
    while True:  # chunked
        while b"\r\n" not in rest:
            rest += s.recv(65536)
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        while len(rest) < size + 2:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("closed mid-chunk")
            rest += chunk
        body, rest = body + rest[:size], rest[size + 2 :]
        if size == 0:
            return status, headers, body


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes `s` within `timeout` seconds (what it sent meanwhile is read and dropped)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# ---------------------------------------------------------------------- results and checks
@dataclass
class CaseResult:
    name: str
    statuses: list[int | str] = field(default_factory=list)
    seconds: float = 0.0  # time to the answer (the slowest, when several)
    notes: dict = field(default_factory=dict)


def error_of(resp: httpx.Response, status: int, param: str | None = "*") -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    if param != "*":
        assert err["param"] == param, err
    return err


GREEDY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def greedy_text(url: str) -> str:
    resp = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
    assert resp.status_code == 200, resp.text[:300]
    return resp.json()["choices"][0]["text"]


def warm_up(url: str) -> None:
    """Legitimate work first (the engine's buffers and caches reach their working size): a long prompt,
    a batch of streams, logprobs."""
    long = {"model": MODEL, "prompt": [17] * 480, "max_tokens": 8, "n": 4, "logprobs": 5}
    assert httpx.post(url + "/v1/completions", json=long, timeout=120).status_code == 200
    stream = {"model": MODEL, "prompt": "hi", "max_tokens": 16, "n": 16, "stream": True}
    assert httpx.post(url + "/v1/completions", json=stream, timeout=120).text.rstrip().endswith("[DONE]")


def check_whole(url: str, expected_text: str, timeout: float = 20.0) -> None:
    """The server answers /health and a greedy request as before, and no KV block is held."""
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert greedy_text(url) == expected_text
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (
            m["tinyvllm:kv_cache_free_blocks"] == m["tinyvllm:kv_cache_blocks"]
            and m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
        ):
            return
        assert time.monotonic() < deadline, f"KV blocks still held: {m}"
        time.sleep(0.1)


class HealthProbe:
    """Polls /health on a connection of its own while a case runs; `worst` is the slowest answer (s)."""

    def __init__(self, url: str, period: float = 0.02) -> None:
        self.url, self.period, self.times = url, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                assert c.get(self.url + "/health").status_code == 200
                self.times.append(time.perf_counter() - t0)
                time.sleep(self.period)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._thread.join()

    @property
    def worst(self) -> float:
        return max(self.times)


def timed(fn: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    resp = fn()
    return resp, time.perf_counter() - t0


# ---------------------------------------------------------------------- the cases
def case_body_too_large_declared(srv: Server) -> CaseResult:
    """Content-Length over the limit: 413 before any byte of the body is sent."""
    with connect(srv.port) as s:
        head = request_bytes("/v1/completions", b"")[:-4].replace(b"Content-Length: 0", b"Content-Length: 50000000")
        t0 = time.perf_counter()
        s.sendall(head + b"\r\n\r\n")
        status, headers, body = read_response(s)
        dt = time.perf_counter() - t0
    assert status == 413 and headers.get("connection") == "close", (status, headers)
    assert json.loads(body)["error"]["code"] == 413
    return CaseResult("body over the limit, declared (50 MB Content-Length)", [status], dt)


def case_body_too_large_chunked(srv: Server) -> CaseResult:
    """A chunked body with no length: cut with 413 once it passes the limit, long before it ends."""
    with connect(srv.port) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # `sent` then tracks what the server read
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        chunk = b"x" * 65536
        sent, t0 = 0, time.perf_counter()
        try:
            while sent < 50 * BODY_LIMIT:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                s.setblocking(False)
                try:
                    if s.recv(1, socket.MSG_PEEK):
                        break
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(10)
        status, _, body = read_response(s)
        dt = time.perf_counter() - t0
        buffered = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + _max_tcp_receive_buffer()
    assert status == 413 and json.loads(body)["error"]["code"] == 413, (status, body)
    # What the client pushed = what the server read + what the two sockets' buffers absorbed.
    assert sent < BODY_LIMIT + buffered + len(chunk), f"the server read up to {sent - buffered} bytes before refusing"
    return CaseResult("body over the limit, chunked", [status], dt, {"bytes_sent_before_413": sent})


def _max_tcp_receive_buffer() -> int:
    """The most a TCP receive buffer can grow to on this host (Linux's tcp_rmem maximum; 6 MiB elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_rmem") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 6 << 20


def case_largest_requests(srv: Server) -> CaseResult:
    """Bodies just under the limit (a long prompt string, a long list of token ids, a long chat message):
    each is a 400 naming the field, and /health stays fast meanwhile."""
    n_chars = BODY_LIMIT - 100
    bodies = {
        "prompt": {"model": MODEL, "prompt": "ab " * (n_chars // 3)},
        "prompt ids": {"model": MODEL, "prompt": [17] * (n_chars // 3)},
        "messages": {"model": MODEL, "messages": [{"role": "user", "content": "héllo " * (n_chars // 8)}]},
        "tokenize": {"model": MODEL, "prompt": "word " * (n_chars // 5)},
    }
    paths = {"tokenize": "/tokenize"}
    # encoded as httpx would, before the probe starts (the client's own GIL must not slow the probe)
    encoded = {n: json.dumps(b, separators=(",", ":"), ensure_ascii=False).encode() for n, b in bodies.items()}
    statuses, times = [], []
    with HealthProbe(srv.url) as probe, httpx.Client(timeout=60) as c:
        for name, body in bodies.items():
            path = paths.get(name, "/v1/chat/completions" if "messages" in body else "/v1/completions")
            resp, dt = timed(lambda: c.post(srv.url + path, content=encoded[name]))
            error_of(resp, 400, "messages" if "messages" in body else "prompt")
            statuses.append(resp.status_code)
            times.append(dt)
    return CaseResult(
        "largest bodies (1 MiB prompt, ids, chat, tokenize)",
        statuses,
        max(times),
        {"health_worst_s": round(probe.worst, 4), "health_polls": len(probe.times)},
    )


def case_max_size_prompt_generates(srv: Server) -> CaseResult:
    """A prompt as long as max_model_len allows is tokenized and served; /health stays fast."""
    text = "Once upon a time there was a little fox. " * 300
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"][:500]
    prompt = httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    with HealthProbe(srv.url) as probe:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "add_special_tokens": False}
        resp, dt = timed(lambda: httpx.post(srv.url + "/v1/completions", json=body, timeout=60))
    assert resp.status_code == 200, resp.text[:300]
    return CaseResult("longest prompt that fits, served", [200], dt, {"health_worst_s": round(probe.worst, 4)})


CHAT = [{"role": "user", "content": "x"}]
BIG = "d" * 300_000
FIELD_CASES = [
    ("n", {"prompt": "x", "n": 10**6}, "n"),
    ("max_tokens", {"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ("max_tokens", {"prompt": "x", "max_tokens": 2**64}, "max_tokens"),
    ("stop count", {"prompt": "x", "stop": ["a"] * 1000}, "stop"),
    ("stop length", {"prompt": "x", "stop": ["a" * 10000]}, "stop"),
    ("logprobs", {"prompt": "x", "logprobs": 10**6}, "logprobs"),
    ("top_logprobs", {"messages": CHAT, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("tools", {"messages": CHAT, "tools": [{"type": "function", "function": {"description": BIG}}]}, "tools"),
    ("prompt chars", {"prompt": "a" * 600_000}, "prompt"),
    ("deep JSON (40)", {"prompt": "x", "metadata": json.loads("[" * 40 + "]" * 40)}, "metadata" + ".0" * 31),
]  # fmt: skip


def case_oversized_fields(srv: Server) -> CaseResult:
    statuses, worst = [], 0.0
    with httpx.Client(timeout=60) as c:
        for _, body, param in FIELD_CASES:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            resp, dt = timed(lambda: c.post(srv.url + path, json={"model": MODEL, **body}))
            error_of(resp, 400, param)
            statuses.append(resp.status_code)
            worst = max(worst, dt)
    return CaseResult("oversized fields (n, max_tokens, stop, logprobs, tools, chars, depth)", statuses, worst)


def case_deep_json(srv: Server) -> CaseResult:
    """100,000 levels of nesting: a 400, no RecursionError."""
    body = b'{"prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    resp, dt = timed(lambda: httpx.post(srv.url + "/v1/completions", content=body, timeout=60))
    error_of(resp, 400)
    return CaseResult("deep JSON (100,000 levels)", [resp.status_code], dt)


SURROGATE_CASES = [
    ("/v1/completions", b'{"prompt": "\\ud800x"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages.0.content.0.text"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
]  # fmt: skip


def case_lone_surrogates(srv: Server) -> CaseResult:
    """Lone surrogates (and bytes that are not UTF-8): 400 naming the field, on one keep-alive connection
    that then serves a normal request."""
    statuses, worst = [], 0.0
    with connect(srv.port) as s:
        for path, body, param in SURROGATE_CASES:
            t0 = time.perf_counter()
            s.sendall(request_bytes(path, body))
            status, headers, raw = read_response(s)
            worst = max(worst, time.perf_counter() - t0)
            err = json.loads(raw)["error"]
            assert status == 400 and err["param"] == param, (path, body, status, err)
            assert headers.get("connection") != "close", headers
            statuses.append(status)
        s.sendall(request_bytes("/v1/completions", json.dumps({**GREEDY, "max_tokens": 2}).encode()))
        status, _, raw = read_response(s)
        assert status == 200, raw[:300]
    return CaseResult("lone surrogates / invalid UTF-8 (same keep-alive connection)", statuses, worst)


UNICODE_TEXTS = {
    "NUL": "a\x00b\x00",
    "RTL": "\u202eevil\u202c \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
    "combining": "e\u0301" + "\u0301" * 200 + "Z\u0351\u0352\u0353",
    "emoji": "👩‍👩‍👧‍👦 🏳️‍🌈 😀" * 5,
    "astral": "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010ffff \ufffe",
}


def case_unicode_round_trip(srv: Server) -> CaseResult:
    """Valid but unusual text: tokenize then detokenize gives it back (byte-level BPE is lossless), and
    a completion on it streams to [DONE]."""
    statuses, worst = [], 0.0
    with httpx.Client(timeout=60) as c:
        for text in UNICODE_TEXTS.values():
            t0 = time.perf_counter()
            ids = c.post(srv.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
            back = c.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
            assert back == text, (text, back)
            body = {"model": MODEL, "prompt": text, "max_tokens": 3, "stream": True}
            resp = c.post(srv.url + "/v1/completions", json=body)
            worst = max(worst, time.perf_counter() - t0)
            assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]
            assert '"error"' not in resp.text
            statuses.append(resp.status_code)
    return CaseResult("unicode: NUL, RTL, combining marks, emoji, astral", statuses, worst)


def case_emoji_split_across_tokens(srv: Server) -> CaseResult:
    """An emoji whose UTF-8 bytes span several tokens: each token alone decodes to U+FFFD, all of them
    to the emoji; a prompt of the first half only is served."""
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "😀", "add_special_tokens": False}, timeout=30).json()
    ids = ids["tokens"]
    assert len(ids) > 1, f"the emoji is one token in this vocabulary: {ids}"
    whole = httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    half = httpx.post(srv.url + "/detokenize", json={"tokens": ids[:1]}, timeout=30).json()["prompt"]
    assert whole == "😀" and "\ufffd" in half, (whole, half)
    body = {"model": MODEL, "prompt": ids[:1], "max_tokens": 3, "echo": True}
    resp = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text[:300]
    return CaseResult("4-byte emoji split across tokens", [200], 0.0, {"tokens": len(ids)})


def case_slowloris_headers(srv: Server, connections: int = 30) -> CaseResult:
    """Connections that send a header byte now and then: closed after the header timeout; /health
    answers meanwhile."""
    socks = [connect(srv.port) for _ in range(connections)]
    t0 = time.perf_counter()
    with HealthProbe(srv.url) as probe:
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(HEADER_TIMEOUT_S / 2)
        for s in socks:
            with contextlib.suppress(OSError):
                s.sendall(b"X-Slow: 1\r\n")
        closed = [closed_by_peer(s, HEADER_TIMEOUT_S * 3) for s in socks]
    dt = time.perf_counter() - t0
    for s in socks:
        s.close()
    assert all(closed), f"{closed.count(False)} slow connections still open"
    return CaseResult(f"slowloris headers ({connections} connections)", ["closed"], dt,
                      {"health_worst_s": round(probe.worst, 4)})  # fmt: skip


def case_idle_connections(srv: Server, connections: int = 30) -> CaseResult:
    """Connections that send nothing at all: closed after the header timeout."""
    socks = [connect(srv.port) for _ in range(connections)]
    t0 = time.perf_counter()
    closed = [closed_by_peer(s, HEADER_TIMEOUT_S * 3) for s in socks]
    dt = time.perf_counter() - t0
    for s in socks:
        s.close()
    assert all(closed), f"{closed.count(False)} idle connections still open"
    return CaseResult(f"silent connections ({connections})", ["closed"], dt)


def case_slow_body(srv: Server) -> CaseResult:
    """Headers promise 1,000 bytes, a few arrive: 408 after the body timeout, connection closed."""
    with connect(srv.port) as s:
        s.sendall(request_bytes("/v1/completions", b"")[:-4].replace(b"Content-Length: 0", b"Content-Length: 1000")
                  + b"\r\n\r\n" + b'{"prompt": "')  # fmt: skip
        t0 = time.perf_counter()
        status, headers, body = read_response(s)
        dt = time.perf_counter() - t0
        assert status == 408 and headers.get("connection") == "close", (status, headers, body)
        assert closed_by_peer(s, 5)
    assert dt >= BODY_TIMEOUT_S * 0.9
    return CaseResult("slow body (stalls after 12 bytes)", [status], dt)


def case_reader_never_reads(srv: Server) -> CaseResult:
    """A client opens a long stream and never reads it: the request still finishes (its KV blocks are
    freed) and other clients are served."""
    with connect(srv.port) as s:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True, "n": 2}
        s.sendall(request_bytes("/v1/completions", json.dumps(body).encode()))
        t0 = time.perf_counter()
        with HealthProbe(srv.url) as probe:
            deadline = time.monotonic() + 60
            while metrics(srv.url)["vllm:generation_tokens_total"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            greedy_text(srv.url)
            while metrics(srv.url)["vllm:num_requests_running"] > 0:
                assert time.monotonic() < deadline, "the unread request never finished"
                time.sleep(0.1)
        dt = time.perf_counter() - t0
    return CaseResult("reader that never reads (2 x 60 tokens)", ["finished"], dt,
                      {"health_worst_s": round(probe.worst, 4)})  # fmt: skip


def case_burst(srv: Server, connections: int = 100) -> CaseResult:
    """`connections` clients at once, half /health, half short completions: every one answered."""

    def one(i: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        with httpx.Client(timeout=120) as c:
            if i % 2:
                r = c.get(srv.url + "/health")
            else:
                r = c.post(srv.url + "/v1/completions", json={**GREEDY, "max_tokens": 2, "temperature": 1.0})
        return r.status_code, time.perf_counter() - t0

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(connections)))
    statuses = sorted({s for s, _ in results})
    assert set(statuses) <= {200, 503}, statuses
    return CaseResult(f"burst of {connections} connections", statuses, max(t for _, t in results),
                      {"ok": sum(s == 200 for s, _ in results)})  # fmt: skip


def case_disconnects(srv: Server) -> CaseResult:
    """A client that goes away at every point: mid-headers, mid-body, before the first event, after
    it, mid-stream, during a non-streamed request."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True}).encode()
    full = request_bytes("/v1/completions", body)
    head_len = full.index(b"\r\n\r\n") + 4
    plain = request_bytes("/v1/completions", body.replace(b'"stream": true', b'"stream": false'))
    points = {
        "mid-headers": (full[: head_len // 2], 0),
        "mid-body": (full[: head_len + len(body) // 2], 0),
        "request sent": (full, 0),
        "after the first event": (full, 1),
        "mid-stream": (full, 20),
        "non-streamed": (plain, 0),
    }
    for name, (data, events) in points.items():
        s = connect(srv.port)
        s.sendall(data)
        got = b""
        while got.count(b"data: ") < events:
            got += s.recv(65536)
        if name in ("request sent", "non-streamed"):
            time.sleep(0.3)  # the request has reached the engine
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        s.close()
    return CaseResult("disconnects at every point of a stream (6)", ["aborted"], 0.0)


CASES: list[Callable[[Server], CaseResult]] = [
    case_body_too_large_declared,
    case_body_too_large_chunked,
    case_largest_requests,
    case_max_size_prompt_generates,
    case_oversized_fields,
    case_deep_json,
    case_lone_surrogates,
    case_unicode_round_trip,
    case_emoji_split_across_tokens,
    case_slowloris_headers,
    case_idle_connections,
    case_slow_body,
    case_reader_never_reads,
    case_burst,
    case_disconnects,
]


# ---------------------------------------------------------------------- SIGTERM under load
def read_stream(url: str, body: dict, out: list, started: threading.Event | None = None) -> None:
    """Stream a completion; append its `data:` lines (or the exception) to `out`."""
    try:
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    out.append(line)
                    if started is not None:
                        started.set()
    except Exception as e:
        out.append(e)


def shutdown_case(
    model: str, log: Path, streams: int = 12, grace_s: float = 3.0, second_signal: bool = False
) -> CaseResult:
    """SIGTERM while `streams` long streams and one short one run: a new request gets 503 (the listener
    stays open), the short stream ends normally, the long ones end with an error event and [DONE]
    after `grace_s`, the log has one summary line and no traceback, and the exit status is 0. With
    `second_signal`, a second SIGTERM right after the first ends everything at once."""
    srv = start_server(model, log, "--shutdown-timeout", str(grace_s))
    try:
        long_body = {"model": MODEL, "prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
        outs: list[list] = [[] for _ in range(streams)]
        firsts = [threading.Event() for _ in range(streams)]
        threads = [
            threading.Thread(target=read_stream, args=(srv.url, long_body, outs[i], firsts[i])) for i in range(streams)
        ]
        for t in threads:
            t.start()
        for e in firsts:
            assert e.wait(60), "a stream did not start"
        short_out: list = []
        short_first = threading.Event()
        short_body = {**long_body, "max_tokens": 5}  # finishes within the grace period
        short = threading.Thread(target=read_stream, args=(srv.url, short_body, short_out, short_first))
        short.start()
        assert short_first.wait(60), "the short stream did not start"
        t0 = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(0.2)
            srv.proc.send_signal(signal.SIGTERM)
        else:
            time.sleep(0.3)
            resp = httpx.post(srv.url + "/v1/completions", json=GREEDY, timeout=10)
            error_of(resp, 503)
        code = srv.proc.wait(60)
        exit_s = time.perf_counter() - t0
        for t in [*threads, short]:
            t.join(30)
        assert code == 0, code
        if not second_signal:
            assert short_out[-1] == "data: [DONE]" and '"finish_reason":"length"' in short_out[-2], short_out[-3:]
        ended = 0
        for out in outs:
            assert out and out[-1] == "data: [DONE]", out[-3:]
            if '"error"' in out[-2]:
                err = json.loads(out[-2][6:])["error"]
                assert err["code"] == 503 and err["type"] == "ServiceUnavailableError", err
                ended += 1
        assert ended == streams, f"{streams - ended} streams finished before the deadline"
        if not second_signal:
            assert grace_s <= exit_s < grace_s + 8, exit_s
        text = log.read_text()
        assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
        assert text.count("shutdown: ") == 1, text[-3000:]
        summary = next(line for line in text.splitlines() if "shutdown: " in line)
        name = "second SIGTERM" if second_signal else f"SIGTERM under load ({streams} streams)"
        statuses = ([] if second_signal else [503]) + ["error+[DONE]", f"exit {code}"]
        return CaseResult(name, statuses, exit_s, {"summary": summary.split("shutdown: ")[1]})
    finally:
        srv.stop()


# ---------------------------------------------------------------------- the table
def run_suite(model: str, workdir: Path, only: str = "") -> dict:
    srv = start_server(model, workdir / "serve.log")
    results = []
    try:
        expected = greedy_text(srv.url)
        warm_up(srv.url)
        check_whole(srv.url, expected)
        engine = srv.engine_pids()
        rss_before = {"api_mb": rss_mb(srv.proc.pid), "engine_mb": sum(rss_mb(p) for p in engine)}
        for case in [c for c in CASES if only in c.__name__]:
            result = case(srv)
            check_whole(srv.url, expected)
            results.append(result)
            print(f"  {result.name}: {result.statuses} in {result.seconds:.3f} s {result.notes or ''}", flush=True)
        rss_after = {"api_mb": rss_mb(srv.proc.pid), "engine_mb": sum(rss_mb(p) for p in engine)}
    finally:
        srv.stop()
    for second in (False, True) if only in "shutdown_case" else ():
        result = shutdown_case(model, workdir / f"shutdown{int(second)}.log", second_signal=second)
        results.append(result)
        print(f"  {result.name}: {result.statuses} in {result.seconds:.3f} s {result.notes}", flush=True)
    return {"cases": [asdict(r) for r in results], "rss_before": rss_before, "rss_after": rss_after}


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEMO))
    p.add_argument("--only", default="", help="run the cases whose function name contains this")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_suite(ns.model, Path(tmp), ns.only)
    out["flags"] = SERVE_FLAGS
    print("\n| case | status | seconds | notes |\n|---|---|---|---|")
    for c in out["cases"]:
        notes = ", ".join(f"{k} {v}" for k, v in c["notes"].items())
        print(f"| {c['name']} | {', '.join(map(str, c['statuses']))} | {c['seconds']:.3f} | {notes} |")
    for k in ("api_mb", "engine_mb"):
        before, after = out["rss_before"][k], out["rss_after"][k]
        print(f"RSS {k[:-3]}: {before:.0f} MB -> {after:.0f} MB ({100 * (after - before) / before:+.1f} %)")
    if not ns.only:
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
