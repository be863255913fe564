"""Continuous batching: one loop per step over a token budget.

Each step (vLLM v1's shape, no separate prefill phase):
  1. running requests that are decoding get one token each, then running requests part-way through
     their prompt get the next chunk, as far as `max_num_batched_tokens` allows;
  2. if a request cannot get the blocks it needs, the most recently admitted running request is
     preempted (its blocks freed, recomputed later from scratch) until it can, or until it is itself
     the victim;
  3. if nothing was preempted, waiting requests are admitted in arrival order (adopting cached prefix
     blocks; one whose `ready()` is False, its grammar still compiling, is passed over this step)
     while the budget, `max_num_seqs` and the free blocks allow; a prompt longer than the budget is
     split into chunks over several steps.
Under a sliding window (the KV cache manager's `sliding_window`) a request's blocks that have left its
window go back to the pool as it advances, so admission and preemption count only the window's blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from tinyvllm.config import SchedulerConfig, blocks_needed
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.outputs import PLACEHOLDER, ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from tinyvllm.core.request import Request, RequestStatus


class Scheduler:
    """Decides each step which requests run and how many of their tokens (module docstring)."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._released: set[str] = set()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> bool:
        """Queue a request.

        A request that can never run (an empty prompt, or one too long for the model or the KV
        cache) is finished at once with FINISHED_ERROR and a message in `request.error`.

        Returns:
            Whether the request was queued.

        Raises:
            ValueError: Its request id is in use.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        error = self._never_fits(request)
        if error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = error
            return False
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return True

    def _never_fits(self, request: Request) -> str | None:
        n, limit = request.num_prompt_tokens, self.config.max_model_len
        if n == 0:
            return "the prompt is empty; at least one token is needed"
        if n >= limit:
            return (
                f"the prompt has {n} tokens, but this model allows at most {limit} tokens in total "
                f"(prompt plus output), so the prompt must have at most {limit - 1} tokens"
            )
        kv_cache = self.kv_cache
        pool = kv_cache.pool
        if kv_cache.sliding_window is None:
            if blocks_needed(n + 1, kv_cache.block_size) > pool.num_blocks:
                return (
                    f"the prompt has {n} tokens, but the whole KV cache holds only "
                    f"{pool.num_blocks * kv_cache.block_size} tokens"
                )
            return None
        # Under a sliding window a request holds only the blocks of its window and the step's chunk.
        max_chunk = self.config.max_num_batched_tokens if self.config.enable_chunked_prefill else n
        needed = kv_cache.max_blocks_held(n + 1, max_chunk)
        if needed > pool.num_blocks:
            return (
                f"the prompt has {n} tokens and needs up to {needed * kv_cache.block_size} tokens of KV "
                f"cache at once (the {kv_cache.sliding_window}-token attention window plus a step's "
                f"chunk), but the whole KV cache holds only {pool.num_blocks * kv_cache.block_size} tokens"
            )
        return None

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (or abort) requests wherever they are; frees their blocks. Unknown ids are ignored."""
        assert status.is_finished
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = []
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self.kv_cache.free(request)
            request.status = status
            self._released.add(rid)
            done.append(request)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Choose this step's sequences and their token counts (module docstring), and allocate their
        KV-cache slots."""
        # request id -> (request, tokens this step, newly admitted); insertion order = batch order
        scheduled: dict[str, tuple[Request, int, bool]] = {}
        budget, preempted = self._schedule_running(scheduled, self.config.max_num_batched_tokens)
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)
        sequences = [self._scheduled_sequence(r, n, is_new) for r, n, is_new in scheduled.values()]
        released, self._released = frozenset(self._released), set()
        return SchedulerOutput(
            sequences=sequences,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            released_request_ids=released,
            num_preempted=preempted,
        )

    def _runnable(self) -> list[Request]:
        """The running requests that need a step: those decoding, then those part-way through their prompt."""
        max_len = self.config.max_model_len
        decoding, prefilling = [], []
        for r in self.running:  # the hot loop at large batch: plain attribute reads, no properties
            pending = r.num_pending_outputs
            total = len(r.token_ids) + pending
            todo = total - r.num_computed_tokens
            if todo == 1:
                if len(r.output_token_ids) + pending < r.max_tokens and total < max_len:
                    decoding.append(r)
                # else: every token it may still produce is already in flight
            elif todo > 1:
                prefilling.append(r)
        return decoding + prefilling

    def _schedule_running(self, scheduled: dict[str, tuple[Request, int, bool]], budget: int) -> tuple[int, int]:
        """Give the running requests their tokens within `budget`, preempting the most recently admitted
        ones where blocks run out; adds them to `scheduled`. Returns (budget left, requests preempted)."""
        kv_cache = self.kv_cache
        running_status = RequestStatus.RUNNING
        preempted = 0
        for request in self._runnable():
            if budget == 0:
                break
            if request.status is not running_status:
                continue  # preempted earlier in this loop
            n = min(len(request.token_ids) + request.num_pending_outputs - request.num_computed_tokens, budget)
            while not kv_cache.allocate_slots(request, n):
                victim = self.running[-1]
                budget += scheduled.pop(victim.request_id, (None, 0, False))[1]
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = (request, n, False)
                budget -= n
        return budget, preempted

    def _admit_waiting(self, scheduled: dict[str, tuple[Request, int, bool]], budget: int) -> int:
        """Admit waiting requests in arrival order (adopting cached prefix blocks) while the budget,
        `max_num_seqs` and the free blocks allow; adds them to `scheduled`. Returns the budget left."""
        kv_cache = self.kv_cache
        not_ready = []  # skipped this step (grammar still compiling), put back in order below
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.ready is not None and not request.ready():
                not_ready.append(self.waiting.popleft())
                continue
            if request.num_pending_outputs:
                break  # preempted while a step was sampling for it: wait for that token
            cached = kv_cache.find_cached_prefix(request)
            num_cached_tokens = len(cached) * kv_cache.block_size
            n = request.num_tokens - num_cached_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not kv_cache.allocate_slots(request, n, cached):
                break
            self.waiting.popleft()
            kv_cache.record_prefix_query(request, num_cached_tokens)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached_tokens
            self.running.append(request)
            scheduled[request.request_id] = (request, n, True)
            budget -= n
            # Offer its prompt blocks now, so that requests admitted later in this same step share
            # them instead of computing the same prefix again (see KVCacheManager.cache_full_blocks).
            kv_cache.cache_full_blocks(request, num_cached_tokens + n)
        self.waiting.extendleft(reversed(not_ready))
        return budget

    def _scheduled_sequence(self, request: Request, n: int, is_new: bool) -> ScheduledSequence:
        start = request.num_computed_tokens
        request.num_computed_tokens = start + n
        known = request.token_ids
        if n == 1:  # a decode: its input is the last known token, or the one still being sampled
            token_ids = [known[start]] if start < len(known) else [PLACEHOLDER]
        else:
            token_ids = known[start : start + n]
            if len(token_ids) < n:
                token_ids += [PLACEHOLDER] * (n - len(token_ids))
        sample = start + n == len(known) + request.num_pending_outputs
        output_index = len(request.output_token_ids) + request.num_pending_outputs
        if sample:
            request.num_pending_outputs += 1
        return ScheduledSequence(
            request.request_id,
            token_ids,
            start,
            self.kv_cache.block_tables.get(request.request_id, ()),
            sample,
            is_new,
            request.sampling_params,
            len(request.prompt_token_ids),
            known,
            output_index,
        )

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: free everything, go back to the front of the queue."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._released.add(request.request_id)

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Append the sampled tokens, register newly full blocks in the prefix cache, and apply the
        token-level stopping rules.

        Args:
            output: The step's schedule.
            runner_output: Its sampled token ids, one per sequence that samples, in schedule order.

        Returns:
            (request, new token ids) for every request that got a token, finished ones included
            (their status says so).
        """
        sampled = iter(runner_output.sampled_token_ids)
        updated = []
        requests = self.requests
        running_status = RequestStatus.RUNNING
        kv_cache = self.kv_cache
        caching = kv_cache.enable_caching
        registered = kv_cache.num_registered_blocks
        bs = kv_cache.block_size
        max_len = self.config.max_model_len
        for seq in output.sequences:
            token = next(sampled) if seq.sample else None
            request = requests.get(seq.request_id)
            if request is None:
                continue  # finished or aborted while the step ran: its token is dropped
            # Inlined test of cache_full_blocks' common case (no block filled up): one call saved a row.
            if (
                caching
                and request.status is running_status
                and min(request.num_computed_tokens, len(request.token_ids)) // bs > registered.get(seq.request_id, 0)
            ):
                kv_cache.cache_full_blocks(request)
            if token is None:
                continue
            # A request preempted after this step was launched keeps the token: it was sampled from
            # a complete context, and the recomputation will include it.
            request.num_pending_outputs -= 1
            request.output_token_ids.append(token)
            request.token_ids.append(token)
            status = request.check_stop(max_len)
            if status is not None:
                self.finish_requests(request.request_id, status)
            updated.append((request, [token]))
        return updated
