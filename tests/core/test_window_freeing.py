"""Sliding-window KV freeing: blocks go back to the pool exactly when they leave a request's window, never
while some query of a step may still read them, with chunked prefill, preemption, prefix caching and
async scheduling. No torch.

The model is simulated down to its KV cache: every step first writes, for each token row, a value naming
the token prefix it belongs to into the row's cache slot, then checks that every key each query of the
step attends to (its window) still holds that value. A block freed too early and reused by another
request fails the check."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.config import SchedulerConfig
from tinyvllm.core.block_pool import BlockPool
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.outputs import PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from tinyvllm.core.request import Request, RequestStatus
from tinyvllm.core.scheduler import Scheduler


def make_scheduler(window, num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    kv = KVCacheManager(BlockPool(num_blocks, caching), block_size, sliding_window=window)
    return Scheduler(config, kv)


def holders(kv: KVCacheManager) -> dict[int, int]:
    count: dict[int, int] = {}
    for rid in kv.block_tables:
        for b in kv.held_blocks(rid):
            count[b] = count.get(b, 0) + 1
    return count


def check(s: Scheduler) -> None:
    kv = s.kv_cache
    kv.pool.check_invariants(holders(kv))
    for r in s.running:
        table = kv.block_table(r.request_id)
        assert len(table) * kv.block_size >= r.num_computed_tokens
    for r in s.waiting:
        assert r.request_id not in kv.block_tables


class CacheModel:
    """A fake model that keeps a fake KV cache: slot (block, offset) → the token prefix whose K/V it holds.

    For each step, in order: resolve PLACEHOLDER inputs from the previous step's samples; write every row's
    slot; check every key each sequence's queries attend to (positions max(0, c − W + 1) .. c + n − 1 for
    a chunk of n tokens from position c); sample a deterministic next token. Also records the most blocks
    each request held after a step's allocation."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.bs = s.kv_cache.block_size
        self.window = s.kv_cache.sliding_window
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.prev: dict[str, int] = {}
        self.max_held: dict[str, int] = {}
        self.reads = 0

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.bs
        for q in out.sequences:
            seq = self.tokens.setdefault(q.request_id, [])
            if len(seq) < q.num_computed_tokens:  # a prefix-cache hit: those tokens were not fed
                seq[:] = q.all_token_ids[: q.num_computed_tokens]
            del seq[q.num_computed_tokens :]
            seq.extend(self.prev[q.request_id] if t == PLACEHOLDER else t for t in q.token_ids)
            for p in range(q.num_computed_tokens, q.context_len):
                self.slots[q.block_ids[p // bs], p % bs] = tuple(seq[: p + 1])
            held = len(self.s.kv_cache.held_blocks(q.request_id))
            self.max_held[q.request_id] = max(self.max_held.get(q.request_id, 0), held)
        for q in out.sequences:  # attention runs after every row of the step wrote its K/V
            seq = self.tokens[q.request_id]
            lowest = 0 if self.window is None else max(0, q.num_computed_tokens - self.window + 1)
            for k in range(lowest, q.context_len):
                block = q.block_ids[k // bs]
                assert self.slots.get((block, k % bs)) == tuple(seq[: k + 1]), (
                    f"{q.request_id}: key {k} (block {block}) was overwritten or never written"
                )
                assert self.s.kv_cache.pool.blocks[block].ref_cnt > 0, f"{q.request_id} reads freed block {block}"
                self.reads += 1
        sampled, now = [], {}
        for q in out.sequences:
            if q.sample:
                seq = self.tokens[q.request_id]
                tok = (sum(map(ord, q.request_id)) * 31 + 7 * len(seq) + 13 * seq[-1]) % 1000
                sampled.append(tok)
                now[q.request_id] = tok
        self.prev = now
        return ModelRunnerOutput(sampled_token_ids=sampled)


def step(s: Scheduler, model: CacheModel, pipelined: bool, prev):
    """Schedule and run one step; with async scheduling the previous step's tokens arrive after this
    step was scheduled. Returns the step whose tokens are still to be delivered (async) or None."""
    out = s.schedule()
    result = model(out) if not out.is_empty else None
    if not pipelined:
        if result is not None:
            s.update_from_output(out, result)
    else:
        if prev is not None:
            s.update_from_output(*prev)
        prev = (out, result) if result is not None else None
    check(s)
    return prev if pipelined else None


def run(s: Scheduler, pipelined: bool = False, model: CacheModel | None = None, prev=None) -> CacheModel:
    """Run to completion, checking the pool after every step."""
    model = model or CacheModel(s)
    for _ in range(10_000):
        if not (s.has_unfinished() or prev is not None):
            break
        prev = step(s, model, pipelined, prev)
    assert not s.has_unfinished()
    return model


def test_blocks_are_freed_exactly_when_they_leave_the_window():
    """bs 4, W 6, a 30-token prompt in chunks of 5, then decodes: before the step from position c the
    request holds exactly the blocks from ⌊max(0, c − 5) / 4⌋ to the one holding its step's last token."""
    bs, window = 4, 6
    s = make_scheduler(window, num_blocks=32, block_size=bs, budget=5)
    r = Request(request_id="r", prompt_token_ids=list(range(30)), max_tokens=12)
    s.add_request(r)
    kv, pool = s.kv_cache, s.kv_cache.pool
    seen_release = False
    while s.has_unfinished():
        c = r.num_computed_tokens
        out = s.schedule()
        (q,) = out.sequences
        assert q.num_computed_tokens == c
        first = max(0, c - window + 1) // bs
        last = (q.context_len - 1) // bs
        table = kv.block_table("r")
        assert kv.held_blocks("r") == table[first : last + 1]
        assert kv.num_released_blocks.get("r", 0) == first
        assert pool.num_free_blocks == pool.num_blocks - (last + 1 - first)
        seen_release |= first > 0
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[5] if q.sample else []))
        check(s)
    assert seen_release
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("window,block_size", [(1, 4), (5, 4), (8, 4), (7, 3), (16, 16), (100, 4)])
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
def test_every_read_key_is_intact(window, block_size, pipelined):
    """Mixed prompts (longer and shorter than the window, sharing prefixes) in a small pool: every key
    any query reads still holds its own K/V, and each request holds at most `max_blocks_held` blocks."""
    s = make_scheduler(window, num_blocks=24, block_size=block_size, budget=12, max_num_seqs=4, max_model_len=70)
    system = list(range(500, 520))
    for i in range(6):
        prompt = system[: 4 + 3 * i] + [i] * (2 + 5 * i)
        s.add_request(Request(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=8 + 3 * i))
    model = run(s, pipelined)
    assert model.reads > 0
    assert s.kv_cache.pool.num_free_blocks == 24
    for rid, held in model.max_held.items():
        assert held <= s.kv_cache.max_blocks_held(70, 12), rid


def test_outputs_do_not_depend_on_the_window_freeing():
    """The same requests under the same fake model give the same tokens with a window-freeing cache of 7
    blocks (28 tokens, less than the longest request's 40: it fits only because blocks are freed; the
    pool is tight enough to preempt) as with a huge cache that frees nothing."""

    def outputs(window, num_blocks):
        s = make_scheduler(window, num_blocks=num_blocks, block_size=4, budget=10, max_num_seqs=3)
        reqs = [
            Request(request_id=f"r{i}", prompt_token_ids=list(range(i, i + 9 + 4 * i)), max_tokens=15) for i in range(5)
        ]
        for r in reqs:
            s.add_request(r)
        run(s)
        return [r.output_token_ids for r in reqs], s.num_preemptions

    small, preemptions = outputs(6, 7)
    big, _ = outputs(None, 200)
    assert small == big
    assert preemptions > 0


def test_prompt_longer_than_the_cache_runs_under_a_window():
    """A 60-token prompt in a 32-token cache: rejected without a window, served with an 8-token window
    (chunks of 8 hold at most 5 blocks of 4)."""
    plain = make_scheduler(None, num_blocks=8, block_size=4, budget=8)
    r = Request(request_id="long", prompt_token_ids=list(range(60)), max_tokens=10)
    assert not plain.add_request(r) and r.status == RequestStatus.FINISHED_ERROR
    s = make_scheduler(8, num_blocks=8, block_size=4, budget=8)
    assert s.kv_cache.max_blocks_held(61, 8) == 5
    r = Request(request_id="long", prompt_token_ids=list(range(60)), max_tokens=10)
    assert s.add_request(r)
    model = run(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 10
    assert model.max_held["long"] <= 5
    # A window wider than the cache can hold is still rejected, with the reason.
    s = make_scheduler(40, num_blocks=8, block_size=4, budget=8)
    r = Request(request_id="wide", prompt_token_ids=list(range(60)), max_tokens=10)
    assert not s.add_request(r) and "40-token attention window" in r.error


def test_released_cached_blocks_stay_hits_and_evict_cleanly():
    """A request's released prompt blocks keep their hashes (cached, unreferenced): a later request with
    the same prompt hits all of them but adopts only those inside its window; evicting them later
    drops their hashes and leaves the pool consistent."""
    bs, window = 4, 6
    s = make_scheduler(window, num_blocks=12, block_size=bs, budget=8, max_num_seqs=2)
    kv, pool = s.kv_cache, s.kv_cache.pool
    prompt = list(range(100, 128))  # 7 full blocks
    a = Request(request_id="a", prompt_token_ids=prompt, max_tokens=2)
    s.add_request(a)
    model = run(s)
    assert pool.num_free_blocks == 12 and pool.count_evictable(range(12)) >= 6  # a's full blocks, cached
    b = Request(request_id="b", prompt_token_ids=[*prompt, 7, 8, 9], max_tokens=3)
    s.add_request(b)
    out = s.schedule()
    (q,) = out.sequences
    assert q.num_computed_tokens == 28  # all 7 blocks hit
    first = (28 - window + 1) // bs
    assert kv.num_released_blocks["b"] == first  # hits below the window are not adopted
    assert kv.held_blocks("b")[: 7 - first] == kv.block_table("b")[first:7]
    assert all(pool.blocks[bid].ref_cnt == 0 for bid in kv.block_table("b")[:first])
    check(s)
    s.update_from_output(out, model(out))  # b reads the hit blocks inside its window: intact
    # A third request with a different prompt evicts the LRU cached blocks: hashes go cleanly.
    c = Request(request_id="c", prompt_token_ids=list(range(900, 930)), max_tokens=2)
    s.add_request(c)
    evicted = pool.stats.evicted_blocks
    run(s, model=model)
    assert pool.stats.evicted_blocks > evicted
    check(s)
    assert pool.num_free_blocks == 12


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_schedules_under_a_window(data):
    """Random adds, steps and aborts with shared prefixes, small pools, any window and block size,
    synchronous or async: pool consistent and every read key intact after every step."""
    num_blocks = data.draw(st.integers(6, 30))
    block_size = data.draw(st.sampled_from([1, 2, 3, 4, 8]))
    window = data.draw(st.integers(1, 40))
    budget = data.draw(st.integers(4, 24))
    # Requests may outgrow the cache where the pool holds a window's worth of blocks (as the engine must
    # size max_model_len); else they stop at the cache's size, as without a window.
    probe = KVCacheManager(BlockPool(1), block_size, sliding_window=window)
    max_model_len = 200 if probe.max_blocks_held(200, budget) <= num_blocks else num_blocks * block_size
    s = make_scheduler(
        window,
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_num_seqs=data.draw(st.integers(1, 5)),
        max_model_len=max_model_len,
        caching=data.draw(st.booleans()),
    )
    model = CacheModel(s)
    pipelined = data.draw(st.booleans())
    prefixes = [[7] * 6, list(range(100, 118))]
    prev = None
    n = 0
    for _ in range(data.draw(st.integers(1, 40))):
        action = data.draw(st.sampled_from(["add", "step", "step", "step", "abort"]))
        if action == "add":
            prefix = data.draw(st.sampled_from(prefixes))
            tail = data.draw(st.lists(st.integers(0, 50), max_size=30))
            s.add_request(
                Request(request_id=f"r{n}", prompt_token_ids=prefix + tail, max_tokens=data.draw(st.integers(1, 12)))
            )
            n += 1
        elif action == "abort" and s.requests:
            s.finish_requests(data.draw(st.sampled_from(sorted(s.requests))), RequestStatus.FINISHED_ABORTED)
        elif action != "abort":
            prev = step(s, model, pipelined, prev)
        check(s)
    run(s, pipelined, model, prev)
    assert s.kv_cache.pool.num_free_blocks == num_blocks


def test_rejects_bad_window():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="sliding_window"):
            KVCacheManager(BlockPool(4), 4, sliding_window=bad)
