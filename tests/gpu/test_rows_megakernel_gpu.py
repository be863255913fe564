"""The rows megakernel on the GPU: one program per SM, grid barriers, units dealt over every program,
attention splits merged by tickets across programs, against the layer loop of the same weights at real
shapes (`llama-3.2-1b`, `llama-3.2-3b`'s groups of 3 query heads, a Qwen2.5 bias shape, Mistral's window,
Qwen3-4B's q/k norms).

float32 (TF32 off): the order of float32 sums only, 1e-5 relative (the CPU interpreter's 2-layer test
shows ~4e-7); bfloat16: the 4e-2 bound of tests/models. The new K/V land in their slots and nowhere
else; the counters and tickets are zero after each launch, and a second launch, and a CUDA graph's
replay, give the same bits (a race between phases or programs shows there first). Padding rows of a
graph bucket (context 0, slot −1) change nothing.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_megakernel_gpu import setup
from tinyvllm.config import RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.engine.paths.megakernel import stack_weights
from tinyvllm.engine.paths.rows_megakernel import RowsMegakernel
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.rows_megakernel import RowsConfig

pytestmark = pytest.mark.gpu
BLOCK = 16

SHAPES = {
    "llama-3.2-1b": ("llama-3.2-1b", {}),
    "llama-3.2-3b-4layers": ("llama-3.2-3b", {"num_hidden_layers": 4}),
    "qwen2.5-bias": ("qwen2.5-1.5b", {"num_key_value_heads": 3, "num_hidden_layers": 4}),
    "mistral-window": ("mistral-7b", {"num_hidden_layers": 4, "sliding_window": 512}),
    "qwen3-4b-4layers": ("qwen3-4b", {"num_hidden_layers": 4}),
}


def rows_step(seq_lens: list[int], num_blocks: int, padded: int = 0, seed: int = 0):
    """A decode step of len(seq_lens) rows on distinct shuffled blocks, `padded` padding rows more."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens) + padded, max(pages), dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = order[at : at + p]
        at += p
    slots = [int(table[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(seq_lens)] + [-1] * padded
    lens = seq_lens + [0] * padded
    i32, dev = torch.int32, "cuda"
    meta = AttnMetadata(
        slot_mapping=torch.tensor(slots, device=dev),
        num_decode_tokens=len(lens),
        decode_seq_lens=torch.tensor(lens, dtype=i32, device=dev),
        decode_block_tables=table.to(dev),
        max_decode_seq_len=max(lens),
        num_prefills=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=i32, device=dev),
        prefill_seq_lens=torch.zeros(0, dtype=i32, device=dev),
        prefill_block_tables=table[:0].to(dev),
        max_prefill_q_len=0,
        max_prefill_seq_len=0,
    )
    ids = torch.randint(0, 1000, (len(lens),), generator=gen)
    ids[len(seq_lens) :] = 0
    return ids.cuda(), torch.tensor([max(n - 1, 0) for n in lens], device=dev), meta


def run(model, rows, ids, pos, meta, kv):
    paths = ModelExecutor(model, RunnerConfig(decode_megakernel=False, pruned_lm_head=False), "cuda")
    paths.rows_megakernel = rows
    views = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    with torch.no_grad():
        hidden = paths.hidden_states(ids, pos, meta, views)
        return hidden, paths.lm_head.logits(hidden, dtype=torch.float32)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "config",
    [
        RowsConfig(),
        RowsConfig(rows=32, chunk=512, stages=3),
        RowsConfig(kv_align=1, kv_stages=5, num_warps=8),  # phase B's aligned, prefetched K/V tiles; 8 warps
        RowsConfig(kv_align=0, kv_stages=3),  # the unhinted 2-byte K/V loads
    ],
    ids=["default", "r32", "aligned-w8", "unaligned"],
)
def test_rows_megakernel_equals_layer_loop(shape, dtype, config):
    torch.backends.cuda.matmul.allow_tf32 = False
    preset, overrides = SHAPES[shape]
    model, kv = setup(dtype, preset, overrides)
    rows = RowsMegakernel(model, stack_weights(model), config)
    for seq_lens in ([1, 700], [33, 700, 64, 5, 300, 2, 129], [20 + 7 * i for i in range(16)]):  # ≤ 128 blocks
        ids, pos, meta = rows_step(seq_lens, kv.shape[2], seed=len(seq_lens))
        kv_ref, kv_mk = kv.clone(), kv.clone()
        h_ref, l_ref = run(model, None, ids, pos, meta, kv_ref)
        h, logits = run(model, rows, ids, pos, meta, kv_mk)
        tol = 1e-5 if dtype == torch.float32 else 4e-2
        for i in range(len(seq_lens)):
            assert rel(h[i], h_ref[i]) <= tol and rel(logits[i], l_ref[i]) <= tol, (seq_lens, i, rel(h[i], h_ref[i]))
        blk, off = meta.slot_mapping // BLOCK, meta.slot_mapping % BLOCK
        assert rel(kv_mk[:, :, blk, :, off], kv_ref[:, :, blk, :, off]) <= tol
        kv_mk[:, :, blk, :, off] = kv_ref[:, :, blk, :, off]
        assert torch.equal(kv_mk, kv_ref)
        ws = rows.workspace
        assert int(ws.barrier.abs().sum()) == 0 and int(ws.tickets.abs().sum()) == 0
        again, _ = run(model, rows, ids, pos, meta, kv.clone())
        assert torch.equal(again, h)


def test_rows_megakernel_graph_replay_and_padding_rows_are_bitwise_stable():
    """A CUDA graph of a padded 16-row bucket (9 live rows) replayed 20 times: the live rows equal an eager
    launch bitwise each time, and no padding row wrote into the cache."""
    model, kv = setup(torch.bfloat16)
    rows = RowsMegakernel(model, stack_weights(model))
    seq_lens = [40 * (i + 1) for i in range(9)]
    ids, pos, meta = rows_step(seq_lens, kv.shape[2], padded=7, seed=5)
    eager_kv = kv.clone()
    eager, _ = run(model, rows, ids, pos, meta, eager_kv)
    graph_kv = kv.clone()
    run(model, rows, ids, pos, meta, graph_kv)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = run(model, rows, ids, pos, meta, graph_kv)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:9], eager[:9])
    assert torch.equal(graph_kv, eager_kv)
