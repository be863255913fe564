"""The decode megakernel (kernels/decode_megakernel/) and the fused path with FP8 weights and an FP8 KV
cache, on the CPU interpreter (one program: test_megakernel_path.py describes how that covers every unit).

FP8 weights: the kernels compute x · dequant(W) with the activations unquantized (W = q · s, one float32
scale per row, dequantized in registers). The independent reference is the torch table's layer loop over
a model in the same dtype whose linear weights are dequant(W) (plain nn.Linear layers): in float32 the two
differ only in the order of the float32 sums (1e-5, as test_megakernel_path.py); in bfloat16 the
reference rounds dequant(W) to bf16 (2⁻⁹ relative per weight, well below the 8-bit roundings of every
product output that set bf16's 4e-2 there) and the bound is the same 4e-2. The layer loop of the FP8 model
itself (Fp8Linear: activations quantized per token) is a different computation, compared separately:
both it and the kernels' x · dequant(W) must lie within FP8's error of the unquantized model.

FP8 KV cache: the reference is the torch table's layer loop over the same FP8 cache (it dequantizes
K / V with the layer's k_scale and v_scale and attends in float32), with scales ≠ 1 that differ per layer
and between K and V, so a scale applied to the wrong tensor, the wrong layer or not at all shows.
Measured in float32: one matrix's row scales on the wrong rows give 0.25–0.53 against the 1e-5 bound.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_fused_path import backends, build, device_for
from tests.engine.test_megakernel_path import (
    BLOCK,
    CPU,
    forward,
    kv_buffer,
    paths_of,
    rel,
    step,
    views,
    with_megakernel,
)
from tinyvllm.config import ModelConfig, RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.kernels import get_ops
from tinyvllm.kernels.decode_megakernel import MegakernelConfig, Workspace, max_programs, unit_rows, unit_tile
from tinyvllm.kernels.decode_megakernel.launch import phase_d_chunks
from tinyvllm.models.checkpoint import make_config
from tinyvllm.models.decoder import FP8_KV_DTYPE, CausalLM
from tinyvllm.quantization.config import QuantizationConfig
from tinyvllm.quantization.fp8 import FP8_DTYPE, quantize_rows, to_fp8
from tinyvllm.quantization.linear import Fp8Linear

needs_triton = pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
KV_SCALES = [(0.05, 0.125), (0.5, 0.02), (0.25, 0.0625), (0.1, 0.04), (0.2, 0.03)]  # per layer (k, v)


def fp8_pair(dtype, device, preset="tiny", **overrides) -> tuple[CausalLM, CausalLM]:
    """(FP8 model on the Triton table, reference): the same random model (test_fused_path.build) with every
    decoder linear layer quantized per row in the first, and the dequantized weights q · s (rounded to
    `dtype`) as plain nn.Linear layers of the torch table in the second."""
    plain = build("torch", dtype, device, max_positions=512, preset=preset, **overrides)
    config = ModelConfig.from_dict(make_config(preset, **{"num_hidden_layers": 2, **overrides}))
    with torch.device(device):
        fp8 = CausalLM(config, get_ops("triton"), 512, dtype, quant=QuantizationConfig())
    fp8.init_rope_table()
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, module in fp8.named_modules():
            if isinstance(module, Fp8Linear):
                ref_linear = plain.get_submodule(name)
                q, s = quantize_rows(ref_linear.weight.float())
                module.weight.copy_(q)
                module.weight_scale.copy_(s)
                ref_linear.weight.copy_((q.float() * s[:, None]).to(dtype))
                if module.bias is not None:
                    module.bias.copy_(ref_linear.bias)
        for name, p in fp8.named_parameters():
            if p.dtype != FP8_DTYPE and not name.endswith("weight_scale") and not name.endswith("input_scale"):
                p.copy_(params[name])
    return fp8.eval(), plain


def set_kv_scales(*models: CausalLM) -> None:
    for model in models:
        for layer, (k, v) in zip(model.layers, KV_SCALES):
            layer.self_attn.k_scale, layer.self_attn.v_scale = k, v


def fp8_kv_buffer(model, dtype) -> torch.Tensor:
    """kv_buffer's random K/V stored as an FP8 cache with each layer's scales: e4m3(K / k_scale)."""
    buf = kv_buffer(model, torch.float32)
    out = torch.empty(buf.shape, dtype=FP8_KV_DTYPE)
    for i, layer in enumerate(model.layers):
        out[i, 0] = to_fp8(buf[i, 0] * layer.self_attn.k_scale, torch.tensor(layer.self_attn.k_scale))
        out[i, 1] = to_fp8(buf[i, 1] * layer.self_attn.v_scale, torch.tensor(layer.self_attn.v_scale))
    return out


def check_cache(buf, buf_ref, meta, num_layers, scales, tol):
    """The new token's K/V (dequantized) in every layer against the reference's; nothing else touched."""
    slot = int(meta.slot_mapping[0])
    blk, off = slot // BLOCK, slot % BLOCK
    for layer in range(num_layers):
        for kv in (0, 1):
            s = scales[layer][kv] if buf.dtype == FP8_KV_DTYPE else 1.0
            got, want = buf[layer, kv, blk, :, off].float() * s, buf_ref[layer, kv, blk, :, off].float() * s
            assert rel(got, want) <= tol, (layer, kv, rel(got, want))
    buf[:, :, blk, :, off] = buf_ref[:, :, blk, :, off]
    assert torch.equal(buf.view(torch.uint8), buf_ref.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize(
    "dtype,preset,seq_len,splits,tile,split_o,fp8_kv",
    [
        (torch.float32, "tiny", 13, 1, 256, True, False),  # thread-sum phase D, split phase C
        (torch.float32, "tiny", 65, 2, 1024, False, False),  # ticket merge, unsplit phase C
        (torch.bfloat16, "tiny", 40, 2, 16384, True, False),  # tensor-core phase D on converted FP8 tiles
        (torch.float32, "tiny-qwen2", 104, 2, 16384, True, False),  # q/k/v biases after the row scales
        (torch.float32, "tiny", 65, 2, 1024, True, True),  # FP8 weights and an FP8 cache together
        (torch.bfloat16, "tiny-qwen3", 130, 3, 16384, False, True),  # q/k norm: phase B writes the new key
    ],
)
def test_fp8_megakernel_equals_dequantized_reference(dtype, preset, seq_len, splits, tile, split_o, fp8_kv):
    device = device_for("triton")
    model, ref = fp8_pair(dtype, device, preset=preset)
    paths = with_megakernel(model, MegakernelConfig(tile=tile, split_o=split_o))
    mk = paths.megakernel
    mk.workspace = Workspace(mk.shape, dtype, device, programs=max_programs(device), num_splits=splits)
    assert mk.weights.fp8 and mk.weights.down.dtype == FP8_DTYPE and mk.weights.o_scale.shape == (2, 64)
    assert model.layers[1].mlp.down_proj.weight.data_ptr() == mk.weights.down[1].data_ptr()  # views, no copy
    if fp8_kv:
        set_kv_scales(model, ref)
        mk.weights.kv_scales.copy_(torch.tensor(KV_SCALES[:2]))
        buf_ref, buf = fp8_kv_buffer(ref, dtype).to(device), fp8_kv_buffer(ref, dtype).to(device)
    else:
        buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    ids, positions, meta = step(seq_len, device=device)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    assert h.dtype == dtype and rel(h, h_ref) <= tol and rel(logits, l_ref) <= tol, (rel(h, h_ref), rel(logits, l_ref))
    # float32 K/V before the cache's e4m3 rounding agree to 1e-7, so they round alike but at rare ties
    check_cache(buf, buf_ref, meta, 2, KV_SCALES, tol if not fp8_kv else 1e-5 if dtype == torch.float32 else 0.1)
    assert int(mk.workspace.barrier.abs().sum()) == 0 and int(torch.count_nonzero(mk.workspace.o_sums)) == 0


@needs_triton
@pytest.mark.parametrize(
    "dtype,preset,seq_len,splits,split_o,kv_align",
    [
        (torch.float32, "tiny", 300, 11, True, False),  # split merge in runs of 16
        (torch.float32, "tiny", 65, 2, False, False),
        (torch.bfloat16, "tiny", 13, 1, True, False),
        (torch.float32, "tiny-qwen3", 65, 2, False, False),  # the new key, quantized, is the last split's whole
        (torch.float32, "tiny-qwen3", 1, 1, True, False),  # ... or the whole context
        (torch.float32, "tiny-mistral", 130, 3, True, False),  # the window over an FP8 cache
        (torch.float32, "tiny-qwen3", 130, 3, True, True),  # the K/V pointers hinted 16-element aligned
    ],
)
def test_fp8_kv_megakernel_equals_reference(dtype, preset, seq_len, splits, split_o, kv_align):
    """Model weights in `dtype`, the cache FP8: against the torch table's decode attention over the
    dequantized cache. K's scales ignored move the float32 logits by 0.2, V's by 1.2, the two swapped by
    0.26: far above the bound. `kv_align`: 16 one-byte elements, a 16-byte vector."""
    device = device_for("triton")
    ref = build("torch", dtype, device, max_positions=512, preset=preset)
    model = build("triton", dtype, device, max_positions=512, preset=preset)
    set_kv_scales(model, ref)
    paths = with_megakernel(model, MegakernelConfig(tile=16384, split_o=split_o, kv_align=kv_align))
    mk = paths.megakernel
    mk.workspace = Workspace(mk.shape, dtype, device, programs=max_programs(device), num_splits=splits)
    assert mk.weights.kv_scales.tolist() == [list(map(lambda x: torch.tensor(x).item(), ks)) for ks in KV_SCALES[:2]]
    ids, positions, meta = step(seq_len, device=device)
    buf_ref, buf = fp8_kv_buffer(ref, dtype).to(device), fp8_kv_buffer(ref, dtype).to(device)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    assert rel(h, h_ref) <= tol and rel(logits, l_ref) <= tol, (rel(h, h_ref), rel(logits, l_ref))
    check_cache(buf, buf_ref, meta, 2, KV_SCALES, 1e-5 if dtype == torch.float32 else 0.1)


@needs_triton
def test_fp8_megakernel_greedy_tokens_equal_dequantized_layer_loop():
    """Twelve greedy decode steps of a float32 FP8 model through the megakernel path (one launch a step,
    each step's token fed to the next) against the torch layer loop of the dequantized weights: the same
    tokens, each step's logits within 1e-5, and every step's winner ahead of the runner-up by far more than
    that difference (so the tokens' agreement is not luck at a near tie)."""
    device = device_for("triton")
    model, ref = fp8_pair(torch.float32, device)
    paths = with_megakernel(model, MegakernelConfig(tile=1024))
    ids, positions, meta = step(20, device=device)
    buf_ref, buf = kv_buffer(ref, torch.float32).to(device), kv_buffer(ref, torch.float32).to(device)
    tokens, tokens_ref = [], []
    for _ in range(12):
        _, l_ref = forward(ref, ids, positions, meta, buf_ref)
        _, logits = forward(paths, ids, positions, meta, buf)
        assert rel(logits, l_ref) <= 1e-5
        top2 = l_ref[0].topk(2).values
        assert float(top2[0] - top2[1]) > 100 * float((logits - l_ref).abs().max())
        tokens.append(int(logits[0].argmax()))
        tokens_ref.append(int(l_ref[0].argmax()))
        # the next step: the chosen token at the next position, its slot in the sequence's last page
        seq_len = int(meta.decode_seq_lens[0]) + 1
        table = meta.decode_block_tables[0]
        if (seq_len - 1) // BLOCK >= table.numel():
            used = set(table.tolist())
            table = torch.cat([table, torch.tensor([next(b for b in range(80) if b not in used)], dtype=table.dtype)])
            meta.decode_block_tables = table[None, :]
        pos = seq_len - 1
        meta.slot_mapping = torch.tensor([int(table[pos // BLOCK]) * BLOCK + pos % BLOCK])
        meta.decode_seq_lens = torch.tensor([seq_len], dtype=torch.int32)
        meta.max_decode_seq_len = seq_len
        ids, positions = torch.tensor([tokens_ref[-1]]), torch.tensor([pos])
    assert tokens == tokens_ref


@needs_triton
def test_fp8_paths_within_fp8_error_of_the_unquantized_model():
    """One decode step of the same bf16 model unquantized (the layer loop), with FP8 weights on the
    batched path (the FP8 model's layer loop: activations quantized per token, x_q · W_q) and on the
    batch-1 paths (the megakernel and the fused path: x · dequant(W)).

    FP8's error: e4m3 keeps 3 mantissa bits, so rounding changes an element by ε ≈ 2⁻³ / √12 / 1.44 ≈
    2.5 % RMS of its value; a product whose operands are rounded independently changes by about ε per
    rounded operand, and the 2 layers × 4 products add their changes in quadrature through the residual
    stream: √8 · ε ≈ 7 % for weights only, √16 · ε = 10 % with the activations too (measured on this
    model: 7.1 % and 9.8 %). Bounds at twice those, 14 % and 20 %; one matrix's scales on the wrong rows
    move the logits by 25–55 %. Each FP8 computation moves the logits by more than bf16's own
    rounding against float32 (1.2 %: the comparison can tell), and the batch-1 and batched paths differ
    from each other by the activations' rounding (~√8 · ε, 6.8 % here; above 2 %), while the megakernel
    and the fused path, the same maths, agree within bf16's tolerance (4e-2)."""
    device = device_for("triton")
    dtype = torch.bfloat16
    model, _ = fp8_pair(dtype, device)
    unquantized = build("torch", dtype, device, max_positions=512)
    exact = build("torch", torch.float32, device, max_positions=512)
    ids, positions, meta = step(40, device=device)
    _, l_bf16 = forward(unquantized, ids, positions, meta, kv_buffer(exact, dtype))
    _, l_f32 = forward(exact, ids, positions, meta, kv_buffer(exact, torch.float32))
    layer_loop = ModelExecutor(model, RunnerConfig(decode_megakernel=False, fused_gemv=False), "cpu")
    _, l_batched = forward(layer_loop, ids, positions, meta, kv_buffer(exact, dtype))
    fused = paths_of(model)
    assert fused.uses_fused_path(1)
    _, l_fused = forward(fused, ids, positions, meta, kv_buffer(exact, dtype))
    mk = with_megakernel(model, MegakernelConfig(tile=1024))
    _, l_mk = forward(mk, ids, positions, meta, kv_buffer(exact, dtype))
    bf16_err = rel(l_bf16, l_f32)
    for name, logits, bound in (("batched", l_batched, 0.20), ("fused", l_fused, 0.14), ("megakernel", l_mk, 0.14)):
        err = rel(logits, l_bf16)
        assert 2 * bf16_err < err <= bound, (name, err, bf16_err)
    assert rel(l_mk, l_fused) <= 4e-2 and rel(l_fused, l_batched) > 2e-2


def test_megakernel_refuses_fp8_on_some_layers_only():
    from tinyvllm.engine.paths.megakernel import megakernel_unsupported

    config = ModelConfig.from_dict(make_config("tiny", num_hidden_layers=2))
    quant = QuantizationConfig(ignore=("lm_head", "model.layers.1.mlp.down_proj"))
    model = CausalLM(config, get_ops("triton"), 64, torch.float32, quant=quant)
    assert megakernel_unsupported(model) == "FP8 weights on some decoder linear layers only"


def test_fp8_units_keep_the_bytes_of_a_bf16_unit():
    """A unit of FP8 weights holds twice the elements of a bf16 one (the same bytes, half the units), still
    halved where the pipeline's tiles would not fit; phase D runs as a reduction, never on the tensor
    cores (launch.phase_d_chunks), which bf16 weights of the same shape use."""
    from tinyvllm.kernels.decode_megakernel import ModelShape

    assert unit_tile(MegakernelConfig(tile=16384), 1) == 32768  # 3 stages in flight: 96 KB, as bf16
    assert unit_tile(MegakernelConfig(tile=16384, stages=8), 1) == 16384  # 7 × 32 KB > 160 KB: halved
    llama_1b = ModelShape(hidden=2048, intermediate=8192, num_heads=32, num_kv_heads=8, head_dim=64)
    rq, ro, rg, rd = unit_rows(llama_1b, unit_tile(MegakernelConfig(), 1))
    assert (rq, ro, rg, rd) == (8, 16, 8, 4)  # bf16: (4, 8, 4, 2)
    assert unit_rows(llama_1b, unit_tile(MegakernelConfig(), 2)) == (4, 8, 4, 2)
    assert phase_d_chunks(llama_1b, rg, 1) == (512, False)
    assert phase_d_chunks(llama_1b, 4, 2) == (256, True)


@needs_triton
@pytest.mark.parametrize(
    "dtype,kind,preset",
    [
        (torch.float32, "decode", "tiny"),  # 3 rows: the tl.dot path
        (torch.bfloat16, "decode", "tiny"),
        (torch.float32, "mixed", "tiny-qwen2"),  # 7 rows, the qkv bias after the row scales
    ],
)
def test_fp8_fused_path_equals_dequantized_reference(dtype, kind, preset):
    """The fused small-batch path (paths/fused.py) of the FP8 model, every product on the FP8 matrix-vector
    kernel, against the torch layer loop of the dequantized weights (module docstring's tolerances)."""
    from tests.engine.test_fused_path import batch, caches, executor

    device = device_for("triton")
    model, ref = fp8_pair(dtype, device, preset=preset)
    paths = executor(model, True)
    ids, positions, meta = batch(kind, device)
    assert paths.uses_fused_path(len(ids))
    kv = caches(model, dtype, device)
    with torch.no_grad():
        h = paths.hidden_states(ids, positions, meta, [(k.clone(), v.clone()) for k, v in kv])
        h_ref = paths_of(ref).hidden_states(ids, positions, meta, [(k.clone(), v.clone()) for k, v in kv])
    assert rel(h, h_ref) <= (1e-5 if dtype == torch.float32 else 4e-2), rel(h, h_ref)


def test_megakernel_rejects_fp8_inputs_it_cannot_read():
    """Raised before anything launches: an FP8 cache without the layers' scales, a cache of a third dtype,
    FP8 weights without their row scales."""
    import dataclasses

    model, _ = fp8_pair(torch.float32, CPU)
    mk = with_megakernel(model).megakernel
    ids, positions, meta = step(5)
    fp8 = kv_buffer(model, torch.float32).to(FP8_KV_DTYPE)
    weights = mk.weights
    mk.weights = dataclasses.replace(weights, kv_scales=None)
    with pytest.raises(ValueError, match="kv_scales"):
        mk(ids, positions, meta, views(fp8))
    mk.weights = weights
    with pytest.raises(ValueError, match=r"KV cache dtype torch\.float16"):
        mk(ids, positions, meta, views(kv_buffer(model, torch.float16)))
    mk.weights = dataclasses.replace(weights, down_scale=None)
    with pytest.raises(ValueError, match=r"down_scale must be a contiguous float32 \[2, 64\]"):
        mk(ids, positions, meta, views(kv_buffer(model, torch.float32)))
