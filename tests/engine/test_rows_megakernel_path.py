"""The rows megakernel (kernels/rows_megakernel/): a decode step of 2–16 sequences in one launch, against
the torch reference forward of the same weights: each row's hidden state and logits, the K/V it writes
into the paged cache, and nothing else touched.

On the CPU the interpreter runs the kernel with one program (the barriers then pass at once), so that
program does every unit of every phase. The K chunk (`chunk`, `tile`), its K split (`split`,
`num_warps`), the pipeline depth and the context splits are varied so that the product loop over all of
a program's units at once, with one or several chunks and K slices, the multi-tile attention loop and
the split merge (runs of 4 and 16 slots) all run; the
families (Qwen2's biases and one windowed layer, Mistral's window on every layer) and FP8 weights and
cache run through the same tests. tests/kernels/test_rows_megakernel_codegen.py compiles every variant
for the H200.

Tolerances as in test_megakernel_path.py (float32: the order of the sums only; bf16: 4e-2).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.engine.test_fused_path import backends, build, device_for
from tests.engine.test_megakernel_fp8 import KV_SCALES, fp8_kv_buffer, fp8_pair, set_kv_scales
from tests.engine.test_megakernel_path import BLOCK, NUM_BLOCKS, kv_buffer, paths_of, rel, views
from tinyvllm.config import RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.engine.paths.megakernel import stack_weights
from tinyvllm.engine.paths.rows_megakernel import RowsMegakernel, rows_unsupported, serves
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.rows_megakernel import MAX_ROWS, RowsConfig, RowsWorkspace, rows_megakernel_fwd
from tinyvllm.models.decoder import FP8_KV_DTYPE

needs_triton = pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")


def rows_step(seq_lens: list[int], device: torch.device, padded: int = 0, seed: int = 0):
    """(input_ids, positions, meta) of a decode step whose row i has seq_lens[i] tokens of context (its new
    token included), each row's pages distinct blocks of the cache in shuffled order; `padded` rows more
    as a CUDA graph pads a bucket: context 0, slot −1, token 0, an empty block table."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(NUM_BLOCKS, generator=gen).to(torch.int32)
    assert sum(pages) <= NUM_BLOCKS
    width = max(pages)
    table = torch.zeros(len(seq_lens) + padded, width, dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = order[at : at + p]
        at += p
    positions = [n - 1 for n in seq_lens] + [0] * padded
    slots = [int(table[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(seq_lens)]
    slots += [-1] * padded
    lens = seq_lens + [0] * padded
    t = len(lens)
    meta = AttnMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        num_decode_tokens=t,
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        decode_block_tables=table.to(device),
        max_decode_seq_len=max(lens),
        num_prefills=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        prefill_block_tables=table[:0].to(device),
        max_prefill_q_len=0,
        max_prefill_seq_len=0,
    )
    ids = torch.randint(0, 512, (t,), generator=gen)
    ids[len(seq_lens) :] = 0
    return ids.to(device), torch.tensor(positions, device=device), meta


def with_rows(model, config: RowsConfig | None = None, num_splits: int | None = None) -> ModelExecutor:
    """The runner's paths over `model` with the rows megakernel on (the runner turns it on only on CUDA;
    here the CPU interpreter runs it too), `num_splits` context splits per (row, KV head)."""
    paths = paths_of(model)
    rows = RowsMegakernel(model, stack_weights(model), config)
    ws = rows.workspace
    rows.workspace = RowsWorkspace(rows.shape, rows.weights.dtype, model.embed_tokens.weight.device, ws.programs,
                                   rows.config, num_splits)  # fmt: skip
    paths.rows_megakernel = rows
    return paths


def forward(paths, ids, positions, meta, buffer):
    with torch.no_grad():
        hidden = paths.hidden_states(ids, positions, meta, views(buffer))
        return hidden, paths.lm_head.logits(hidden, dtype=torch.float32)


def check_cache(buf, buf_ref, meta, rows: int, tol: float, scales=None) -> None:
    """Every live row's new K/V in every layer against the reference's (dequantized with `scales` for an
    FP8 cache); every other byte of the cache untouched."""
    for i in range(rows):
        slot = int(meta.slot_mapping[i])
        blk, off = slot // BLOCK, slot % BLOCK
        for layer in range(buf.shape[0]):
            for kv in (0, 1):
                s = scales[layer][kv] if scales is not None else 1.0
                got, want = buf[layer, kv, blk, :, off].float() * s, buf_ref[layer, kv, blk, :, off].float() * s
                assert rel(got, want) <= tol, (i, layer, kv, rel(got, want))
        buf[:, :, blk, :, off] = buf_ref[:, :, blk, :, off]
    assert torch.equal(buf.view(torch.uint8), buf_ref.view(torch.uint8))


CASES = [
    # seq_lens, splits, config
    ([7, 13, 1], 1, RowsConfig(chunk=256, stages=6, tile=1 << 20)),  # one chunk a row, one tile a phase
    ([7, 13, 1], 1, RowsConfig(chunk=16, stages=3)),  # 4 chunks of hidden 64, 16 units a program in phase D
    ([130, 65, 64, 2], 3, RowsConfig(chunk=32, stages=1, tile=1 << 20, split=2, num_warps=8)),  # K split in 2
    # (phases C, E: 64 rows < 16 · 8 warps), no pipeline
    ([260, 41], 11, RowsConfig(chunk=64, stages=4, tile=1 << 20, num_warps=8)),  # the merge in runs of 16
    # slots; K split in 4 (phases C, E: 64 rows < 16 · 8 warps)
    ([20] * MAX_ROWS, 2, RowsConfig(chunk=32, stages=6)),  # every row of the products
    ([200, 60, 7], 2, RowsConfig(chunk=32, kv_align=1, kv_stages=5)),  # aligned K/V, 2 tiles copied ahead
    ([260, 41, 3], None, RowsConfig(chunk=32, attn_splits=4)),  # splits from the config: 3, 1, 1 (5, 1, 1 tiles)
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("seq_lens,splits,config", CASES)
def test_rows_megakernel_equals_reference_forward(dtype, seq_lens, splits, config):
    device = device_for("triton")
    ref = build("torch", dtype, device, max_positions=512)
    model = build("triton", dtype, device, max_positions=512)
    paths = with_rows(model, config, splits)
    assert model.layers[1].mlp.down_proj.weight.data_ptr() == paths.rows_megakernel.weights.down[1].data_ptr()
    ids, positions, meta = rows_step(seq_lens, device)
    buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    h_ref, l_ref = forward(paths_of(ref), ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    assert h.shape == h_ref.shape and h.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    for i in range(len(seq_lens)):
        assert rel(h[i], h_ref[i]) <= tol and rel(logits[i], l_ref[i]) <= tol, (i, rel(h[i], h_ref[i]))
    check_cache(buf, buf_ref, meta, len(seq_lens), tol)
    ws = paths.rows_megakernel.workspace
    assert int(ws.barrier.abs().sum()) == 0 and int(ws.tickets.abs().sum()) == 0  # left ready for the next


@needs_triton
@pytest.mark.parametrize(
    "preset,dtype,seq_lens,splits",
    [
        ("tiny-qwen2", torch.float32, [104, 3, 41], 2),  # biases; layer 1's window of 40 keys
        ("tiny-qwen2", torch.bfloat16, [70, 39], 1),
        ("tiny-mistral", torch.float32, [130, 40, 41, 7], 3),  # every layer's window, splits from its start
        ("tiny-qwen3", torch.float32, [65, 1, 64, 130], 2),  # q/k norms: the new key from phase B's registers
        ("tiny-qwen3", torch.bfloat16, [13, 200], 4),
    ],
)
def test_rows_megakernel_serves_every_family(preset, dtype, seq_lens, splits):
    device = device_for("triton")
    ref = build("torch", dtype, device, max_positions=512, preset=preset)
    model = build("triton", dtype, device, max_positions=512, preset=preset)
    paths = with_rows(model, RowsConfig(chunk=32), splits)
    ids, positions, meta = rows_step(seq_lens, device, seed=1)
    buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    h_ref, l_ref = forward(paths_of(ref), ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    assert rel(h, h_ref) <= tol and rel(logits, l_ref) <= tol, (rel(h, h_ref), rel(logits, l_ref))
    check_cache(buf, buf_ref, meta, len(seq_lens), tol)


@needs_triton
def test_rows_megakernel_window_never_reads_keys_before_it():
    """Mistral's window of 40 keys: cache rows before a row's window hold NaN, which any read would spread
    into that row's output."""
    device = device_for("triton")
    ref = build("torch", torch.float32, device, max_positions=512, preset="tiny-mistral")
    model = build("triton", torch.float32, device, max_positions=512, preset="tiny-mistral")
    paths = with_rows(model, RowsConfig(chunk=32), 2)
    seq_lens = [150, 97]
    ids, positions, meta = rows_step(seq_lens, device, seed=2)
    buf_ref, buf = kv_buffer(ref, torch.float32).to(device), kv_buffer(ref, torch.float32).to(device)
    for i, n in enumerate(seq_lens):
        for p in range(n - 40):  # the keys before the window: poisoned
            blk = int(meta.decode_block_tables[i, p // BLOCK])
            buf[:, :, blk, :, p % BLOCK] = float("nan")
    h_ref, _ = forward(paths_of(ref), ids, positions, meta, buf_ref)
    h, _ = forward(paths, ids, positions, meta, buf)
    assert torch.isfinite(h).all() and rel(h, h_ref) <= 1e-5


@needs_triton
@pytest.mark.parametrize(
    "preset,dtype,fp8w,fp8kv",
    [
        ("tiny", torch.float32, True, False),
        ("tiny", torch.bfloat16, True, False),
        ("tiny", torch.float32, False, True),
        ("tiny", torch.float32, True, True),
        ("tiny-qwen3", torch.float32, False, True),  # the new key written quantized by phase B
    ],
    ids=["f32-fp8w", "bf16-fp8w", "f32-fp8kv", "f32-both", "qwen3-f32-fp8kv"],
)
def test_rows_megakernel_fp8_equals_dequantized_reference(preset, dtype, fp8w, fp8kv):
    """FP8 weights against the dequantized weights in the model's dtype (each row's sum scaled after the
    product), an FP8 cache against the reference attention over the same codes."""
    device = device_for("triton")
    if fp8w:
        model, ref = fp8_pair(dtype, device, preset=preset)
    else:
        ref = build("torch", dtype, device, max_positions=512, preset=preset)
        model = build("triton", dtype, device, max_positions=512, preset=preset)
    set_kv_scales(model, ref)
    paths = with_rows(model, RowsConfig(chunk=32), 2)
    assert paths.rows_megakernel.weights.fp8 == fp8w
    seq_lens = [65, 13, 100]
    ids, positions, meta = rows_step(seq_lens, device, seed=3)
    if fp8kv:
        buf_ref, buf = fp8_kv_buffer(ref, dtype).to(device), fp8_kv_buffer(ref, dtype).to(device)
        assert buf.dtype == FP8_KV_DTYPE
    else:
        buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    h_ref, l_ref = forward(paths_of(ref), ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    assert rel(h, h_ref) <= tol and rel(logits, l_ref) <= tol, (rel(h, h_ref), rel(logits, l_ref))
    # float32 K/V before the cache's e4m3 rounding agree to ~1e-7: they take the same codes but at rare ties
    cache_tol = tol if not fp8kv or dtype == torch.float32 else 0.1
    check_cache(buf, buf_ref, meta, len(seq_lens), cache_tol, KV_SCALES if fp8kv else None)


@needs_triton
def test_rows_megakernel_padding_rows_write_nothing_and_relaunch_bitwise():
    """A graph bucket's padding rows (context 0, slot −1) write no cache byte and change no live row; a
    second launch on the same inputs gives the same bits (fixed-order sums, counters reset)."""
    device = device_for("triton")
    dtype = torch.bfloat16
    ref = build("torch", dtype, device, max_positions=512)
    model = build("triton", dtype, device, max_positions=512)
    paths = with_rows(model, RowsConfig(chunk=32), 2)
    seq_lens = [33, 9, 70]
    ids, positions, meta = rows_step(seq_lens, device, padded=5, seed=4)
    buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    live = slice(0, len(seq_lens))
    live_meta = rows_step(seq_lens, device, seed=4)[2]
    h_ref, _ = forward(paths_of(ref), ids[live], positions[live], live_meta, buf_ref)
    first = buf.clone()
    h, _ = forward(paths, ids, positions, meta, buf)
    assert h.shape[0] == len(seq_lens) + 5 and rel(h[live], h_ref) <= 4e-2
    check_cache(buf.clone(), buf_ref, meta, len(seq_lens), 4e-2)
    again, _ = forward(paths, ids, positions, meta, first)
    assert torch.equal(again[live], h[live]) and torch.equal(first, buf)


@needs_triton
def test_executor_routes_decode_rows_through_the_rows_megakernel(monkeypatch):
    """2–16 decode rows take the rows megakernel; one row, a prefill or 17 rows take the other paths."""
    device = device_for("triton")
    model = build("triton", torch.float32, device, max_positions=512)
    paths = with_rows(model, RowsConfig(chunk=32))
    calls = []
    real = paths.rows_megakernel.__call__
    monkeypatch.setattr(type(paths.rows_megakernel), "__call__", lambda self, *a: calls.append(1) or real(*a))
    ids, positions, meta = rows_step([5, 6], device)
    assert serves(2, meta) and not serves(1, rows_step([5], device)[2]) and not serves(17, meta)
    buf = kv_buffer(model, torch.float32).to(device)
    forward(paths, ids, positions, meta, buf)
    assert calls == [1]
    forward(paths, *rows_step([5], device), buf)
    assert calls == [1]


def test_rows_megakernel_refuses_what_it_cannot_serve(caplog):
    """A head dim below a unit's 16 rows is refused, as is the torch backend: the runner logs why in one
    line and runs the layer loop."""
    model = build("torch", torch.float32, torch.device("cpu"), hidden_size=32)  # 4 heads of 8
    assert "backend" in rows_unsupported(model)
    model.ops = type("Ops", (), {"name": "triton"})()
    assert "head_dim 8" in rows_unsupported(model)
    with caplog.at_level(logging.INFO):
        executor = ModelExecutor(
            build("torch", torch.float32, torch.device("cpu")), RunnerConfig(rows_megakernel=True), "cuda"
        )
    assert executor.rows_megakernel is None


@needs_triton
@pytest.mark.parametrize("rows", [0, MAX_ROWS + 1])
def test_rows_megakernel_rejects_a_row_count_it_cannot_serve(rows):
    device = device_for("triton")
    model = build("triton", torch.float32, device, max_positions=512)
    mk = with_rows(model).rows_megakernel
    ids, positions, meta = rows_step([5] * max(rows, 1), device)
    with pytest.raises(ValueError, match="rows"):
        rows_megakernel_fwd(
            ids[:rows], positions[:rows], meta.slot_mapping[:rows], meta.decode_seq_lens[:rows],
            meta.decode_block_tables[:rows], mk.weights, model.cos_sin, views(kv_buffer(model, torch.float32)),
            mk.shape, 1e-5, 0.25, mk.workspace,
        )  # fmt: skip


@needs_triton
def test_engine_greedy_through_the_rows_megakernel_equals_the_layer_loop(tmp_path):
    """The engine's decode steps of 2–16 rows through the rows megakernel (attached on the CPU, where the
    runner builds it only for CUDA), as the scheduler composes them: rows joining and finishing at
    different steps, contexts across several blocks. float32: the same greedy tokens as the layer loop,
    and every multi-row decode step went through the kernel."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=0, dtype="float32")
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(5)]
    got = {}
    for rows in (False, True):
        llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=128, kernel_backend="triton",
                  block_size=4, enforce_eager=True)  # fmt: skip
        executor = llm.llm_engine.runner.executor
        calls = []
        if rows:
            kernel = RowsMegakernel(executor.model, stack_weights(executor.model), RowsConfig(chunk=32))
            executor.rows_megakernel = lambda *a, kernel=kernel, calls=calls: calls.append(a[0].shape[0]) or kernel(*a)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[rows] = [o.outputs[0].token_ids for o in outs]
        assert (len(calls) > 0) == rows and all(2 <= n <= MAX_ROWS for n in calls)
    assert got[True] == got[False]
