"""LLMEngine.step_deltas() against an independent reference: `encode_outputs(step())` of a second,
identical engine fed the same commands, step by step, for randomized mixes of requests."""

from __future__ import annotations

import random

import pytest

from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.entrypoints.deltas import encode_outputs
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

MAX_MODEL_LEN = 96
SHARED_PREFIX = list(range(7, 39))
KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_dummy_checkpoint(path, make_config("tiny"), seed=7, init_std=0.1, dtype="float32")
    return path


def _engine(model_dir, async_scheduling: bool) -> LLMEngine:
    # Few KV blocks (12 x 16 tokens) for a dozen live requests: preemptions and recomputation happen.
    return LLMEngine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            max_model_len=MAX_MODEL_LEN,
            num_gpu_blocks_override=12,
            max_num_batched_tokens=128,
            max_num_seqs=12,
            async_scheduling=async_scheduling,
            seed=3,
        )
    )


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    """Mostly what `tinyvllm serve` sends its core (DELTA, token ids only); some engine-text ones."""
    token_ids_only = rng.random() < 0.7
    fields = dict(
        n=rng.choice([1, 1, 2]),
        max_tokens=rng.randint(1, 24),
        min_tokens=rng.choice([0, 0, 3]),
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, None, 0, 2]),
        # a twentieth of the vocabulary: some requests stop on one
        stop_token_ids=rng.sample(range(vocab), vocab // 20) if rng.random() < 0.4 else [],
    )
    if fields["n"] == 1 and rng.random() < 0.5:  # greedy (n must be 1 then)
        fields.update(temperature=0.0)
    else:
        fields.update(temperature=1.0, top_p=0.9, seed=rng.choice([None, rng.randrange(1000)]))
    fields["min_tokens"] = min(fields["min_tokens"], fields["max_tokens"])
    if token_ids_only:
        return SamplingParams(output_kind=RequestOutputKind.DELTA, detokenize=False, **fields)
    return SamplingParams(output_kind=rng.choice(KINDS), stop=rng.choice([[], ["e", "a b"]]), **fields)


def _commands(rng: random.Random, tick: int, live: list[tuple[str, int]], vocab: int) -> list[tuple]:
    """One tick's commands: new requests (now and then one whose prompt can never fit), aborts of a
    request or of one completion of it."""
    commands: list[tuple] = []
    for k in range(rng.choice([0, 0, 1, 3]) + (tick == 1) if tick < 30 else 0):
        rid = f"r{tick}.{k}"
        too_long = (tick, k) == (1, 0) or rng.random() < 0.08
        prompt = [rng.randrange(vocab) for _ in range(MAX_MODEL_LEN + 4 if too_long else rng.randint(1, 40))]
        if rng.random() < 0.4:  # a shared two-block prefix: prefix-cache hits (num_cached_tokens)
            prompt = SHARED_PREFIX + prompt[:40]
        commands.append(("add", rid, prompt, _params(rng, vocab)))
    if live and rng.random() < 0.15:
        rid, n = rng.choice(live)
        commands.append(("abort", rid, rng.randrange(n)) if n > 1 and rng.random() < 0.6 else ("abort", rid))
    return commands


def _apply(engine: LLMEngine, commands: list[tuple]) -> None:
    for command in commands:
        if command[0] == "add":
            engine.add_request(*command[1:])
        elif len(command) == 3:
            engine.abort_child(command[1], command[2])
        else:
            engine.abort_request(command[1])


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_deltas_equal_encoded_step_outputs(model_dir, seed, async_scheduling):
    fast, reference = _engine(model_dir, async_scheduling), _engine(model_dir, async_scheduling)
    vocab = fast.model_config.vocab_size
    rng = random.Random(seed)
    live: list[tuple[str, int]] = []  # (request id, n) of requests added and not seen finished
    seen = {"finished": 0, "aborted": 0, "errors": 0, "logprobs": 0, "n2": 0, "tokens": 0, "cached": 0}
    tick = 0
    while tick < 30 or reference.has_unfinished_requests():
        commands = _commands(rng, tick, live, vocab)
        for engine in (fast, reference):
            _apply(engine, commands)
        live += [(c[1], c[3].n) for c in commands if c[0] == "add"]
        got, want = fast.step_deltas(), encode_outputs(reference.step())
        assert got == want, f"tick {tick}"
        for rid, finished, completions, error, cached in got:
            seen["cached"] += bool(cached)
            seen["tokens"] += sum(len(c[2]) for c in completions)
            seen["logprobs"] += any(c[3] for c in completions)
            seen["n2"] += len(completions) > 1
            seen["aborted"] += any(c[5] == "abort" for c in completions)
            seen["errors"] += error is not None
            if finished:
                seen["finished"] += 1
                live = [x for x in live if x[0] != rid]
        tick += 1
        assert tick < 400, "the engines did not drain"
    assert not fast.has_unfinished_requests()
    assert fast.get_metrics() == reference.get_metrics()
    # The mix really exercised what it is meant to.
    assert (
        seen["tokens"] > 100
        and seen["finished"] > 10
        and seen["logprobs"]
        and seen["n2"]
        and seen["cached"]
        and seen["errors"]
    ), seen


def test_pending_rejection_and_first_token_time(model_dir):
    """A rejected request's Delta comes out of the next step_deltas(); token-id requests still get
    their first-token time recorded."""
    engine = _engine(model_dir, False)
    params = SamplingParams(
        output_kind=RequestOutputKind.DELTA, detokenize=False, max_tokens=2, temperature=0.0, ignore_eos=True
    )
    engine.add_request("long", list(range(MAX_MODEL_LEN + 1)), params)
    engine.add_request("ok", [1, 2, 3], params)
    request = engine._sequences["ok"].request
    first = engine.step_deltas()
    assert first[0][:2] == ("long", True) and first[0][3] and first[0][2][0][5] == "error"
    assert [d[0] for d in first[1:]] == ["ok"] and first[1][2][0][2] and request.first_token_time is not None
    while engine.has_unfinished_requests():
        engine.step_deltas()
