"""Per-request block tables on top of the block pool: slot allocation, prefix lookup, freeing.

Token t of a request lives in block `block_table[t // block_size]`, at offset `t % block_size`.
Under a sliding window the leading entries of a table may be released (KVCacheManager's docstring).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tinyvllm.core.block_pool import BlockPool, hash_block
from tinyvllm.core.request import Request


@dataclass
class _Lookup:
    """The last prefix lookup: a request's tokens, block hashes and hits, and the pool's eviction epoch
    then. Requests admitted together often share a long prefix (a system prompt): the next lookup
    takes the leading blocks it shares with this one (compared as token lists, in C) from here instead
    of hashing and looking up each block again, valid while no cached block has been evicted since
    (evicting is the only way a cached block changes contents). For requests that share 1,024 tokens
    this makes an admission about six times cheaper."""

    token_ids: list[int]
    block_hashes: list[int]
    hits: list[int]
    epoch: int


def _common_blocks(a: list[int], b: list[int], max_blocks: int, block_size: int) -> int:
    """The largest k <= max_blocks such that a and b agree on their first k blocks (binary search:
    prefix agreement is monotone in k)."""
    n = max_blocks * block_size
    if max_blocks == 0 or a[:n] == b[:n]:
        return max_blocks
    lo, hi = 0, max_blocks - 1  # agreement holds at lo, fails at hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * block_size] == b[: mid * block_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class KVCacheManager:
    """Owns every request's block table. Never imports torch.

    Sliding window (`sliding_window` = W, given when every attention layer of the model attends to at
    most its last W keys, as in Mistral 7B; None otherwise): a query at position p reads keys
    max(0, p − W + 1)..p only. A step that computes a request's tokens from position c on (c =
    `num_computed_tokens`, the cached prefix included) and every later step therefore never read a key
    below c − W + 1, so before the step block i is released to the pool once its last position is below
    that:
        (i + 1) · block_size ≤ c − W + 1,  i.e.  i < max(0, c − W + 1) // block_size.
    A chunk of a long prompt starting at c keeps the W − 1 keys before it; a preempted request frees
    everything and starts again from c = 0; at admission, cached prefix blocks wholly below the window
    of the first computed token are not adopted at all. Released entries stay in the block table with
    their old ids, so a table keeps the layout above, but the request no longer holds them
    (`held_blocks`): another request may own and overwrite them, which is harmless because the
    attention kernels never read a key below a query's window (kernels/flash_tiles.py). A released block
    that carries a prefix-cache hash keeps it and its contents (it goes to the pool's LRU like any freed
    cached block), so later requests still hit it; one whose token ids were not yet known (tokens still
    being sampled) is never offered to the cache. So a running request holds at most the blocks of the
    W − 1 + m positions a step of m tokens touches (`max_blocks_held`). Releasing while the previous
    step still runs (async scheduling) is safe: that step may still read a released block, but any step
    that reuses the block, this one included, runs after it (steps run in order on one stream).
    """

    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None = None) -> None:
        if sliding_window is not None and (
            isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.block_tables: dict[str, list[int]] = {}
        # request id -> how many of its leading blocks were offered to the prefix cache already
        self.num_registered_blocks: dict[str, int] = {}
        # request id -> how many of its leading block-table entries it released (sliding window only)
        self.num_released_blocks: dict[str, int] = {}
        self._last_lookup: _Lookup | None = None  # see find_cached_prefix

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks the request holds a reference on: its block table less the released entries."""
        return self.block_tables.get(request_id, [])[self.num_released_blocks.get(request_id, 0) :]

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once when a step computes at most
        `max_chunk` of them: all its blocks, or under a sliding window W those of the W − 1 + max_chunk
        positions c − W + 1 .. c + max_chunk − 1 of one step (an interval of L positions touches at most
        ⌈(L − 1) / block_size⌉ + 1 blocks)."""
        bs = self.block_size
        full = math.ceil(num_tokens / bs)
        if self.sliding_window is None:
            return full
        span = self.sliding_window - 1 + max_chunk
        return min(full, (span + bs - 2) // bs + 1)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens, verified token by token.

        At most `num_tokens - 1` tokens are taken from the cache, so that at least one token is
        computed and yields the logits to sample from. Empty for a request that skips reading the cache.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return []
        bs = self.block_size
        hashes, tokens, lookup = request.block_hashes, request.token_ids, self.pool.lookup
        max_blocks = (request.num_tokens - 1) // bs
        hits: list[int] = []
        parent = None
        start = 0
        memo = self._last_lookup
        if memo is not None and memo.epoch == self.pool.epoch and not hashes:
            start = _common_blocks(tokens, memo.token_ids, min(len(memo.hits), max_blocks), bs)
            if start:  # the previous lookup's leading hits are still cached (nothing evicted since)
                hashes.extend(memo.block_hashes[:start])
                hits = memo.hits[:start]
                parent = hashes[start - 1]
        # Then one pass: each block's hash is computed (once per request) just before its lookup, and
        # the walk stops at the first miss; later blocks' hashes wait until they are offered to the cache.
        for i in range(start, max_blocks):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            if i < len(hashes):
                block_hash = hashes[i]
            else:
                block_hash = hash_block(parent, block_tokens)
                hashes.append(block_hash)
            block_id = lookup(block_hash, parent, block_tokens)
            if block_id is None:
                break
            hits.append(block_id)
            parent = block_hash
        self._last_lookup = _Lookup(tokens, hashes, hits, self.pool.epoch)
        return hits

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup in the pool's statistics (none for a request that skips it)."""
        if self.enable_caching and not request.skip_reading_prefix_cache:
            self.pool.stats.queried_tokens += request.num_tokens
            self.pool.stats.hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Make room in the request's block table for the tokens a step computes.

        Args:
            request: The request; its `num_computed_tokens` tokens already have slots.
            num_new_tokens: The tokens to make room for, after the computed ones and `cached_blocks`.
            cached_blocks: Cached prefix blocks the request adopts (at admission).

        Returns:
            Whether the pool had the blocks; when not, nothing is changed (except, under a sliding
            window, the release of blocks that have left it, which is due whatever happens next).
        """
        table = self.block_tables.setdefault(request.request_id, [])
        if self.sliding_window is not None:
            return self._allocate_sliding(request, num_new_tokens, cached_blocks, table)
        if not cached_blocks and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return True  # the common decode step: the last block still has room
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_required = math.ceil((num_computed + num_new_tokens) / self.block_size)
        num_new_blocks = max(0, num_required - len(table) - len(cached_blocks))
        # Adopting a cached block that sits in the LRU takes it out of the free count.
        num_revived = self.pool.count_evictable(cached_blocks)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            if not table:
                del self.block_tables[request.request_id]
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            table.extend(cached_blocks)
            self.num_registered_blocks[request.request_id] = len(table)
        if num_new_blocks:
            table.extend(self.pool.allocate(num_new_blocks))
        return True

    def _allocate_sliding(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int], table: list[int]
    ) -> bool:
        """`allocate_slots` under a sliding window: release the blocks that left the window of the
        step's first token, adopt only the cached blocks inside it, then allocate (class docstring)."""
        bs, rid = self.block_size, request.request_id
        num_computed = request.num_computed_tokens + len(cached_blocks) * bs
        first_kept = max(0, num_computed - self.sliding_window + 1) // bs  # the first block still read
        released = self.num_released_blocks.get(rid, 0)
        if first_kept > released and len(table) > released:
            self._release(request, table, released, min(first_kept, len(table)))
        if not cached_blocks and num_computed + num_new_tokens <= len(table) * bs:
            return True  # the common decode step: the last block still has room
        num_required = math.ceil((num_computed + num_new_tokens) / bs)
        num_new_blocks = max(0, num_required - len(table) - len(cached_blocks))
        skipped = max(0, min(len(cached_blocks), first_kept - len(table)))  # cached, below the window
        adopted = cached_blocks[skipped:]
        num_revived = self.pool.count_evictable(adopted)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            if not table:
                del self.block_tables[rid]
            return False
        if cached_blocks:
            if skipped:  # entries never held: released from the start
                self.num_released_blocks[rid] = len(table) + skipped
            self.pool.touch(adopted)
            table.extend(cached_blocks)
            self.num_registered_blocks[rid] = len(table)
        if num_new_blocks:
            table.extend(self.pool.allocate(num_new_blocks))
        return True

    def _release(self, request: Request, table: list[int], start: int, stop: int) -> None:
        """Drop the request's references on table[start:stop] (blocks that left its window), offering
        them to the prefix cache first; entries that cannot be offered now never will be."""
        rid = request.request_id
        if self.enable_caching:
            self.cache_full_blocks(request, request.num_computed_tokens)
            if self.num_registered_blocks.get(rid, 0) < stop:
                self.num_registered_blocks[rid] = stop
        self.pool.free(reversed(table[start:stop]))
        self.num_released_blocks[rid] = stop

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Offer the request's full blocks among its first `num_tokens` tokens (default: the computed
        ones) to the prefix cache.

        A block may be offered as soon as the step that writes its K/V is scheduled: every later reader
        runs after that write, since steps run in order on one stream and, within a step, each layer
        writes the K/V of all its rows before any row attends. A block's token ids must be known, so
        decode inputs still being sampled (PLACEHOLDER) are never offered early.
        """
        if not self.enable_caching:
            return
        rid = request.request_id
        upto = request.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(upto, len(request.token_ids)) // self.block_size
        start = self.num_registered_blocks.get(rid, 0)
        if num_full <= start:
            return  # the common case: no block filled up in this step
        table = self.block_tables.get(rid)
        if not table:
            return
        self._update_block_hashes(request)
        bs = self.block_size
        for i in range(start, num_full):
            parent = request.block_hashes[i - 1] if i else None
            self.pool.cache_block(table[i], request.block_hashes[i], parent, request.token_ids[i * bs : (i + 1) * bs])
        self.num_registered_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (see BlockPool.free)."""
        table = self.block_tables.pop(request.request_id, [])
        self.num_registered_blocks.pop(request.request_id, None)
        released = self.num_released_blocks.pop(request.request_id, 0)
        self.pool.free(reversed(table[released:]))

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            hashes.append(hash_block(hashes[i - 1] if i else None, request.token_ids[i * bs : (i + 1) * bs]))
