"""The fused small-batch decoder path: the model's maths through our matrix-vector kernels.

For a step of T ≤ 16 token rows (the kernels' limit; the runner's `fused_max_tokens`, default 1), each
layer runs with the neighbouring ops folded into the products,

    h   = RMSNorm(r);  qkv = fused_gemv(h, Wqkv) (+ bqkv in the epilogue: Qwen2)
    o   = the model's own attention of qkv (q/k norm, RoPE, cache write, the layer's window)
    r   = fused_gemv(attn, Wo, residual=r)               residual add in the epilogue
    h   = RMSNorm(r);  gu = h Wguᵀ (cuBLAS)
    r   = fused_gemv(gu, Wd, silu_mul=True, residual=r)  SwiGLU in the prologue, residual add in the epilogue

so r is always the complete residual stream (the first layer's is the embeddings). The RMSNorms stay
kernels of their own: folding them into the products' prologue would re-read r in every program. The
roundings are those of the layer loop; only the order of the float32 sums inside the products differs.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.models.decoder import Attention, CausalLM, DecoderLayer, KVCache


def qkv_projection(attn: Attention, h: torch.Tensor) -> torch.Tensor:
    """h [T, H] → qkv [T, q_size + 2·kv_size] = h Wqkvᵀ (+ bqkv): our matrix-vector kernel, with the bias
    added to its float32 sums as nn.Linear adds it. The reference table's fused product has no bias
    argument, so there a biased layer runs its own nn.Linear (the layer loop's op, same bits)."""
    weight, bias = attn.qkv_proj.weight, attn.qkv_proj.bias
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
) -> torch.Tensor:
    """One decoder layer on the fused path: residual stream r [T, H] → the next layer's."""
    attn, mlp = layer.self_attn, layer.mlp
    gemv = attn.ops.fused_gemv
    qkv = qkv_projection(attn, layer.input_layernorm(r)[0])
    o = attn.attend(qkv, positions, cos_sin, meta, kv_cache)
    r = gemv(o, attn.o_proj.weight, residual=r)
    gate_up = F.linear(layer.post_attention_layernorm(r)[0], mlp.gate_up_proj.weight)
    return gemv(gate_up, mlp.down_proj.weight, silu_mul=True, residual=r)


def fused_forward(
    model: CausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttnMetadata,
    kv_caches: list[KVCache],
) -> torch.Tensor:
    """`model.forward` on the fused path: input_ids, positions [T] → final hidden states [T, H]."""
    x = model.embed_tokens(input_ids)
    for layer, kv_cache in zip(model.layers, kv_caches):
        x = fused_layer(layer, x, positions, model.cos_sin, meta, kv_cache)
    return model.norm(x)[0]
