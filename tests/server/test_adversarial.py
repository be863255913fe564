"""The standing adversarial suite: hostile and careless clients against a live `tinyvllm serve` (the demo
model, a small KV cache) on loopback. The cases live in benchmarks/bench_adversarial.py, which also
measures them; here each must pass, and after each the server must answer a greedy request exactly as
before the suite and hold no KV block. Then SIGTERM under load, and a second SIGTERM, on servers of
their own."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from benchmarks import bench_adversarial as adv


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    srv = adv.start_server(str(adv.DEMO), tmp_path_factory.mktemp("adversarial") / "serve.log")
    try:
        yield srv, adv.greedy_text(srv.url)
    finally:
        srv.stop()


@pytest.mark.parametrize("case", adv.CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_case_then_the_server_is_whole(live, case):
    srv, expected = live
    result = case(srv)
    adv.check_whole(srv.url, expected)
    if "health_worst_s" in result.notes:
        # the requirement: /health answers within 100 ms while the largest requests are processed
        assert result.notes["health_worst_s"] < 0.1, result


def test_api_and_engine_memory_after_the_suite(live):
    """RSS of both processes, warmed up by legitimate work, before and after a round of the largest
    bodies and the cut chunked one: within 5 %."""
    srv, expected = live
    adv.warm_up(srv.url)
    engine = srv.engine_pids()
    before = adv.rss_mb(srv.proc.pid), sum(adv.rss_mb(p) for p in engine)
    for case in (adv.case_largest_requests, adv.case_body_too_large_chunked, adv.case_largest_requests):
        case(srv)
    adv.check_whole(srv.url, expected)
    after = adv.rss_mb(srv.proc.pid), sum(adv.rss_mb(p) for p in engine)
    assert after[0] < before[0] * 1.05 and after[1] < before[1] * 1.05, (before, after)


@pytest.mark.parametrize("second_signal", [False, True], ids=["sigterm", "second_sigterm"])
def test_sigterm_under_load(tmp_path, second_signal):
    adv.shutdown_case(str(adv.DEMO), tmp_path / "serve.log", second_signal=second_signal)
