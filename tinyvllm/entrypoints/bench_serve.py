"""`tinyvllm bench serve`: the `serving` workload of docs/workloads.md against a running OpenAI-compatible
server (tinyvllm serve or vllm serve).

Requests are the `throughput` set (random.seed(0); prompts of randint(0, 10000) token ids, randint(100,
1024) long; then max_tokens randint(100, 1024); temperature 0.6, ignore_eos), sent as token-id prompts
to /v1/completions with stream=True (temperature 0.6 and top_p 1.0 sent explicitly, so that a server's
generation-config defaults do not change the sampling), arriving as a Poisson process at each
--request-rate (inf: all at once, as vLLM's bench does), after one warm-up request. Per rate it reports
TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99, in ms), request and token throughput,
failures, and for a finite rate the time of the last arrival and output tokens / that time (an upper
bound on the output throughput such a run can measure); prints a table and writes JSON.
The client is aiohttp (as vLLM's benchmark_serving): its per-event cost is a fraction of httpx's, which
caps a single client process near 17k streamed tokens/s on a development CPU. No torch, no openai client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HELP = "the `serving` workload (Poisson arrivals) against a running server"


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests per second, one run per value (inf: all at once)",
    )
    p.add_argument("--num-prompts", type=int, default=256, help="the first N requests of the set")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times")
    p.add_argument("--workload", default="throughput", choices=["throughput"])
    p.add_argument("--input-len", type=_range, default=(100, 1024), metavar="MIN:MAX")
    p.add_argument("--output-len", type=_range, default=(100, 1024), metavar="MIN:MAX")
    p.add_argument("--max-token-id", type=int, default=10000, help="prompt ids are randint(0, this)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sent with every request (default 1.0: the throughput set samples at temperature 0.6 "
        "without top-p, as the offline bench does; without it a server applies the model's "
        "generation_config.json defaults, top_p 0.9 for Llama 3.x Instruct)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--result-dir", default="benchmarks/results")
    p.add_argument("--result-file", default=None, help="default: serving_<label>_<time>.json")
    p.add_argument("--label", default=None, help="names the result file (default: the model)")
    p.add_argument("--save-detailed", action="store_true", help="keep per-request timings in the JSON")


def throughput_workload(
    num_prompts: int = 256,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    max_token_id: int = 10000,
) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) of docs/workloads.md's `throughput` set, drawn in its order (all prompts,
    then all max_tokens, for max(256, num_prompts) requests), the first `num_prompts` of them."""
    rng = random.Random(0)
    count = max(256, num_prompts)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(*input_len))] for _ in range(count)]
    max_tokens = [rng.randint(*output_len) for _ in range(count)]
    return list(zip(prompts, max_tokens))[:num_prompts]


@dataclass
class RequestResult:
    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # gaps between chunks after the first
    latency: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


async def send_one(client: Any, url: str, body: dict, prompt_len: int) -> RequestResult:
    """One streamed completion; timings from the send to each SSE chunk that carries choices."""
    result = RequestResult(prompt_len)
    start = last = time.perf_counter()
    finished = False
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in data:
                    result.error = str(data["error"].get("message"))
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices"):
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    finished = finished or data["choices"][0].get("finish_reason") is not None
        result.latency = time.perf_counter() - start
        if result.error is None and not finished:
            result.error = "the stream ended without a finish_reason"
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_rate(
    client: Any, url: str, model: str, workload: list[tuple[list[int], int]], rate: float, ns: argparse.Namespace
) -> tuple[list[RequestResult], float, float]:
    """All requests, arriving as a Poisson process at `rate` (inf: all at t = 0); returns the results,
    the wall time and the time of the last arrival."""
    arrivals = random.Random(ns.seed)
    limit = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None

    async def limited(body: dict, n: int) -> RequestResult:
        if limit is None:
            return await send_one(client, url, body, n)
        async with limit:
            return await send_one(client, url, body, n)

    tasks = []
    start = time.perf_counter()
    last_arrival = 0.0
    for i, (prompt, max_tokens) in enumerate(workload):
        if i and math.isfinite(rate):
            await asyncio.sleep(arrivals.expovariate(rate))
            last_arrival = time.perf_counter() - start
        tasks.append(asyncio.create_task(limited(_body(model, prompt, max_tokens, ns), len(prompt))))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start, last_arrival


def _body(model: str, prompt: list[int], max_tokens: int, ns: argparse.Namespace) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _stats(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 in ms (nearest-rank percentiles)."""
    if not values:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
    xs = sorted(v * 1000 for v in values)

    def pct(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]

    return {"mean": statistics.fmean(xs), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float, rate: float, last_arrival: float = 0.0) -> dict[str, Any]:
    """The run's figures. At a finite rate the run lasts at least until the last request arrives, so
    output tokens / last_arrival_s bounds the measurable output throughput from above
    (`arrival_bound_output_throughput`; None at rate inf): a figure near it says the arrivals, not the
    server, set the pace."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    bound = out_tokens / last_arrival if math.isfinite(rate) and last_arrival > 0 else None
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "last_arrival_s": last_arrival,
        "arrival_bound_output_throughput": bound,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'rate':>6} {'ok':>5} {'fail':>5} {'time s':>8} {'last arr s':>10} {'req/s':>7} {'out tok/s':>10} "
        f"{'bound tok/s':>11} "
        + " ".join(f"{m + ' ' + q:>11}" for m in ("TTFT", "TPOT", "ITL") for q in ("mean", "p50", "p90", "p99"))
    )
    print(head)
    for r in rows:
        cells = [f"{r[m][q]:11.1f}" for m in ("ttft_ms", "tpot_ms", "itl_ms") for q in ("mean", "p50", "p90", "p99")]
        bound = r["arrival_bound_output_throughput"]
        print(
            f"{r['request_rate']!s:>6} {r['completed']:>5} {r['failed']:>5} {r['duration_s']:8.1f} "
            f"{r['last_arrival_s']:10.2f} {r['request_throughput']:7.2f} {r['output_throughput']:10.1f} "
            f"{'-' if bound is None else f'{bound:.1f}':>11} " + " ".join(cells)
        )
    print("(latencies in ms; bound tok/s: output tokens / last arrival, the most a run at that rate can show)")


async def _main(ns: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    async with aiohttp.ClientSession(
        base_url=ns.base_url,
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=ns.timeout),
        connector=aiohttp.TCPConnector(limit=0),
    ) as client:
        async with client.get("/v1/models") as resp:
            resp.raise_for_status()
            models = await resp.json()
        async with client.get("/version") as resp:
            version = await resp.json() if resp.status == 200 else None
        model = ns.model or models["data"][0]["id"]
        workload = throughput_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.max_token_id)
        if not ns.no_warmup:
            warm = await send_one(client, ns.endpoint, _body(model, workload[0][0], 16, ns), len(workload[0][0]))
            if not warm.ok:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        runs = []
        for rate in ns.request_rate:
            results, duration, last_arrival = await run_rate(client, ns.endpoint, model, workload, rate, ns)
            row = summarize(results, duration, rate, last_arrival)
            if ns.save_detailed:
                row["requests"] = [asdict(r) for r in results]
            runs.append(row)
    return {
        "workload": "serving",
        "base_url": ns.base_url,
        "model": model,
        "server_models": models["data"],
        "server_version": version,
        "num_prompts": ns.num_prompts,
        "seed": ns.seed,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "max_token_id": ns.max_token_id,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "max_concurrency": ns.max_concurrency,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": runs,
    }


def run(ns: argparse.Namespace) -> int:
    try:
        report = asyncio.run(_main(ns))
    except Exception as e:
        print(f"tinyvllm bench serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print_table(report["runs"])
    label = ns.label or re.sub(r"[^A-Za-z0-9._-]+", "_", report["model"]).strip("_")[-60:]
    path = Path(ns.result_file or Path(ns.result_dir) / f"serving_{label}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for r in report["runs"]) else 3
