"""Encode + decode of one step's outputs on the core -> API process pipe: msgpack EngineCoreOutputs
against pickled plain tuples (the earlier wire format), on this CPU.

A batch-`B` decode step: every request has one new token (and, with `--logprobs K`, its logprobs
entry of K + 1 tokens); the stats dict and the timestamp ride along, as in the core loop. The tuple
format is the one the core sent before its messages were named: ("out", replies, [(request_id,
finished, [(index, text, token_ids, logprobs, cumulative_logprob, finish_reason, stop_reason)],
error, num_cached_tokens)], stats, now), its logprobs frozen dataclasses.

    python -m benchmarks.bench_wire --batch 256 [--logprobs 0 5] [--repeat 200]
"""

from __future__ import annotations

import argparse
import pickle
import random
import time
from dataclasses import dataclass

from tinyvllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, encoder, output_decoder
from tinyvllm.outputs import Logprob

STATS = {
    "num_requests_running": 256,
    "num_requests_waiting": 0,
    "kv_cache_usage": 0.41,
    "num_kv_blocks": 20000,
    "num_free_kv_blocks": 11800,
    "num_preemptions": 0,
    "prompt_tokens": 140000,
    "generation_tokens": 90000,
    "prefix_cache_queried_tokens": 140000,
    "prefix_cache_hit_tokens": 0,
    "prefix_cache_evicted_blocks": 0,
}


@dataclass(frozen=True)
class TupleLogprob:
    """The logprob entry as the tuple format carried it (a frozen dataclass)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def step_outputs(batch: int, logprobs: int | None, seed: int = 0) -> tuple[tuple, EngineCoreOutputs]:
    """One step's outputs in both formats (the same values)."""
    rng = random.Random(seed)
    tuples, outputs = [], []
    for _ in range(batch):
        token = rng.randrange(128000)
        entry = new = None
        cumulative = None
        if logprobs is not None:
            ids = [token, *(rng.randrange(128000) for _ in range(logprobs))]
            values = [(rng.uniform(-9, 0), rank, f"tok{t}") for rank, t in enumerate(ids, 1)]
            entry = [{t: TupleLogprob(*v) for t, v in zip(ids, values)}]
            new = [{t: Logprob(*v) for t, v in zip(ids, values)}]
            cumulative = rng.uniform(-100, 0)
        rid = f"cmpl-{rng.getrandbits(64):016x}-0"
        tuples.append((rid, False, [(0, "", [token], entry, cumulative, None, None)], None, 0))
        outputs.append(EngineCoreOutput(rid, [token], 0, 0, None, None, cumulative, new))
    now = time.monotonic()
    return ("out", [], tuples, STATS, now), EngineCoreOutputs(outputs, [], STATS, now)


def best_us(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(batch: int, logprobs: int | None, repeat: int) -> dict:
    old, new = step_outputs(batch, logprobs)
    old_bytes = pickle.dumps(old, protocol=pickle.HIGHEST_PROTOCOL)
    new_bytes = encoder.encode(new)
    assert output_decoder.decode(new_bytes) == new
    return {
        "batch": batch,
        "logprobs": logprobs,
        "pickle_encode_us": best_us(lambda: pickle.dumps(old, protocol=pickle.HIGHEST_PROTOCOL), repeat),
        "pickle_decode_us": best_us(lambda: pickle.loads(old_bytes), repeat),
        "pickle_bytes": len(old_bytes),
        "msgpack_encode_us": best_us(lambda: encoder.encode(new), repeat),
        "msgpack_decode_us": best_us(lambda: output_decoder.decode(new_bytes), repeat),
        "msgpack_bytes": len(new_bytes),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[256])
    p.add_argument("--logprobs", type=int, nargs="*", default=[5], help="also these logprobs (besides none)")
    p.add_argument("--repeat", type=int, default=200, help="timed runs of each; the fastest is reported")
    ns = p.parse_args()
    print(
        f"{'batch':>5} {'logprobs':>8} | {'pickled tuples: enc + dec = us':>31} {'bytes':>7} | "
        f"{'msgpack Structs: enc + dec = us':>32} {'bytes':>7}"
    )
    for batch in ns.batch:
        for logprobs in [None, *ns.logprobs]:
            r = measure(batch, logprobs, ns.repeat)
            old = r["pickle_encode_us"] + r["pickle_decode_us"]
            new = r["msgpack_encode_us"] + r["msgpack_decode_us"]
            print(
                f"{batch:5d} {logprobs if logprobs is not None else '-':>8} | "
                f"{r['pickle_encode_us']:8.1f} + {r['pickle_decode_us']:8.1f} = {old:8.1f} {r['pickle_bytes']:7d} | "
                f"{r['msgpack_encode_us']:8.1f} + {r['msgpack_decode_us']:8.1f} = {new:8.1f} {r['msgpack_bytes']:7d}"
            )


if __name__ == "__main__":
    main()
