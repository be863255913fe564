"""Programmatic dependent launch on the GPU (kernels/pdl.py): the fused path's kernels launched as
dependents give the same bits as the same kernels launched the ordinary way, eagerly and as a CUDA
graph replayed many times back to back. A kernel that read the previous kernel's output before its
wait, or wrote before it, would show here as a differing row (a race needs the real overlap, which the
CPU cannot produce; tests/kernels/test_pdl_codegen.py checks the same contract in the compiled code).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_megakernel_gpu import setup
from tests.gpu.test_rows_megakernel_gpu import rows_step
from tinyvllm.config import RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.engine.paths.fused import fused_forward
from tinyvllm.kernels.pdl import programmatic_launches, supported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not supported(torch.device("cuda")), reason="PDL needs sm_90+"),
]

SHAPES = {"llama-3.2-1b": ("llama-3.2-1b", {}), "qwen3-4b-4layers": ("qwen3-4b", {"num_hidden_layers": 4})}


def step(model, paths, ids, pos, meta, kv, pdl: bool):
    """Hidden states and logits of one fused-path step over every product by our kernels, its kernels
    launched with PDL or not; `kv` [layers, 2, ...] is written in place."""
    views = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    paths.lm_head.pdl = pdl
    with torch.no_grad(), programmatic_launches(pdl):
        hidden = fused_forward(model, ids, pos, meta, views, pdl=True)
        return hidden, paths.lm_head.logits(hidden, dtype=None)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [2, 8, 16])
def test_dependent_launches_give_the_same_bits(shape, rows):
    preset, overrides = SHAPES[shape]
    model, kv = setup(torch.bfloat16, preset, overrides)
    paths = ModelExecutor(
        model, RunnerConfig(fused_max_tokens=16, pdl=True, decode_megakernel=False, pruned_lm_head=False), "cuda"
    )
    assert paths.pdl and paths.uses_fused_path(rows)
    ids, pos, meta = rows_step([11 * (i + 1) + 5 for i in range(rows)], kv.shape[2], seed=rows)  # ≤ 129 blocks
    kv_ref, kv_pdl = kv.clone(), kv.clone()
    h_ref, l_ref = step(model, paths, ids, pos, meta, kv_ref, pdl=False)
    h, logits = step(model, paths, ids, pos, meta, kv_pdl, pdl=True)
    assert torch.equal(h, h_ref) and torch.equal(logits, l_ref)
    assert torch.equal(kv_pdl, kv_ref)


def test_a_graph_of_dependent_launches_replays_the_same_bits():
    """A CUDA graph of a 16-row step (9 live rows, 7 padding rows) captured with PDL, replayed 50 times
    back to back and checked after each of 10 more: equal to the ordinary eager launches each time."""
    model, kv = setup(torch.bfloat16)
    paths = ModelExecutor(model, RunnerConfig(fused_max_tokens=16, pdl=True, pruned_lm_head=False), "cuda")
    ids, pos, meta = rows_step([40 * (i + 1) for i in range(9)], kv.shape[2], padded=7, seed=3)
    eager_kv = kv.clone()
    eager, eager_logits = step(model, paths, ids, pos, meta, eager_kv, pdl=False)
    graph_kv = kv.clone()
    step(model, paths, ids, pos, meta, graph_kv, pdl=True)  # warm-up: compiles, allocates the split-K counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, logits = step(model, paths, ids, pos, meta, graph_kv, pdl=True)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:9], eager[:9]) and torch.equal(logits[:9], eager_logits[:9])
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:9], eager[:9]) and torch.equal(logits[:9], eager_logits[:9])
    assert torch.equal(graph_kv, eager_kv)


@pytest.mark.parametrize("seq_lens", [[2000], [900, 1000], [40 * (i + 1) for i in range(9)]])
def test_the_layer_loop_with_dependent_launches_gives_the_same_bits(seq_lens):
    """The layer loop under `pdl` (the cache write, attention's splits and their merge as dependents; long
    contexts so that the merge runs) against the same executor without it."""
    model, kv = setup(torch.bfloat16)
    on, off = (
        ModelExecutor(model, RunnerConfig(pdl=pdl, fused_gemv=False, decode_megakernel=False), "cuda")
        for pdl in (True, False)
    )
    assert not on.uses_fused_path(len(seq_lens)) and on.megakernel is None
    ids, pos, meta = rows_step(seq_lens, kv.shape[2], seed=len(seq_lens))
    outs = []
    for paths in (on, off):
        cache = kv.clone()
        views = [(cache[i, 0], cache[i, 1]) for i in range(cache.shape[0])]
        with torch.no_grad():
            hidden = paths.hidden_states(ids, pos, meta, views)
            outs.append((hidden, paths.lm_head.logits(hidden, dtype=None), cache))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
