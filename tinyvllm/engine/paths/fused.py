"""The fused small-batch decoder path: the model's maths through our matrix-vector kernels.

For a step of T ≤ 16 token rows (the kernels' limit; the runner's `fused_max_tokens`, default 1), each
layer runs with the neighbouring ops folded into the products,

    h   = RMSNorm(r);  qkv = fused_gemv(h, Wqkv) (+ bqkv in the epilogue: Qwen2)
    o   = the model's own attention of qkv (q/k norm, RoPE, cache write, the layer's window)
    r   = fused_gemv(attn, Wo, residual=r)               residual add in the epilogue
    h   = RMSNorm(r);  gu = h Wguᵀ (cuBLAS; with `pdl`, fused_gemv(h, Wgu))
    r   = fused_gemv(gu, Wd, silu_mul=True, residual=r)  SwiGLU in the prologue, residual add in the epilogue

so r is always the complete residual stream (the first layer's is the embeddings). The RMSNorms stay
kernels of their own: folding them into the products' prologue would re-read r in every program. The
roundings are those of the layer loop; only the order of the float32 sums inside the products differs.

With `pdl` (kernels/pdl.py; the executor opens `programmatic_launches` around the path) every kernel of
a layer is ours, so each is launched while the one before it finishes: the gate/up product then runs on
the matrix-vector kernel too, since a cuBLAS kernel is neither launched as a dependent nor releases one.

FP8 layers (quantization/linear.py `Fp8Linear`, Triton table only) run all four products through the
matrix-vector kernel reading the FP8 weights with their row scales: each computes x · dequant(W)ᵀ with
x unquantized (weight-only dequantization: the weight bytes are what a small batch pays for), where the
layer loop computes x_q · W_qᵀ with x quantized per token. The two differ by the activations' FP8
rounding (docs/fp8.md).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.models.decoder import Attention, CausalLM, DecoderLayer, KVCache
from tinyvllm.quantization.linear import Fp8Linear


def fp8_product(layer: Fp8Linear, x: torch.Tensor, **fused) -> torch.Tensor:
    """x · dequant(W)ᵀ (+ the layer's bias) by the matrix-vector kernel on the FP8 weight and its row
    scales, with `fused` (residual=, silu_mul=) folded in as for any weight."""
    from tinyvllm.kernels.gemv import fused_gemv_fwd

    return fused_gemv_fwd(x, layer.weight, weight_scale=layer.weight_scale, bias=layer.bias, **fused)


def qkv_projection(attn: Attention, h: torch.Tensor) -> torch.Tensor:
    """h [T, H] → qkv [T, q_size + 2·kv_size] = h Wqkvᵀ (+ bqkv): our matrix-vector kernel, with the bias
    added to its float32 sums as nn.Linear adds it. The reference table's fused product has no bias
    argument, so there a biased layer runs its own nn.Linear (the layer loop's op, same bits)."""
    weight, bias = attn.qkv_proj.weight, attn.qkv_proj.bias
    if isinstance(attn.qkv_proj, Fp8Linear):
        return fp8_product(attn.qkv_proj, h)
    if bias is None:
        return attn.ops.fused_gemv(h, weight)
    if attn.ops.name == "triton":
        from tinyvllm.kernels.gemv import fused_gemv_fwd

        return fused_gemv_fwd(h, weight, bias=bias)
    return attn.qkv_proj(h)


def fused_layer(
    layer: DecoderLayer,
    r: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    meta: AttnMetadata,
    kv_cache: KVCache,
    gemv_gate_up: bool = False,
) -> torch.Tensor:
    """One decoder layer on the fused path: residual stream r [T, H] → the next layer's; `gemv_gate_up`:
    the gate/up product by the matrix-vector kernel instead of cuBLAS."""
    attn, mlp = layer.self_attn, layer.mlp
    gemv = attn.ops.fused_gemv
    qkv = qkv_projection(attn, layer.input_layernorm(r)[0])
    o = attn.attend(qkv, positions, cos_sin, meta, kv_cache)
    if isinstance(attn.o_proj, Fp8Linear):
        r = fp8_product(attn.o_proj, o, residual=r)
    else:
        r = gemv(o, attn.o_proj.weight, residual=r)
    h = layer.post_attention_layernorm(r)[0]
    if isinstance(mlp.gate_up_proj, Fp8Linear):
        gate_up = fp8_product(mlp.gate_up_proj, h)
    elif gemv_gate_up:
        gate_up = gemv(h, mlp.gate_up_proj.weight)
    else:
        gate_up = F.linear(h, mlp.gate_up_proj.weight)
    if isinstance(mlp.down_proj, Fp8Linear):
        return fp8_product(mlp.down_proj, gate_up, silu_mul=True, residual=r)
    return gemv(gate_up, mlp.down_proj.weight, silu_mul=True, residual=r)


def fused_forward(
    model: CausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttnMetadata,
    kv_caches: list[KVCache],
    pdl: bool = False,
) -> torch.Tensor:
    """`model.forward` on the fused path: input_ids, positions [T] → final hidden states [T, H]; `pdl`:
    every product by our kernels (module docstring)."""
    x = model.embed_tokens(input_ids)
    for layer, kv_cache in zip(model.layers, kv_caches):
        x = fused_layer(layer, x, positions, model.cos_sin, meta, kv_cache, gemv_gate_up=pdl)
    return model.norm(x)[0]
