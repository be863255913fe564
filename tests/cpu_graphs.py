"""Decode graphs on the CPU for engine tests: `CpuGraphs` runs the engine's graph-step code (input arenas,
host twins, placeholder gathers, lazy capture) where CUDA graphs do not exist.

"capture" runs the bucket's warm-up step over the arena exactly as the CUDA capture does (the run that
must not write any KV cache slot once traffic has filled the arena) and marks its graphs captured;
"replay" runs the captured step's function eagerly and may only replay captured graphs.
"""

from __future__ import annotations

import torch

from tinyvllm.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes


class CpuGraphs(DecodeGraphs):
    """DecodeGraphs on the CPU (module docstring); `events` logs ("capture", bucket) and ("replay", bucket)
    in order."""

    def __init__(self, *args, events: list, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events = events

    def _synchronize(self) -> None:
        pass

    def _capture_keys(self, keys) -> float:
        for key in keys:
            self._run(*key)  # the warm-up run of a CUDA capture, over the (reset) arena
            self.graphs[key] = None
        self.events.append(("capture", keys[0][0]))
        return 0.0

    def _replay(self, key):
        assert key in self.graphs, f"replay of graph {key}, which was not captured"
        self.events.append(("replay", key[0]))
        return self._run(*key)


def install_cpu_graphs(runner, max_seq_len: int, events: list, sample_in_graph: bool = False) -> CpuGraphs:
    """Give a CPU engine's runner lazily captured `CpuGraphs` over its `graph_batch_sizes` buckets (the
    engine's default lazy capture then captures them as CUDA graphs would be); returns them."""
    assert runner.config.graph_capture == "lazy"  # the engine's default
    runner.graphs = CpuGraphs(
        runner.executor,
        runner.kv_caches,
        batch_sizes=graph_batch_sizes(runner.builder_rows),
        max_blocks_per_seq=runner.builder.tables.max_blocks_per_seq,
        max_seq_len=max_seq_len,
        device=torch.device("cpu"),
        resolve_placeholders=runner.ops.resolve_placeholders,
        max_num_seqs=runner.builder_rows,
        sample_in_graph=sample_in_graph,
        sample_in_lm_head=False,
        events=events,
    )
    return runner.graphs
