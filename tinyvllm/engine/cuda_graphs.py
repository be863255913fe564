"""Decode steps as CUDA graphs: one graph per bucketed batch size, over static input buffers.

A decode-only step of B sequences replays the graph of the smallest bucket ≥ B. Its inputs are copied
into the static buffers first; rows B..bucket−1 are padding (slot −1 writes nowhere, length 0 attends to
nothing). The graph runs embedding → layers → final norm → logits and, with `sample_in_graph`, the fused
greedy/Gumbel sampler over static per-row temperatures and seeds (copied in before each replay; its ids
are used for the rows that sampler serves, the rest take the logits to the full sampler). Two Triton
launches fewer per step on the host: at batch 1 the host's step is otherwise longer than the device's.
Graphs share one memory pool and are captured largest first.
"""
from __future__ import annotations

import logging
import time

import torch

from tinyvllm.models.attention_metadata import AttnMetadata
from tinyvllm.models.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int, limit: int = 256) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to min(max_num_seqs, limit) (vLLM's buckets)."""
    top = min(max_num_seqs, limit)
    sizes = [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Args: `cascade_batch_sizes`: buckets that also get a cascade-attention graph (decode rows that
    share a prefix attend it once per chunk of rows; the prefix length is a static device buffer, so one
    graph serves any length)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], *, batch_sizes: list[int],
                 max_blocks_per_seq: int, max_seq_len: int, device: torch.device,
                 cascade_batch_sizes: list[int] = (), sample_in_graph: bool = False) -> None:
        self.model = model
        self.sample_in_graph = sample_in_graph
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.max_seq_len = max_seq_len
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.prefix_len = torch.zeros(1, dtype=torch.int32, device=device)
        self.temperatures = torch.zeros(n, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=device)
        self.cascade_batch_sizes = sorted(b for b in cascade_batch_sizes if b in self.batch_sizes)
        self.logits = torch.empty(0)
        # (batch size, cascade) -> graph, and its (logits, sampled ids or None) buffers
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def bucket(self, batch_size: int) -> int | None:
        for b in self.batch_sizes:
            if b >= batch_size:
                return b
        return None

    def _meta(self, bs: int, cascade: bool) -> AttnMetadata:
        empty = self.seq_lens[:0]
        return AttnMetadata(
            slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs, decode_seq_lens=self.seq_lens[:bs],
            decode_block_tables=self.block_tables[:bs], max_decode_seq_len=self.max_seq_len,
            num_prefills=0, prefill_cu_seqlens_q=self.seq_lens[:1], prefill_seq_lens=empty,
            prefill_block_tables=self.block_tables[:0], max_prefill_q_len=0, max_prefill_seq_len=0,
            decode_prefix_len=self.prefix_len if cascade else None)

    def _run(self, bs: int, cascade: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs, cascade), self.kv_caches)
        logits = self.model.compute_logits(hidden, dtype=None)
        if not self.sample_in_graph:
            return logits, None
        from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

        return logits, sample_greedy_or_gumbel(logits, self.temperatures[:bs], self.seeds[:bs])

    @torch.no_grad()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):
                for cascade in (False, True) if bs in self.cascade_batch_sizes else (False,):
                    self._run(bs, cascade)  # warm-up: compiles kernels, sizes workspaces
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._outputs[bs, cascade] = self._run(bs, cascade)
                    self.graphs[bs, cascade] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.warning("captured CUDA graphs for decode batch sizes %s (with cascade attention too: %s) in "
                       "%.1f s (enforce_eager=True turns this off)", self.batch_sizes, self.cascade_batch_sizes,
                       time.perf_counter() - start)

    def replay(self, bs: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               seq_lens: torch.Tensor, block_tables: torch.Tensor, prefix_len: torch.Tensor | None = None,
               temperatures: torch.Tensor | None = None, seeds: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy one padded decode step (`bs` rows of ids/positions/slots/lengths, and the block table of
        its real rows) into the static buffers, replay, and return (logits [bs, V], sampled ids [bs] or
        None), static buffers valid until the next replay of this bucket. `prefix_len` (device int32 [1],
        or None): replay the cascade graph with that shared prefix (see kernels.decode_attention); `bs`
        must then be a cascade size. With `sample_in_graph`, `temperatures` and `seeds` (the first rows'
        sampler inputs; the other rows keep stale values and their ids mean nothing) are copied in
        first; without them the sampled ids are those of the previous values."""
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[:bs].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:bs].copy_(seq_lens, non_blocking=True)
        rows, width = block_tables.shape
        self.block_tables[:rows, :width].copy_(block_tables, non_blocking=True)
        cascade = prefix_len is not None
        if cascade:
            self.prefix_len.copy_(prefix_len, non_blocking=True)
        if temperatures is not None:
            self.temperatures[:temperatures.shape[0]].copy_(temperatures, non_blocking=True)
        if seeds is not None:
            self.seeds[:seeds.shape[0]].copy_(seeds, non_blocking=True)
        self.graphs[bs, cascade].replay()
        return self._outputs[bs, cascade]
