"""Decode steps as CUDA graphs: one graph per bucketed batch size, over one static input arena.

A decode-only step of B sequences replays the graph of the smallest bucket ≥ B. Every input a graph
reads (ids, positions, slots, lengths, block tables, cascade prefix length, placeholder sources, the
sampler's temperatures and seeds) is a view of one device byte buffer, the input arena
(engine/input_arena.py). The runner packs a step into one of two pinned host twins of the arena and
copies its used prefix over in ONE host-to-device copy (for a few rows, a kernel reading the pinned
twin: kernels/host_copy.py); rows B..bucket−1 are padding (slot −1 writes
nowhere, length 0 attends to nothing). A graph step's stream work outside the graph is then that copy,
the replay, the copy of the sampled ids to the host and an event (plus one device copy of the previous
step's sampled ids into `last_sampled`, when they are not there already; see `feed_previous_samples`).

Each graph runs: placeholder gather (async scheduling: `input_ids[i] = last_sampled[src[i]]` for the
rows whose input is the previous step's sampled id, one launch) → embedding → layers → final norm →
logits and, with `sample_in_graph`, the fused greedy/Gumbel sampler over the arena's per-row
temperatures and seeds (inside the LM head's kernel where that is the fused product), writing its ids
into `last_sampled` (they are used for the rows that sampler serves; the rest take the logits to the full
sampler). Graphs share one memory pool.

When: `capture()` captures every bucket, largest first (`graph_capture="eager"`, the engine's start-up
then pays for them all: ~10 s for the 1B shape with cold kernels). By default (`"lazy"`) the engine is
ready with no graph: a decode step whose bucket has none runs eagerly and `want`s it, and the engine
captures it (`capture_bucket`) before its next step, with no step in flight: a capture runs the model
once per graph over the arena, and a graph must not be captured while another step runs on the device.
A serving engine with no request captures the rest one bucket per idle moment, largest first
(`next_capture`). Capture after traffic first resets the arenas to padding, so the warm-up run writes no
KV cache slot; the graphs then replay exactly as if captured at start-up.

Buckets of at most `io_max_rows` rows (with `sample_in_graph`) instead do their own copies, over an
arena of their own (io_max_rows rows, so that a step's bytes are a few hundred): two graphs per bucket,
one per host twin, each starting with a kernel that copies the step's bytes from that pinned twin and
gathers the placeholders (kernels/arena_load.py) and ending with a sampler that also writes the ids into
the twin's `sampled_ids` (kernels/sampling.py). A batch-1 step is then one graph launch and an event,
without copy kernels outside the graph and the device's idle time at their hand-overs. With
`pruned_lm_head` those buckets get a second pair of graphs whose sampler reads the LM head at one byte per
weight (`LMHead.sample_pruned`, kernels/lm_head_bounds.py: the same ids, no logits), for the steps whose
every row that sampler serves, and a third pair that stops at the final norm's hidden state: a constrained
step replays it, fills its token bitmask while the device runs it, then copies the bitmask into a static
device buffer (`step_mask`) and replays a fourth pair, the pruned head under that mask over the third
pair's hidden state (`replay_masked_head`), so a constrained batch-1 step keeps the pruned head and
launches one graph for it instead of its three kernels.

With `sample_in_graph`, every graph that computes logits also gets a truncating sampler graph, captured
with it: the fused top-k/top-p/min-p sampler (kernels/top_p_sampling/) over that graph's logits and the
arena's per-row temperatures, seeds and filters, writing its ids into `last_sampled` (and the twin's
`sampled_ids` for the buckets that do their own copies). A step with rows that sampler serves replays it
right after the forward's graph (`replay_truncating`), instead of launching the sampler's kernels
eagerly. A row without a filter costs that sampler no read of its logits and draws the id of the plain
fused kernel, so one launch serves the step's plain and truncating rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tinyvllm.engine.input_arena import InputArena
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.models.decoder import KVCache

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int, limit: int = 256) -> list[int]:
    """Powers of two up to 128, then multiples of 32, up to min(max_num_seqs, limit) (which is always one).

    A step of B rows replays the smallest bucket b ≥ B, so it computes b − B padding rows: their attention
    is empty (length 0) and their sampling is dropped, so what they cost is their rows of the matrix
    products. A bf16 product reads each 2-byte weight once and does 2 FLOPs per weight per row, B FLOPs
    per byte: below the device's ridge point (H200, docs/workloads.md: 705 TFLOP/s / 4.25 TB/s ≈ 170) the step is
    bound by the weight reads, which padding does not add to, so padded rows are nearly free and powers of
    two suffice (vLLM's multiples of 8 there buy nothing). From 128 rows the products near the ridge, and
    a padded row costs compute: steps of 32 keep the waste at most 31 rows (≤ 24 % at 129, ≤ 14 % from
    224; half that on average). Each bucket saved is a graph (or, with cascade attention, two) less to
    capture: 12 buckets instead of vLLM's 35 for 256 sequences.
    """
    top = min(max_num_seqs, limit)
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= top] + list(range(160, top + 1, 32))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """The captured decode graphs of one engine and their input arenas (module docstring).

    Args:
        executor: runs the model and its LM head by the paths the runner configured.
        kv_caches: the per-layer K/V cache tensors the graphs read and write.
        batch_sizes: the buckets, one graph (or more, below) each.
        max_blocks_per_seq, max_seq_len: size the arena's block tables and the attention launch.
        resolve_placeholders: the ops table's placeholder gather (kernels.placeholders, or the torch
            reference).
        max_num_seqs: the most rows a step samples (sizes `last_sampled`, which any step's sampled ids
            may be copied into).
        cascade_batch_sizes: buckets that also get a cascade-attention graph (decode rows that share a
            prefix attend it once per chunk of rows; the prefix length is in the arena, so one graph
            serves any length).
        sample_in_graph: the graphs end with the fused greedy/Gumbel sampler.
        io_max_rows: buckets that load their own inputs (module docstring).
        sample_in_lm_head: with `sample_in_graph`, the sampler inside the LM head's kernel where the LM
            head's fused product computes the logits (`LMHead.logits_sampled`).
        pruned_lm_head: the `runs_io` buckets also get graphs that sample through the pruned LM head
            (module docstring), where the LM head can (`LMHead.can_sample_pruned`).
    """

    def __init__(
        self,
        executor: ModelExecutor,
        kv_caches: list[KVCache],
        *,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
        resolve_placeholders: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        max_num_seqs: int = 0,
        cascade_batch_sizes: list[int] = (),
        sample_in_graph: bool = False,
        io_max_rows: int = 0,
        sample_in_lm_head: bool = True,
        pruned_lm_head: bool = False,
    ) -> None:
        self.executor = executor
        self.sample_in_lm_head = sample_in_lm_head
        self.io_max_rows = io_max_rows if sample_in_graph else 0
        self.sample_in_graph = sample_in_graph
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.max_seq_len = max_seq_len
        self.resolve_placeholders = resolve_placeholders
        n = self.max_bs
        self.arena = InputArena(n, max_blocks_per_seq, device)
        pin = device.type == "cuda"
        # Two host twins, used alternately: a pinned buffer must not be rewritten before its copy has
        # run. Every graph step samples, so it records an event after its copy (in stream order), and
        # the engine waits for step N's event before it launches step N+2.
        self._host_arenas = [InputArena(n, max_blocks_per_seq, torch.device("cpu"), pin_memory=pin) for _ in range(2)]
        self._num_host_arenas_used = 0
        # The buckets that load their own inputs have an arena (and twins) of their own, io_max_rows rows:
        # a step's bytes start with its per-row regions, whose size is the arena's row count.
        rows = self.io_max_rows
        self.pruned_lm_head = (
            pruned_lm_head and sample_in_lm_head and rows == 1 and executor.lm_head.can_sample_pruned(1)
        )
        self.io_arena = InputArena(rows, max_blocks_per_seq, device) if rows else None
        self._io_host_arenas = [
            InputArena(rows, max_blocks_per_seq, torch.device("cpu"), pin_memory=pin) for _ in range(2 if rows else 0)
        ]
        self._num_io_arenas_used = 0
        # The bitmask a constrained `runs_io` step's pruned head samples under ("masked" graphs)
        self.step_mask = None
        if self.pruned_lm_head:
            from tinyvllm.sampling.bitmask import bitmask_width

            width = bitmask_width(executor.lm_head.weight.shape[0])
            self.step_mask = torch.full((rows, width), -1, dtype=torch.int32, device=device)
        # The previous step's sampled ids, where the graphs' placeholder gather reads them; the graphs'
        # sampler writes its ids here.
        self.last_sampled = torch.zeros(max(n, max_num_seqs), dtype=torch.int64, device=device)
        self.cascade_batch_sizes = sorted(b for b in cascade_batch_sizes if b in self.batch_sizes)
        # (batch size, cascade, host twin or None, head) -> graph, and its (logits or None, sampled ids or
        # None) buffers; the twin's index for the buckets that load their own inputs (`runs_io`), else None;
        # head: "logits" (the LM head's product), "pruned" (samples through the pruned LM head, no logits),
        # "hidden" (stops at the final norm: its buffers are (hidden states, None)) or "masked" (the
        # pruned head alone, under `step_mask`, over the "hidden" graph's output)
        self.graphs: dict[tuple[int, bool, int | None, str], torch.cuda.CUDAGraph] = {}
        # forward key (head "logits") -> its truncating sampler's graph and sampled ids (module docstring)
        self._truncating: dict[tuple[int, bool, int | None, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._outputs: dict[tuple[int, bool, int | None, str], tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.captured: set[int] = set()  # buckets whose graphs exist
        self.wanted: list[int] = []  # buckets a step needed before they were captured, in that order
        # (bucket, warm-up seconds, capture seconds) of each capture, in capture order
        self.capture_log: list[tuple[int, float, float]] = []
        self._pool = None  # the graphs' shared memory pool, made by the first capture

    def bucket(self, batch_size: int) -> int | None:
        for b in self.batch_sizes:
            if b >= batch_size:
                return b
        return None

    def runs_io(self, bs: int) -> bool:
        """Whether bucket `bs`'s graphs copy their own inputs and ids (module docstring)."""
        return bs <= self.io_max_rows

    def _run(
        self, bs: int, cascade: bool, twin: int | None = None, head: str = "logits"
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's device work over the arena; `twin`: first load it from that host twin, and
        write the sampled ids back there too; `head` "pruned": sample through the pruned LM head (no
        logits); "hidden": stop at the hidden states, (hidden, None); "masked": only the pruned head under
        `step_mask`, over the hidden states of the same key's "hidden" graph."""
        a = self.arena if twin is None else self.io_arena
        host = None if twin is None else self._io_host_arenas[twin]
        lm_head = self.executor.lm_head
        host_ids = None if host is None else host.sampled_ids[:bs]
        if head == "masked":
            hidden = self._outputs[(bs, cascade, twin, "hidden")][0]
            ids = self.last_sampled[:bs]
            lm_head.sample_pruned(hidden, a.temperatures[:bs], a.seeds[:bs], ids, host_ids, bitmask=self.step_mask[:bs])
            return None, ids
        if host is None:
            self.resolve_placeholders(a.input_ids[:bs], a.placeholder_src[:bs], self.last_sampled)
        else:
            from tinyvllm.kernels.arena_load import load_arena

            load_arena(a.buffer, host.buffer, a.input_ids[:bs], a.placeholder_src[:bs], self.last_sampled)
        meta = a.decode_meta(bs, self.max_seq_len, cascade)
        hidden = self.executor.hidden_states(a.input_ids[:bs], a.positions[:bs], meta, self.kv_caches)
        if head == "hidden":
            return hidden, None
        if head == "pruned":
            lm_head.sample_pruned(hidden, a.temperatures[:bs], a.seeds[:bs], self.last_sampled[:bs], host_ids)
            return None, self.last_sampled[:bs]
        if self.sample_in_graph and self.sample_in_lm_head:
            logits = lm_head.logits_sampled(hidden, a.temperatures[:bs], a.seeds[:bs], self.last_sampled[:bs], host_ids)
            return logits, self.last_sampled[:bs]
        logits = lm_head.logits(hidden, dtype=None)
        if not self.sample_in_graph:
            return logits, None
        from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

        return logits, sample_greedy_or_gumbel(
            logits, a.temperatures[:bs], a.seeds[:bs], out=self.last_sampled[:bs], host_out=host_ids
        )

    def _truncate(self, key: tuple[int, bool, int | None, str]) -> torch.Tensor:
        """The truncating sampler over the logits of graph `key` (its captured output buffer): ids of its
        rows into `last_sampled` (and the twin's `sampled_ids`), from the arena's per-row parameters."""
        from tinyvllm.kernels.top_p_sampling import sample_top_k_top_p

        bs, _, twin, _ = key
        a = self.arena if twin is None else self.io_arena
        host_ids = None if twin is None else self._io_host_arenas[twin].sampled_ids[:bs]
        logits = self._outputs[key][0]
        return sample_top_k_top_p(
            logits, a.temperatures[:bs], a.seeds[:bs], a.top_k[:bs], a.top_p[:bs], a.min_p[:bs],
            out=self.last_sampled[:bs], host_out=host_ids,
        )  # fmt: skip

    def _keys(self, sizes: list[int] | None = None) -> list[tuple[int, bool, int | None, str]]:
        """Every graph of the buckets `sizes` (default: all), largest bucket first."""
        keys = []
        for bs in sorted(self.batch_sizes if sizes is None else sizes, reverse=True):
            twins = range(len(self._io_host_arenas)) if self.runs_io(bs) else (None,)
            heads = (
                ("logits", "pruned", "hidden", "masked") if self.runs_io(bs) and self.pruned_lm_head else ("logits",)
            )
            for cascade in (False, True) if bs in self.cascade_batch_sizes else (False,):
                keys += [(bs, cascade, t, h) for t in twins for h in heads]
        return keys

    # ------------------------------------------------------------------ capture
    def is_captured(self, bs: int) -> bool:
        """Whether bucket `bs`'s graphs exist (a step of that bucket can replay them)."""
        return bs in self.captured

    def want(self, bs: int) -> None:
        """Note that a step needed bucket `bs` before its graphs existed (it ran eagerly): `next_capture`
        returns it before any bucket no step has needed yet."""
        if bs not in self.captured and bs not in self.wanted:
            self.wanted.append(bs)

    def next_capture(self, idle: bool = False) -> int | None:
        """The bucket to capture next: the first wanted one; else, when `idle` (no request is running),
        the largest bucket not captured yet (largest first: smaller graphs then reuse the shared pool's
        memory); None when there is nothing to capture now."""
        if self.wanted:
            return self.wanted[0]
        if idle:
            left = [b for b in self.batch_sizes if b not in self.captured]
            return left[-1] if left else None
        return None

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket not captured yet, largest first (graph_capture="eager")."""
        start = time.perf_counter()
        for bs in sorted(set(self.batch_sizes) - self.captured, reverse=True):
            self.capture_bucket(bs)
        logger.warning(
            "captured CUDA graphs for decode batch sizes %s (with cascade attention too: %s; "
            "loading their own inputs: up to %d rows; pruned LM head: %s) in %.1f s "
            "(enforce_eager=True turns this off)",
            self.batch_sizes,
            self.cascade_batch_sizes,
            self.io_max_rows,
            self.pruned_lm_head,
            time.perf_counter() - start,
        )

    @torch.no_grad()
    def capture_bucket(self, bs: int) -> None:
        """Capture bucket `bs`'s graphs. Call it between steps with no step in flight: it resets the arenas
        and their host twins to padding (the warm-up run then writes no KV cache slot) and overwrites
        `last_sampled`, so the next step must not read the previous step's ids from there."""
        assert bs in self.batch_sizes and bs not in self.captured, bs
        start = time.perf_counter()
        self._synchronize()
        for arena in [self.arena, self.io_arena, *self._host_arenas, *self._io_host_arenas]:
            if arena is not None:
                arena.reset()
        warm_s = self._capture_keys(self._keys([bs]))
        self.captured.add(bs)
        if bs in self.wanted:
            self.wanted.remove(bs)
        self.capture_log.append((bs, warm_s, time.perf_counter() - start - warm_s))
        logger.debug("captured the decode graphs of bucket %d in %.3f s", bs, time.perf_counter() - start)

    def _synchronize(self) -> None:
        torch.cuda.synchronize()

    def _capture_keys(self, keys: list[tuple[int, bool, int | None, str]]) -> float:
        """Warm up and capture the graphs `keys` on a side stream, into the shared pool; the seconds the
        warm-up runs took (they compile the kernels' variants on first launch and size workspaces)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        warm_s = 0.0
        with torch.cuda.stream(stream):
            for key in keys:
                t = time.perf_counter()
                self._run(*key)  # warm-up: compiles kernels, sizes workspaces
                stream.synchronize()
                warm_s += time.perf_counter() - t
                graph = torch.cuda.CUDAGraph()
                # thread_local: a lazy capture runs while other threads of a server live (none of them
                # uses this private stream); only this thread's unsafe calls may not happen meanwhile
                with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                    self._outputs[key] = self._run(*key)
                self.graphs[key] = graph
                if self.sample_in_graph and key[3] == "logits":
                    t = time.perf_counter()
                    self._truncate(key)  # warm-up
                    stream.synchronize()
                    warm_s += time.perf_counter() - t
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                        ids = self._truncate(key)
                    self._truncating[key] = (graph, ids)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return warm_s

    def next_arenas(self, bs: int) -> tuple[InputArena, InputArena]:
        """(host twin, device arena) to pack the next graph step of bucket `bs` into: the `runs_io`
        buckets' own arena or the shared one, each with its two twins used alternately."""
        if self.runs_io(bs):
            host = self._io_host_arenas[self._num_io_arenas_used % 2]
            self._num_io_arenas_used += 1
            return host, self.io_arena
        host = self._host_arenas[self._num_host_arenas_used % 2]
        self._num_host_arenas_used += 1
        return host, self.arena

    def load_inputs(self, host: InputArena, nbytes: int, by_kernel: bool = False) -> None:
        """Enqueue the one host-to-device copy of a step: the first `nbytes` bytes of `host`; `by_kernel`:
        as a kernel reading the pinned host arena (kernels/host_copy.py: no copy-engine hand-over)."""
        if by_kernel:
            from tinyvllm.kernels.host_copy import kernel_copy_

            kernel_copy_(self.arena.buffer[:nbytes], host.buffer[:nbytes])
        else:
            self.arena.buffer[:nbytes].copy_(host.buffer[:nbytes], non_blocking=True)

    def holds_previous_samples(self, prev_sampled: torch.Tensor) -> bool:
        """Whether `prev_sampled` (the previous step's sampled ids) is `last_sampled`'s leading rows,
        i.e. a graph's sampler wrote them and the placeholder gather can read them where they are."""
        return prev_sampled.data_ptr() == self.last_sampled.data_ptr()

    def feed_previous_samples(self, prev_sampled: torch.Tensor) -> None:
        """Make `last_sampled` start with the previous step's sampled ids (a step with placeholder
        inputs reads them there): one device copy, unless a graph's sampler already wrote them."""
        if not self.holds_previous_samples(prev_sampled):
            self.last_sampled[: prev_sampled.shape[0]].copy_(prev_sampled, non_blocking=True)

    def replay(self, bs: int, cascade: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the graph of bucket `bs` (`cascade`: its cascade-attention graph; `bs` must then be a
        cascade size) over the arena as loaded, and return (logits [bs, V], sampled ids [bs] or None),
        static buffers valid until the next replay of this bucket (the sampled ids: of any bucket).
        With `sample_in_graph`, the sampled ids of rows past the step's sampled rows mean nothing."""
        return self._replay((bs, cascade, None, "logits"))

    def replay_io(
        self, bs: int, cascade: bool, host: InputArena, nbytes: int, pruned: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """For a `runs_io` bucket: record that the step packed into `host` (a twin from
        `next_arenas`) needs its first `nbytes` bytes, replay the graph that loads them from that
        twin, and return (logits, sampled ids on the device, the same ids in the twin's pinned
        `sampled_ids`, readable once an event recorded after this call has completed), all [bs]-row
        static buffers as `replay`'s. `pruned` (with `pruned_lm_head`; only when the in-graph sampler
        serves every row): the graph of the pruned LM head, whose logits are None."""
        twin = self._twin(host)
        host.set_copy_words(nbytes)
        logits, sampled = self._replay((bs, cascade, twin, "pruned" if pruned and self.pruned_lm_head else "logits"))
        return logits, sampled, host.sampled_ids[:bs]

    def _twin(self, host: InputArena) -> int:
        """The index of host twin `host` (the graphs' key part for it)."""
        return next(i for i, h in enumerate(self._io_host_arenas) if h is host)

    def replay_io_hidden(
        self, bs: int, cascade: bool, host: InputArena, nbytes: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`replay_io`'s step up to the final norm only (needs `pruned_lm_head`): returns (hidden [bs, H],
        the arena's temperatures [bs] and seeds [bs] on the device, the twin's pinned `sampled_ids` [bs]),
        static buffers for the caller's `LMHead.sample_pruned`, which writes the ids into `last_sampled`
        (where the next step's placeholder gather reads them) and that twin."""
        assert self.pruned_lm_head and self.runs_io(bs), "no hidden-state graph for this bucket"
        twin = self._twin(host)
        host.set_copy_words(nbytes)
        hidden, _ = self._replay((bs, cascade, twin, "hidden"))
        a = self.io_arena
        return hidden, a.temperatures[:bs], a.seeds[:bs], host.sampled_ids[:bs]

    def replay_masked_head(self, bs: int, cascade: bool, host: InputArena, bitmask: torch.Tensor) -> torch.Tensor:
        """After `replay_io_hidden(bs, cascade, host, ...)`: copy the step's host `bitmask` [bs, W] int32
        (pinned; not rewritten before the copy runs) into `step_mask` and replay the pruned head under it.
        Returns the sampled ids on the device ([bs] of `last_sampled`; also in the twin's `sampled_ids`)."""
        twin = self._twin(host)
        self.step_mask[:bs].copy_(bitmask, non_blocking=True)
        return self._replay((bs, cascade, twin, "masked"))[1]

    def replay_truncating(self, bs: int, cascade: bool, host: InputArena | None = None) -> torch.Tensor:
        """After the replay of bucket `bs`'s logits graph (`host`: the twin `replay_io` was given, for a
        `runs_io` bucket), replay its truncating sampler (module docstring) and return the sampled ids [bs]
        on the device (`last_sampled`'s leading rows; for a `runs_io` bucket also in the twin's
        `sampled_ids`). Needs `sample_in_graph`."""
        twin = None if host is None else self._twin(host)
        return self._replay_truncating((bs, cascade, twin, "logits"))

    def _replay_truncating(self, key: tuple[int, bool, int | None, str]) -> torch.Tensor:
        """Replay the truncating sampler's graph of forward graph `key`; its sampled ids."""
        graph, ids = self._truncating[key]
        graph.replay()
        return ids

    def _replay(self, key: tuple[int, bool, int | None, str]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Replay one captured graph; its output buffers."""
        self.graphs[key].replay()
        return self._outputs[key]
