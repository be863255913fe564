"""Prometheus metrics of one server, with vLLM's metric names (so existing dashboards work).

Each app gets its own `CollectorRegistry` (never the global default one), so tests can build several.
Gauges and engine counters are read at scrape time from the stats snapshot that the engine core sends
after each step; the latency histograms are fed from the step's Deltas by `LatencyRecorder` (a
`StatsListener`, called on the thread that receives the core's messages, in the API process).

  vllm:num_requests_running / vllm:num_requests_waiting      gauges
  vllm:kv_cache_usage_perc                                   gauge, 0..1 (blocks held by requests)
  tinyvllm:kv_cache_blocks / tinyvllm:kv_cache_free_blocks   gauges (free includes reusable cached blocks)
  vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   counters, in tokens
  vllm:num_preemptions_total                                 counter
  vllm:prompt_tokens_total / vllm:generation_tokens_total    counters
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds
  vllm:request_success_total{finished_reason}                counter
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tinyvllm.engine.messages import CompletionDelta, RequestDelta

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class EngineStatsCollector(Collector):
    """Gauges and counters read from `stats()` (the engine's `get_metrics()` snapshot) at scrape time."""

    _GAUGES = (
        ("vllm:num_requests_running", "num_requests_running", "Requests running on the engine."),
        ("vllm:num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
        ("vllm:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks held (0..1)."),
        ("tinyvllm:kv_cache_blocks", "num_kv_blocks", "KV-cache blocks in the pool."),
        ("tinyvllm:kv_cache_free_blocks", "num_free_kv_blocks", "KV-cache blocks free or reusable."),
    )
    _COUNTERS = (
        ("vllm:prefix_cache_queries", "prefix_cache_queried_tokens", "Prompt tokens looked up."),
        ("vllm:prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens found in the cache."),
        ("vllm:num_preemptions", "num_preemptions", "Preemptions (recomputations)."),
        ("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens prefilled."),
        ("vllm:generation_tokens", "generation_tokens", "Tokens generated."),
    )

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, key, doc in self._GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(stats.get(key, 0)))
            yield g
        for name, key, doc in self._COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], float(stats.get(key, 0)))
            yield c


class LatencyRecorder:
    """Histograms of TTFT, inter-token and end-to-end latency, fed with each step's Deltas.

    TTFT and end-to-end latency count from the request's arrival at the server; the inter-token
    latency is observed once per new token of each completion, as the gap since its previous one.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", labels, registry=registry, buckets=_ITL_BUCKETS
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._model = model_name
        self._last: dict[tuple[str, int], float] = {}  # (request, index) -> time of its latest token

    def on_step(self, items: Sequence[tuple[Any, RequestDelta]], now: float) -> None:
        """One step's (stream, RequestDelta) pairs; a stream's `arrival_time` is its request's arrival."""
        last_seen = self._last
        gaps: dict[float, int] = {}  # inter-token gap -> tokens (a step's gaps are mostly one value)
        for stream, delta in items:
            rid, completions = delta.request_id, delta.completions
            for c in completions:
                num = len(c.token_ids)
                if not num:
                    continue
                index = c.index
                key = (rid, index)
                last = last_seen.get(key)
                if last is None:
                    if index == 0:
                        self.ttft.observe(max(0.0, now - stream.arrival_time))
                else:
                    gap = (now - last) / num
                    gaps[gap] = gaps.get(gap, 0) + num
                last_seen[key] = now
            if delta.finished:
                self._finish(stream, rid, completions, now)
        for gap, count in gaps.items():
            observe_many(self.itl, gap, count)

    def on_abort(self, request_ids: Sequence[str]) -> None:
        dropped = set(request_ids)
        for key in [k for k in self._last if k[0] in dropped]:
            del self._last[key]
        for _ in request_ids:
            self.success.labels(self._model, "abort").inc()

    def _finish(self, stream: Any, request_id: str, completions: Sequence[CompletionDelta], now: float) -> None:
        for c in completions:
            self._last.pop((request_id, c.index), None)
        self.e2e.observe(max(0.0, now - stream.arrival_time))
        reason = completions[0].finish_reason if completions else "error"
        self.success.labels(self._model, reason or "error").inc()


def observe_many(histogram: Any, amount: float, count: int) -> None:
    """`count` observations of `amount` into a prometheus_client Histogram (child) in one update of
    its sum and bucket (its `_sum`, `_upper_bounds`, `_buckets`); `count` observe() calls where those
    internals are missing."""
    total = getattr(histogram, "_sum", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    if count == 1 or total is None or bounds is None or buckets is None:
        for _ in range(count):
            histogram.observe(amount)
        return
    total.inc(amount * count)
    for bucket, bound in zip(buckets, bounds):
        if amount <= bound:
            bucket.inc(count)
            return


def make_registry(stats: Callable[[], dict[str, float]], model_name: str) -> tuple[CollectorRegistry, LatencyRecorder]:
    """A fresh registry with the engine collector and the latency histograms registered."""
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(stats, model_name))
    return registry, LatencyRecorder(registry, model_name)
