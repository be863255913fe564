"""LLMEngine.core_step(): the token-level outputs of randomized mixes of requests (n, logprobs, stop
token ids, min_tokens, output kinds, aborts of requests and of single completions, prompts too long,
shared prefixes, preemption), checked against the rules they follow and against a reference run of
the same requests in an engine with room for all of them at once."""

from __future__ import annotations

import math
import random

import pytest

from tinyvllm import LLM
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.messages import EngineCoreOutput
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

MAX_MODEL_LEN = 96
SHARED_PREFIX = list(range(7, 39))
KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)
ENGINE_KW = dict(device="cpu", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=128, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_dummy_checkpoint(path, make_config("tiny"), seed=7, init_std=0.1, dtype="float32")
    return path


def _engine(model_dir, async_scheduling: bool) -> LLMEngine:
    # Few KV blocks (12 x 16 tokens) for a dozen live requests: preemptions and recomputation happen.
    args = EngineArgs(
        model=str(model_dir),
        num_gpu_blocks_override=12,
        max_num_seqs=12,
        async_scheduling=async_scheduling,
        **ENGINE_KW,
    )
    return LLMEngine(args)


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    """Mostly what `tinyvllm serve` sends (DELTA); some CUMULATIVE and FINAL_ONLY, some stop strings
    (which make FINAL_ONLY requests send every step)."""
    fields = dict(
        n=rng.choice([1, 1, 2]),
        max_tokens=rng.randint(1, 24),
        min_tokens=rng.choice([0, 0, 3]),
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, None, 0, 2]),
        # a twentieth of the vocabulary: some requests stop on one
        stop_token_ids=rng.sample(range(vocab), vocab // 20) if rng.random() < 0.4 else [],
        output_kind=RequestOutputKind.DELTA if rng.random() < 0.6 else rng.choice(KINDS),
        stop=rng.choice([[], [], ["e", "a b"]]),
    )
    if fields["n"] == 1 and rng.random() < 0.5:  # greedy (n must be 1 then)
        fields.update(temperature=0.0)
    else:
        fields.update(temperature=1.0, top_p=0.9, seed=rng.choice([None, rng.randrange(1000)]))
    fields["min_tokens"] = min(fields["min_tokens"], fields["max_tokens"])
    return SamplingParams(**fields)


def _commands(rng: random.Random, tick: int, live: list[tuple[str, int]], vocab: int) -> list[tuple]:
    """One tick's commands: new requests (now and then one whose prompt can never fit), aborts of a
    request or of one completion of it."""
    commands: list[tuple] = []
    for k in range(rng.choice([0, 0, 1, 3]) + (tick == 1) if tick < 30 else 0):
        rid = f"r{tick}.{k}"
        too_long = (tick, k) == (1, 0) or rng.random() < 0.08
        prompt = [rng.randrange(vocab) for _ in range(MAX_MODEL_LEN + 4 if too_long else rng.randint(1, 40))]
        if rng.random() < 0.4 and not too_long:  # a shared two-block prefix: prefix-cache hits
            prompt = SHARED_PREFIX + prompt[:40]
        commands.append(("add", rid, prompt, _params(rng, vocab)))
    if live and rng.random() < 0.15:
        rid, n = rng.choice(live)
        commands.append(("abort", rid, rng.randrange(n)) if n > 1 and rng.random() < 0.6 else ("abort", rid))
    return commands


class _Completion:
    """What the outputs of one completion added up to."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.num_outputs = 0
        self.finish: EngineCoreOutput | None = None


def _check_output(o: EngineCoreOutput, c: _Completion, params: SamplingParams) -> None:
    assert c.finish is None, "an output after the finishing one"
    first = c.num_outputs == 0
    c.num_outputs += 1
    c.token_ids += o.new_token_ids
    if params.logprobs is None:
        assert o.new_logprobs is None and o.cumulative_logprob is None
    else:
        assert len(o.new_logprobs) == len(o.new_token_ids)
        assert all(t in entry for t, entry in zip(o.new_token_ids, o.new_logprobs))
        c.logprobs += o.new_logprobs
        total = sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs))
        assert math.isclose(o.cumulative_logprob, total, rel_tol=1e-9, abs_tol=1e-9)
    if first or o.finish_reason is not None:
        assert o.times is not None
    if o.finish_reason is not None:
        c.finish = o
        t = o.times
        if t.first_token_time is not None:
            assert t.first_scheduled_time <= t.first_token_time <= t.finished_time


def _check_finish(c: _Completion, params: SamplingParams, prompt_len: int, eos: tuple[int, ...], aborted: bool):
    """The finish reason against the token ids and the stopping rules."""
    ids, reason = c.token_ids, c.finish.finish_reason
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    max_tokens = min(params.max_tokens, MAX_MODEL_LEN - prompt_len)
    # no stop token where it would have stopped the completion earlier (min_tokens holds them back)
    assert not any(t in stops for t in ids[max(params.min_tokens - 1, 0) : -1])
    if reason == "length":
        assert len(ids) == max_tokens and not (ids[-1] in stops and len(ids) >= params.min_tokens)
    elif reason == "stop":
        assert ids[-1] in stops and len(ids) >= params.min_tokens and len(ids) <= max_tokens
        assert c.finish.stop_reason == (ids[-1] if ids[-1] in params.stop_token_ids else None)
    else:
        assert reason == "abort" and aborted and len(ids) < max_tokens


def _apply(engine: LLMEngine, commands: list[tuple]) -> None:
    for command in commands:
        if command[0] == "add":
            engine.add_core_request(*command[1:])
        elif len(command) == 3:
            engine.abort_child(command[1], command[2])
        else:
            engine.abort_request(command[1])


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_core_step_outputs_follow_the_rules(model_dir, seed, async_scheduling):
    engine = _engine(model_dir, async_scheduling)
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    requests: dict[str, tuple] = {}  # id -> (prompt, params, arrival lower bound)
    completions: dict[tuple[str, int], _Completion] = {}
    aborted: set[tuple[str, int | None]] = set()
    seen = {"errors": 0, "cached": 0, "n2": 0, "logprobs": 0, "aborts": 0}
    tick = 0
    while tick < 30 or engine.has_unfinished_requests():
        commands = _commands(rng, tick, [(r, requests[r][1].n) for r in engine._parents], vocab)
        for c in commands:
            if c[0] == "add":
                requests[c[1]] = (c[2], c[3])
            else:
                aborted.add((c[1], c[2] if len(c) == 3 else None))
        _apply(engine, commands)
        stepped: set[tuple[str, int]] = set()
        for o in engine.core_step():
            prompt, params = requests[o.request_id]
            key = (o.request_id, o.index)
            assert key not in stepped, "two outputs of one completion in a step"
            stepped.add(key)
            if o.error is not None:
                assert len(prompt) > MAX_MODEL_LEN - 1 and o.finish_reason == "error" and not o.new_token_ids
                seen["errors"] += 1
                continue
            _check_output(o, completions.setdefault(key, _Completion()), params)
            seen["cached"] += bool(o.num_cached_tokens)
            seen["n2"] += o.index == 1
            seen["logprobs"] += bool(o.new_logprobs)
        tick += 1
        assert tick < 400, "the engine did not drain"
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    finished = []
    for (rid, index), c in completions.items():
        prompt, params = requests[rid]
        was_aborted = (rid, None) in aborted or (rid, index) in aborted
        if c.finish is None:  # only a whole-request abort ends a completion without an output
            assert (rid, None) in aborted or params.n > 1
            continue
        seen["aborts"] += c.finish.finish_reason == "abort"
        _check_finish(c, params, len(prompt), engine.eos_token_ids, was_aborted)
        if params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop:
            assert c.num_outputs == 1  # sent once, when it finished
        if not was_aborted and (params.temperature == 0 or params.seed is not None):
            finished.append((rid, index))
    seen["aborts"] = len(aborted)
    assert all(seen.values()) and len(finished) > 5, seen
    # Greedy and seeded completions do not depend on the batch, preemption or async scheduling: their
    # ids equal those of the same requests run alone, without a full cache.
    reference = LLM(model=str(model_dir), num_gpu_blocks_override=256, max_num_seqs=64, **ENGINE_KW)
    rids = sorted({rid for rid, _ in finished})
    outs = reference.generate([requests[r][0] for r in rids], [requests[r][1] for r in rids], use_tqdm=False)
    want = {(rid, o.index): o.token_ids for rid, out in zip(rids, outs) for o in out.outputs}
    assert {k: completions[k].token_ids for k in finished} == {k: want[k] for k in finished}


def test_pending_rejection_and_first_token_time(model_dir):
    """A rejected request's output comes out of the next core_step(); the others still get their
    first-token time recorded and sent with their first output."""
    engine = _engine(model_dir, False)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_core_request("long", list(range(MAX_MODEL_LEN + 1)), params)
    engine.add_core_request("ok", [1, 2, 3], params)
    request = engine._sequences["ok"].request
    first = engine.core_step()
    assert [o.request_id for o in first] == ["long", "ok"]
    assert first[0].error and first[0].finish_reason == "error" and first[0].times.finished_time is not None
    assert len(first[1].new_token_ids) == 1 and first[1].times.first_token_time == request.first_token_time
    while engine.has_unfinished_requests():
        engine.core_step()
