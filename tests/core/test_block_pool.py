"""BlockPool and KVCacheManager: free list, reference counts, prefix hits, LRU eviction. No torch."""

import subprocess
import sys

import pytest

from tinyvllm.core.block_pool import BlockPool, hash_block
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.request import Request


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, max_tokens=16)


def computed_and_cached(m: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """A request whose whole prompt was allocated, computed and offered to the prefix cache."""
    r = make_request(rid, tokens)
    assert m.allocate_slots(r, len(tokens))
    r.num_computed_tokens = len(tokens)
    m.cache_full_blocks(r)
    return r


def holders(manager: KVCacheManager) -> dict[int, int]:
    count: dict[int, int] = {}
    for table in manager.block_tables.values():
        for b in table:
            count[b] = count.get(b, 0) + 1
    return count


def test_core_never_imports_torch():
    code = (
        "import sys, tinyvllm.core.scheduler, tinyvllm.core.kv_cache_manager, tinyvllm.core.outputs;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_allocate_and_free_returns_every_block():
    pool = BlockPool(8, enable_caching=False)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8
    pool.check_invariants({})


def test_double_free_is_caught():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_chained_hash_depends_on_the_whole_prefix():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(h1, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_prefix_hit_reuses_blocks_and_counts_references():
    bs = 4
    m = KVCacheManager(BlockPool(10), bs)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert m.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    m.cache_full_blocks(a)
    b = make_request("b", [*range(8), 99, 98, 97])
    hits = m.find_cached_prefix(b)
    assert hits == m.block_table("a")[:2]
    assert m.allocate_slots(b, b.num_tokens - 8, hits)
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    m.pool.check_invariants(holders(m))
    assert m.pool.blocks[hits[0]].ref_cnt == 2
    m.free(a)
    m.pool.check_invariants(holders(m))
    m.free(b)
    m.pool.check_invariants(holders(m))
    assert m.pool.num_free_blocks == 10


def test_partial_block_and_last_token_are_never_taken_from_cache():
    bs = 4
    m = KVCacheManager(BlockPool(10), bs)
    computed_and_cached(m, "a", list(range(8)))
    # Same 8 tokens: both blocks are cached, but the last token must be computed, so only 1 block hits.
    same = make_request("same", list(range(8)))
    assert len(m.find_cached_prefix(same)) == 1
    # 7 tokens: second block is partial for this request.
    shorter = make_request("shorter", list(range(7)))
    assert len(m.find_cached_prefix(shorter)) == 1


def test_cached_blocks_survive_until_free_list_is_empty_then_lru():
    bs = 2
    m = KVCacheManager(BlockPool(4), bs)
    a = computed_and_cached(m, "a", [1, 2, 3, 4])
    a_blocks = list(m.block_table("a"))
    m.free(a)
    assert m.pool.num_free_blocks == 4
    # Two fresh blocks come from the never-used part of the pool: a's blocks stay cached.
    b = make_request("b", [7, 7, 7, 7])
    assert m.allocate_slots(b, 4)
    assert not set(m.block_table("b")) & set(a_blocks)
    again = make_request("again", [1, 2, 3, 4, 5])
    assert m.find_cached_prefix(again) == a_blocks
    # Now the free list is empty: a new allocation evicts a's tail block first (freed first).
    c = make_request("c", [8, 8])
    assert m.allocate_slots(c, 2)
    assert m.block_table("c") == [a_blocks[1]]
    assert m.pool.stats.evicted_blocks == 1
    assert m.find_cached_prefix(again) == a_blocks[:1]
    m.pool.check_invariants(holders(m))


def test_hash_collision_is_a_miss():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache_block(b, h, None, [1, 2])
    assert pool.lookup(h, None, [1, 2]) == b
    # Same hash key but different tokens (as a collision would give): never a hit.
    assert pool.lookup(h, None, [1, 3]) is None
    assert pool.lookup(h, 12345, [1, 2]) is None


def test_allocation_failure_changes_nothing():
    m = KVCacheManager(BlockPool(3), 4)
    r = make_request("r", list(range(20)))
    assert not m.allocate_slots(r, 20)
    assert m.pool.num_free_blocks == 3
    assert "r" not in m.block_tables


def test_reviving_an_evictable_hit_counts_against_free_blocks():
    bs = 2
    m = KVCacheManager(BlockPool(3), bs)
    a = computed_and_cached(m, "a", [1, 2, 3, 4])
    m.free(a)  # 3 free: 1 never used + 2 cached
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])  # hits 2 blocks (wants 3 more tokens-worth: 2 blocks)
    hits = m.find_cached_prefix(b)
    assert len(hits) == 2
    # Needs ceil(8/2)=4 blocks: 2 revived + 2 new, but only 1 non-hit block is free.
    assert not m.allocate_slots(b, 4, hits)
    m.pool.check_invariants(holders(m))


def test_lookup_reuses_the_previous_lookups_shared_blocks_and_agrees_with_a_full_walk():
    """Admissions sharing a prefix take the shared blocks from the previous lookup (no per-block walk);
    the result, hashes included, must equal what a manager without that shortcut finds, for prompts
    that share all, part of, or none of the previous one's blocks."""
    bs = 2
    m = KVCacheManager(BlockPool(32), bs)
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    computed_and_cached(m, "a", base)
    for rid, tokens in (
        ("b", [*base[:8], 40]),
        ("c", [*base[:8], 41, 42]),
        ("d", [*base[:5], 50, 51, 52]),
        ("e", [1, 2, 3, 4, 5, 6, 7, 8]),
        ("f", [9, 9, 9]),
        ("g", [*base[:8], 43]),
    ):
        r = make_request(rid, tokens)
        hits = m.find_cached_prefix(r)
        fresh = make_request(rid, tokens)
        m._last_lookup = None  # the full walk, for reference
        assert m.find_cached_prefix(fresh) == hits, rid
        assert r.block_hashes == fresh.block_hashes
        m.find_cached_prefix(make_request("again", tokens))  # leave this prompt as the previous lookup
    a_blocks = m.block_table("a")
    assert m.find_cached_prefix(make_request("h", [*base[:8], 44])) == a_blocks[:4]
    assert m.find_cached_prefix(make_request("i", base[:7])) == a_blocks[:3]  # num_tokens - 1 caps it


def test_lookup_shortcut_is_dropped_after_an_eviction():
    """Once a cached block is evicted (and reused for other tokens), the previous lookup's block ids
    are stale: a request with the same prefix must not get them."""
    bs = 2
    m = KVCacheManager(BlockPool(3), bs)
    a = computed_and_cached(m, "a", [1, 2, 3, 4, 5])
    b = make_request("b", [1, 2, 3, 4, 6])
    assert m.find_cached_prefix(b) == m.block_table("a")[:2]
    m.free(a)
    # Three new blocks: the pool has none never used, so a's cached blocks are evicted and reused.
    c = make_request("c", [7, 7, 8, 8, 9, 9])
    assert m.allocate_slots(c, 6)
    c.num_computed_tokens = 6
    m.cache_full_blocks(c)
    assert m.pool.stats.evicted_blocks >= 2
    assert m.find_cached_prefix(make_request("d", [1, 2, 3, 4, 6])) == []
    m.pool.check_invariants(holders(m))
