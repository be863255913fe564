"""Scheduler: token budget, decodes first, chunked prefill, preemption order, rejection, no leaks.
The model is simulated: each sampled token is a fixed function of the request and its length."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.config import SchedulerConfig
from tinyvllm.core.block_pool import BlockPool
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from tinyvllm.core.request import Request, RequestStatus
from tinyvllm.core.scheduler import Scheduler


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=True
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks, caching), block_size))


def req(rid: str, n_prompt: int, max_tokens: int = 4, first: int = 0) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(first, first + n_prompt)), max_tokens=max_tokens)


def fake_token(request_id: str, length: int) -> int:
    return (sum(map(ord, request_id)) * 31 + 7 * length) % 1000


def run_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = [fake_token(q.request_id, q.context_len) for q in out.sequences if q.sample]
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out


def holders(s: Scheduler) -> dict[int, int]:
    count: dict[int, int] = {}
    for table in s.kv_cache.block_tables.values():
        for b in table:
            count[b] = count.get(b, 0) + 1
    return count


def check(s: Scheduler) -> None:
    s.kv_cache.pool.check_invariants(holders(s))
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        table = s.kv_cache.block_table(r.request_id)
        assert len(table) * s.kv_cache.block_size >= r.num_computed_tokens
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.request_id not in s.kv_cache.block_tables


def drain(s: Scheduler, max_steps=10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        outs.append(run_step(s))
        check(s)
    assert not s.has_unfinished()
    return outs


def test_budget_and_chunked_prefill():
    s = make_scheduler(budget=16)
    s.add_request(req("long", 40, max_tokens=2))
    s.add_request(req("short", 5, max_tokens=2, first=1000))
    out = run_step(s)
    assert out.num_batched_tokens == 16
    assert [(q.request_id, q.num_new_tokens, q.sample) for q in out.sequences] == [("long", 16, False)]
    out = run_step(s)
    assert [(q.request_id, q.num_new_tokens) for q in out.sequences] == [("long", 16)]
    out = run_step(s)  # last 8 tokens of "long", then "short" fits in the remaining 8
    assert [(q.request_id, q.num_new_tokens, q.sample) for q in out.sequences] == [
        ("long", 8, True),
        ("short", 5, True),
    ]
    for o in drain(s):
        assert o.num_batched_tokens <= 16


def test_decodes_are_scheduled_before_prompt_chunks():
    s = make_scheduler(budget=8)
    s.add_request(req("a", 3, max_tokens=10))
    run_step(s)  # a prefilled, sampled one token: now decoding
    s.add_request(req("b", 30, max_tokens=2))
    out = run_step(s)
    assert [(q.request_id, q.num_new_tokens) for q in out.sequences] == [("a", 1), ("b", 7)]
    out = run_step(s)
    # b is part-way through its prompt; a (decoding) still comes first and is never starved.
    assert [(q.request_id, q.num_new_tokens) for q in out.sequences] == [("a", 1), ("b", 7)]


def test_max_num_seqs():
    s = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(4):
        s.add_request(req(f"r{i}", 3))
    out = run_step(s)
    assert {q.request_id for q in out.sequences} == {"r0", "r1"}
    drain(s)


def test_preempts_most_recently_admitted_and_recomputes():
    # 6 blocks of 4 tokens. Three requests of 7 prompt tokens take 2 blocks each; decoding past 8 tokens
    # needs a third block, which forces preemption of the newest.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    for rid in ("r0", "r1", "r2"):
        s.add_request(req(rid, 7, max_tokens=6))
    run_step(s)  # prefill all three: 7 tokens in the cache, one sampled
    run_step(s)  # decode position 7: still inside block #2
    assert s.kv_cache.pool.num_free_blocks == 0
    out = run_step(s)  # position 8 needs block #3 for each: r2 (newest) is preempted, then r1
    assert out.num_preempted >= 1
    assert s.waiting[0].request_id in ("r1", "r2")
    preempted = [r for r in s.waiting]
    assert all(r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in preempted)
    assert "r2" in [r.request_id for r in preempted]
    assert s.running[0].request_id == "r0"
    tokens_before = {r.request_id: list(r.token_ids) for r in preempted}
    drain(s)
    # A preempted request resumes with the tokens it had, recomputing them.
    assert all(len(t) >= 8 for t in tokens_before.values())
    assert s.kv_cache.pool.num_free_blocks == 6
    assert s.num_preemptions >= 1


def test_outputs_do_not_depend_on_preemption():
    def final_tokens(num_blocks):
        s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=64)
        reqs = [req(f"r{i}", 5 + i, max_tokens=12) for i in range(4)]
        for r in reqs:
            s.add_request(r)
        drain(s)
        return {r.request_id: r.output_token_ids for r in reqs}, s.num_preemptions

    roomy, p0 = final_tokens(64)
    tight, p1 = final_tokens(6)
    assert p0 == 0 and p1 > 0
    assert roomy == tight


def test_impossible_prompt_is_rejected_alone():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    too_long = req("too_long", 100)
    too_big_for_cache = req("cache", 20)
    ok = req("ok", 5)
    assert not s.add_request(too_long)
    assert too_long.status == RequestStatus.FINISHED_ERROR and "at most 99" in too_long.error
    assert not s.add_request(too_big_for_cache)
    assert "KV cache holds only 16 tokens" in too_big_for_cache.error
    assert not s.add_request(req("empty", 0))
    assert s.add_request(ok)
    drain(s)
    assert ok.status == RequestStatus.FINISHED_LENGTH and ok.num_output_tokens == 4


def test_abort_frees_blocks_everywhere():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 9, max_tokens=50))
    run_step(s)
    s.finish_requests(["r0", "r3"], RequestStatus.FINISHED_ABORTED)  # one running, one waiting
    check(s)
    out = run_step(s)
    assert "r0" in out.released_request_ids
    s.finish_requests(["r1", "r2", "unknown"], RequestStatus.FINISHED_ABORTED)
    check(s)
    assert s.kv_cache.pool.num_free_blocks == 64 and not s.has_unfinished()


def test_stop_rules():
    s = make_scheduler()
    r = Request(
        request_id="x",
        prompt_token_ids=[1, 2, 3],
        max_tokens=10,
        min_tokens=2,
        stop_token_ids=frozenset({fake_token("x", 3), fake_token("x", 4)}),
    )
    s.add_request(r)
    drain(s)
    # The first token (sampled at length 3) is a stop token but min_tokens=2 holds; the second stops.
    assert r.output_token_ids == [fake_token("x", 3), fake_token("x", 4)]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == fake_token("x", 4)


def test_max_model_len_stops_generation():
    s = make_scheduler(max_model_len=10)
    r = req("r", 7, max_tokens=100)
    s.add_request(r)
    drain(s)
    assert r.num_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


def test_prefix_hits_skip_computation():
    s = make_scheduler(block_size=4, budget=100)
    a = req("a", 12, max_tokens=1)
    s.add_request(a)
    drain(s)
    b = req("b", 14, max_tokens=1)  # shares a's 12 prompt tokens = 3 full blocks
    s.add_request(b)
    out = run_step(s)
    (seq,) = out.sequences
    assert seq.num_computed_tokens == 12 and seq.num_new_tokens == 2
    assert b.num_cached_tokens == 12
    stats = s.kv_cache.pool.stats
    assert stats.hit_tokens == 12 and stats.queried_tokens == 12 + 14
    drain(s)


def test_skipping_the_prefix_cache_computes_every_token_and_still_offers_blocks():
    """A request with skip_reading_prefix_cache (prompt logprobs) adopts no cached block and is not
    counted as a lookup; its own full blocks are still offered, and a later request hits them."""
    s = make_scheduler(block_size=4, budget=100)
    s.add_request(req("a", 12, max_tokens=1))
    drain(s)
    b = Request(request_id="b", prompt_token_ids=list(range(14)), max_tokens=1, skip_reading_prefix_cache=True)
    b2 = Request(request_id="b2", prompt_token_ids=list(range(100, 114)), max_tokens=1, skip_reading_prefix_cache=True)
    s.add_request(b)
    (seq,) = run_step(s).sequences
    assert seq.num_computed_tokens == 0 and seq.num_new_tokens == 14 and b.num_cached_tokens == 0
    stats = s.kv_cache.pool.stats
    assert stats.hit_tokens == 0 and stats.queried_tokens == 12
    drain(s)
    s.add_request(b2)  # tokens no one computed before: its blocks enter the cache only if it offers them
    drain(s)
    c = req("c", 15, max_tokens=1, first=100)
    s.add_request(c)
    (seq,) = run_step(s).sequences
    assert seq.num_computed_tokens == 12 and c.num_cached_tokens == 12
    drain(s)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_schedules_keep_the_pool_consistent(data):
    num_blocks = data.draw(st.integers(8, 40))
    block_size = data.draw(st.sampled_from([1, 2, 3, 4]))
    budget = data.draw(st.integers(4, 40))
    s = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_num_seqs=data.draw(st.integers(1, 6)),
        max_model_len=num_blocks * block_size,
        caching=data.draw(st.booleans()),
    )
    prefixes = [[7] * 6, list(range(100, 110))]
    n = 0
    for _ in range(data.draw(st.integers(1, 40))):
        action = data.draw(st.sampled_from(["add", "step", "step", "abort"]))
        if action == "add":
            prefix = data.draw(st.sampled_from(prefixes))
            tail = data.draw(st.lists(st.integers(0, 50), max_size=12))
            s.add_request(
                Request(request_id=f"r{n}", prompt_token_ids=prefix + tail, max_tokens=data.draw(st.integers(1, 8)))
            )
            n += 1
        elif action == "abort" and s.requests:
            s.finish_requests(data.draw(st.sampled_from(sorted(s.requests))), RequestStatus.FINISHED_ABORTED)
        else:
            out = run_step(s)
            assert out.num_batched_tokens <= budget
        check(s)
    drain(s)
    assert s.kv_cache.pool.num_free_blocks == num_blocks


class FakeModel:
    """Deterministic 'model': the next token depends on the request, its length and its last input
    token. Resolves PLACEHOLDER inputs from the previous step's samples, as the GPU runner does."""

    def __init__(self):
        self.prev: dict[str, int] = {}

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        from tinyvllm.core.outputs import PLACEHOLDER

        sampled, now = [], {}
        for q in out.sequences:
            last = q.token_ids[-1]
            if last == PLACEHOLDER:
                last = self.prev[q.request_id]
            if q.sample:
                tok = (fake_token(q.request_id, q.context_len) + 13 * last) % 1000
                sampled.append(tok)
                now[q.request_id] = tok
        self.prev = now
        return ModelRunnerOutput(sampled_token_ids=sampled)


def run_sync(s: Scheduler) -> None:
    model = FakeModel()
    while s.has_unfinished():
        out = s.schedule()
        s.update_from_output(out, model(out))
        check(s)


def run_pipelined(s: Scheduler) -> int:
    """Async scheduling: step k+1 is scheduled before step k's tokens are known. Returns the number
    of steps that had a placeholder input."""
    model = FakeModel()
    prev = None
    with_placeholders = 0
    while s.has_unfinished() or prev is not None:
        out = s.schedule()
        result = model(out) if not out.is_empty else None
        with_placeholders += any(-1 in q.token_ids for q in out.sequences)
        if prev is not None:
            s.update_from_output(*prev)
        check(s)
        prev = (out, result) if result is not None else None
    return with_placeholders


@pytest.mark.parametrize("num_blocks", [64, 7])
def test_pipelined_scheduling_gives_the_same_tokens(num_blocks):
    def make():
        s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=24, max_model_len=28)
        reqs = [
            Request(
                request_id=f"r{i}",
                prompt_token_ids=list(range(i, i + 3 + 2 * i)),
                max_tokens=6 + i,
                stop_token_ids=frozenset({999}),
            )
            for i in range(5)
        ]
        for r in reqs:
            s.add_request(r)
        return s, reqs

    s1, reqs1 = make()
    run_sync(s1)
    s2, reqs2 = make()
    assert run_pipelined(s2) > 0
    assert [r.output_token_ids for r in reqs1] == [r.output_token_ids for r in reqs2]
    assert [r.status for r in reqs1] == [r.status for r in reqs2]
    assert all(r.num_pending_outputs == 0 for r in reqs2)
    assert s2.kv_cache.pool.num_free_blocks == num_blocks
    if num_blocks == 7:
        assert s2.num_preemptions > 0


def test_requests_not_ready_are_passed_over_and_keep_their_place():
    """A request whose `ready()` is False (its grammar compiling) is not admitted; those behind it are;
    once ready it is admitted ahead of requests that arrived after it."""
    s = make_scheduler()
    compiled = {"flag": False}
    slow = req("slow", 5)
    slow.ready = lambda: compiled["flag"]
    s.add_request(req("a", 5))
    s.add_request(slow)
    s.add_request(req("b", 5))
    out = run_step(s)
    assert [q.request_id for q in out.sequences] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["slow"]
    s.add_request(req("c", 5))
    compiled["flag"] = True
    out = run_step(s)
    admitted = [q.request_id for q in out.sequences if q.is_new]
    assert admitted == ["slow", "c"]
    check(s)
