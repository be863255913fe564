"""The fused small-batch path (engine/paths/fused.py: fused_gemv with RMSNorm / SwiGLU / residual folded
in, T ≤ 16 rows) against the unfused forward of the same model, on a decode batch and on a mixed decode + prefill-chunk
batch, with both ops tables.

The torch table's fused_gemv is literally the unfused op sequence (reference.fused_gemv), so there the
two paths must agree bit for bit. The Triton table (the CPU interpreter without CUDA) sums its products
in another order than torch's matmul: float32 agrees to ~1e-6 (1e-5 bound). In bfloat16 every product
output is rounded to 8 bits and the rounding differences grow through the layers: on this random model
a bf16 run differs from the float32 run of the same weights by 0.8e-2 (torch) to 1.5–2e-2 (the
interpreter, which truncates fp32 → bf16 where torch rounds to nearest), and fused from unfused by
1.2–1.3e-2. The bound, 4e-2, leaves 3× margin and still catches bookkeeping errors: a skipped norm
weight gives 0.27, a lost residual 1.1, a wrong eps 0.6. The exact rounding order is checked
elementwise in tests/kernels/test_gemv.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tinyvllm.config import ModelConfig, RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.kernels import get_ops
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.models.checkpoint import make_config
from tinyvllm.models.decoder import CausalLM

BLOCK = 4


def backends() -> list[str]:
    usable = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    return ["torch", "triton"] if usable else ["torch"]


def device_for(backend: str) -> torch.device:
    return torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")


def build(
    backend: str,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int = 64,
    preset: str = "tiny",
    **overrides,
) -> CausalLM:
    """The 2-layer `preset` (config.json `overrides` applied) with random weights and biases, norms ≠ 1."""
    config = ModelConfig.from_dict(make_config(preset, **{"num_hidden_layers": 2, **overrides}))
    with torch.device(device):
        model = CausalLM(config, get_ops(backend), max_positions, dtype)
    model.init_rope_table()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not 1, so a skipped norm weight shows
                values = 1 + 0.2 * torch.randn(p.shape, generator=gen)
            else:
                values = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(values.to(dtype))
    return model.eval()


def batch(kind: str, device: torch.device):
    """(input_ids, positions, meta) of a decode batch of 3 sequences, or 1 decode row + a 6-row chunk.
    The cache holds earlier context for every sequence (random K/V written by the caller)."""
    i32, i64 = torch.int32, torch.int64
    if kind == "decode":
        seq_lens = [7, 13, 1]  # context incl. the new token
        tables = torch.tensor([[0, 1, 2, 9], [3, 4, 5, 6], [7, 9, 9, 9]], dtype=i32)
        positions = [n - 1 for n in seq_lens]
        slots = [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in enumerate(positions)]
        meta = AttnMetadata(
            slot_mapping=torch.tensor(slots, dtype=i64),
            num_decode_tokens=3,
            decode_seq_lens=torch.tensor(seq_lens, dtype=i32),
            decode_block_tables=tables,
            max_decode_seq_len=max(seq_lens),
            num_prefills=0,
            prefill_cu_seqlens_q=torch.zeros(1, dtype=i32),
            prefill_seq_lens=torch.zeros(0, dtype=i32),
            prefill_block_tables=tables[:0],
            max_prefill_q_len=0,
            max_prefill_seq_len=0,
        )
    else:
        dec_tables = torch.tensor([[0, 1, 2]], dtype=i32)
        pre_tables = torch.tensor([[3, 4, 5]], dtype=i32)
        positions = [9, *range(3, 9)]  # the chunk: tokens 3..8 of a sequence with 9 tokens
        slots = [int(dec_tables[0, 9 // BLOCK]) * BLOCK + 9 % BLOCK]
        slots += [int(pre_tables[0, p // BLOCK]) * BLOCK + p % BLOCK for p in positions[1:]]
        meta = AttnMetadata(
            slot_mapping=torch.tensor(slots, dtype=i64),
            num_decode_tokens=1,
            decode_seq_lens=torch.tensor([10], dtype=i32),
            decode_block_tables=dec_tables,
            max_decode_seq_len=10,
            num_prefills=1,
            prefill_cu_seqlens_q=torch.tensor([0, 6], dtype=i32),
            prefill_seq_lens=torch.tensor([9], dtype=i32),
            prefill_block_tables=pre_tables,
            max_prefill_q_len=6,
            max_prefill_seq_len=9,
        )
    for name in (
        "slot_mapping",
        "decode_seq_lens",
        "decode_block_tables",
        "prefill_cu_seqlens_q",
        "prefill_seq_lens",
        "prefill_block_tables",
    ):
        setattr(meta, name, getattr(meta, name).to(device))
    T = len(positions)
    ids = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(T)).to(device)
    return ids, torch.tensor(positions, dtype=i64, device=device), meta


def caches(model: CausalLM, dtype: torch.dtype, device: torch.device) -> list:
    c = model.config
    gen = torch.Generator().manual_seed(1)
    shape = (10, c.num_key_value_heads, BLOCK, c.head_dim)
    return [
        tuple(torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
        for _ in range(c.num_hidden_layers)
    ]


def executor(model: CausalLM, fused: bool) -> ModelExecutor:
    """The runner's path choice with the fused path on for every row count the kernels serve (16, not
    only the engine's default of 1), or off."""
    return ModelExecutor(
        model,
        RunnerConfig(fused_gemv=fused, fused_max_tokens=16, pruned_lm_head=False),
        model.embed_tokens.weight.device.type,
    )


def run(model, fused: bool, ids, positions, meta, kv):
    paths = executor(model, fused)
    assert paths.uses_fused_path(len(ids)) == fused
    kv = [(k.clone(), v.clone()) for k, v in kv]
    with torch.no_grad():
        hidden = paths.hidden_states(ids, positions, meta, kv)
        logits = paths.lm_head.logits(hidden, dtype=None)
    return hidden, logits, kv


# Every family: Qwen3 (q/k norm, query width 128 ≠ hidden 64), Qwen2 (q/k/v biases, a window on layer 1)
# and Mistral (a window on every layer); windows of 5 keys, so the batches' contexts (7, 13, 10 and the
# chunk's) run past them.
FAMILIES = {
    "tiny": {},
    "tiny-qwen3": {},
    "tiny-qwen2": {"sliding_window": 5},
    "tiny-mistral": {"sliding_window": 5},
}


@pytest.mark.parametrize("preset", list(FAMILIES))
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", backends())
def test_fused_small_batch_equals_unfused(backend, dtype, kind, preset):
    device = device_for(backend)
    model = build(backend, dtype, device, preset=preset, **FAMILIES[preset])
    ids, positions, meta = batch(kind, device)
    kv = caches(model, dtype, device)
    h0, l0, kv0 = run(model, False, ids, positions, meta, kv)
    h1, l1, kv1 = run(model, True, ids, positions, meta, kv)
    assert h1.dtype == h0.dtype == dtype and l1.dtype == l0.dtype
    if backend == "torch":  # the reference fused_gemv is the unfused op sequence: same bits
        assert torch.equal(h0, h1) and torch.equal(l0, l1)
        assert all(torch.equal(a, b) for x, y in zip(kv0, kv1) for a, b in zip(x, y))
        return
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    for ours, ref in ((h1, h0), (l1, l0), *[(x[i], y[i]) for x, y in zip(kv1, kv0) for i in (0, 1)]):
        err = ((ours.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("backend", backends())
def test_fused_path_with_every_product_ours(backend, kind, preset):
    """`fused_forward(pdl=True)` (the gate/up product by the matrix-vector kernel too, as under PDL) against
    the unfused forward, in float32: the same maths, only the products' order of sums differs."""
    from tinyvllm.engine.paths.fused import fused_forward

    device = device_for(backend)
    model = build(backend, torch.float32, device, preset=preset)
    ids, positions, meta = batch(kind, device)
    kv = caches(model, torch.float32, device)
    h0, _, kv0 = run(model, False, ids, positions, meta, kv)
    kv1 = [(k.clone(), v.clone()) for k, v in kv]
    calls = []
    gemv = model.ops.fused_gemv

    def counted(x, w, **kw):
        calls.append(w.data_ptr())
        return gemv(x, w, **kw)

    for layer in model.layers:
        layer.self_attn.ops = dataclasses.replace(layer.self_attn.ops, fused_gemv=counted)
    with torch.no_grad():
        h1 = fused_forward(model, ids, positions, meta, kv1, pdl=True)
    # Every layer's four products went through the matrix-vector kernel, the gate/up one included.
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert calls.count(proj.weight.data_ptr()) == 1
    tol = 1e-5 if backend == "triton" else 0.0
    for ours, ref in ((h1, h0), *[(x[i], y[i]) for x, y in zip(kv1, kv0) for i in (0, 1)]):
        err = ((ours.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def test_fused_path_only_for_small_batches():
    model = build("torch", torch.float32, torch.device("cpu"))
    default = RunnerConfig().fused_max_tokens
    paths = ModelExecutor(model, RunnerConfig(), "cpu")
    assert paths.uses_fused_path(1) and paths.uses_fused_path(default)
    assert not paths.uses_fused_path(default + 1) and not paths.uses_fused_path(0)
    assert paths.lm_head.is_fused(default) and not paths.lm_head.is_fused(default + 1)
    off = ModelExecutor(model, RunnerConfig(fused_gemv=False), "cpu")
    assert not off.uses_fused_path(1) and not off.lm_head.is_fused(1)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_attention_output_is_the_kernels_own(kind):
    """A step of one kind of row returns the attention op's output tensor itself (no copy into a joint
    buffer: a launch a layer); a mixed step joins the decode rows' and the chunk's outputs in row order."""
    import dataclasses

    model = build("torch", torch.float32, torch.device("cpu"))
    attn = model.layers[0].self_attn
    outputs = {}

    def recorded(name, op):
        def call(*args, **kwargs):
            outputs[name] = op(*args, **kwargs)
            return outputs[name]

        return call

    ops = attn.ops
    attn.ops = dataclasses.replace(
        ops,
        decode_attention=recorded("decode", ops.decode_attention),
        prefill_attention=recorded("prefill", ops.prefill_attention),
    )
    ids, positions, meta = batch(kind, torch.device("cpu"))
    c = model.config
    qkv = torch.randn(len(ids), (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim)
    with torch.no_grad():
        out = attn.attend(qkv, positions, model.cos_sin, meta, caches(model, torch.float32, torch.device("cpu"))[0])
    if kind == "decode":
        assert set(outputs) == {"decode"} and out.data_ptr() == outputs["decode"].data_ptr()
    else:
        joined = torch.cat([outputs["decode"], outputs["prefill"]]).reshape(out.shape)
        assert torch.equal(out, joined)
