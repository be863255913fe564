"""`tinyvllm serve` as a process: graceful shutdown on SIGTERM/SIGINT (in-flight stream finishes, exit 0,
no engine process left behind, also when the server is killed); a failed start is exit status 1; the
engine and the CLI work without the server extra."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Child processes of `pid`, multiprocessing's resource tracker left out."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(int(child))
    return out


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return True  # exited; its parent reaps it
        time.sleep(0.05)
    return False


def _start_serve(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    """`tinyvllm serve` in a session of its own (a terminal's Ctrl-C reaches the whole group); waits
    until /health answers."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "tinyvllm.entrypoints.cli",
        "serve",
        str(model_dir),
        "--device",
        "cpu",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--num-gpu-blocks-override",
        "256",
        "--served-model-name",
        "tiny",
        "--shutdown-timeout",
        "60",
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.1)


@pytest.mark.parametrize(
    "sig, mode", [(signal.SIGTERM, "process"), (signal.SIGINT, "process"), (signal.SIGTERM, "thread")]
)
def test_signal_lets_the_in_flight_stream_finish_then_exits_0(model_dir, sig, mode):
    """SIGTERM to the server process, or SIGINT to its whole process group (Ctrl-C in a terminal):
    the stream in flight finishes, the engine process stops, the server exits 0."""
    proc, url = _start_serve(model_dir, *(["--engine-in-thread"] if mode == "thread" else []))
    try:
        engines = _children(proc.pid)
        assert len(engines) == (1 if mode == "process" else 0), engines
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            if sig == signal.SIGINT:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
        assert all(_gone(pid, timeout=10) for pid in engines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_engine_process_does_not_outlive_a_killed_server(model_dir):
    proc, _ = _start_serve(model_dir)
    try:
        (engine,) = _children(proc.pid)
        proc.kill()
        proc.wait()
        assert _gone(engine, timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_that_cannot_start_is_exit_status_1(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinyvllm.entrypoints.cli",
            "serve",
            str(tmp_path / "nothing"),
            "--device",
            "cpu",
            "--port",
            str(_free_port()),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "the engine could not start" in out.stderr, out.stderr[-2000:]


def test_engine_and_cli_need_no_server_extra(tmp_path):
    """With fastapi, uvicorn and prometheus_client unimportable: LLM works, `serve` says what to install."""
    script = textwrap.dedent("""
        import sys
        for name in ("fastapi", "uvicorn", "prometheus_client", "starlette"):
            sys.modules[name] = None  # import fails
        from tinyvllm import LLM, SamplingParams
        from tinyvllm.entrypoints.cli import build_parser, extra_subcommands, main
        ns = build_parser(extra_subcommands()).parse_args(["serve", "dummy:tiny", "--port", "1"])
        assert ns.model_tag == "dummy:tiny" and ns.port == 1
        ns = build_parser(extra_subcommands()).parse_args(["bench", "serve", "--request-rate", "1", "inf"])
        assert ns.request_rate == [1.0, float("inf")]
        assert main(["serve", "dummy:tiny"]) == 1
        print("OK")
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
    assert "pip install 'tinyvllm[server]'" in out.stderr
