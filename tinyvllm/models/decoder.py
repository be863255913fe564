"""The decoder of every supported family (Llama 3.x, Mistral, Qwen2/2.5, Qwen3) over a packed (varlen)
batch and a paged KV cache.

Per layer, with r the residual stream:
    h = RMSNorm(r);  q, k, v = h Wqkv (+ bqkv: Qwen2)
    q, k ← RMSNorm_head(q), RMSNorm_head(k)   (Qwen3: over each head's head_dim features)
    q, k ← RoPE(q, k, positions);  cache ← (k, v)
    r = r + Attention_W(q, cache) Wo          (W: the layer's sliding window, or plain causal)
    h = RMSNorm(r);  r = r + (silu(h Wg) ⊙ h Wu) Wd
and logits = RMSNorm(r) Wlm (Wlm = Wemb when embeddings are tied).

Q, K and V share one matrix product (`qkv_proj`, rows [q | k | v]) and so do gate and up
(`gate_up_proj`, rows [gate | up]); the loader fills them from Hugging Face's separate tensors.

FP8 layers that quantize their input per token (quantization/linear.py, `takes_fp8_activations`) get it
quantized by the op that produces it: input_layernorm for qkv_proj, post_attention_layernorm for
gate_up_proj, SwiGLU for down_proj write the FP8 codes and row scales of their output (the ops table's
`*_fp8` ops) instead of the output itself, the same bits the layer's own quantization would give.
o_proj quantizes the attention output itself. `fused_fp8_quant=False` turns this off (each layer
quantizes its own input); the results are the same.

The model computes this one way, the layer loop; the engine's model runner may run the same maths by
other paths for small decode steps (fused matrix-vector kernels, the one-launch megakernel, a pruned LM
head: tinyvllm/engine/paths/), reading this model's parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyvllm.config import ModelConfig
from tinyvllm.distributed.group import TPGroup
from tinyvllm.distributed.layers import VocabParallelEmbedding
from tinyvllm.distributed.shard import ModelShard
from tinyvllm.kernels import Ops
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.models.rope import cos_sin_table
from tinyvllm.quantization.config import QuantizationConfig
from tinyvllm.quantization.linear import Fp8Activations, make_linear, takes_fp8_activations

FP8_KV_DTYPE = torch.float8_e4m3fn  # the cache dtype of kv_cache_dtype="fp8"
KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, Hk, block_size, D]
LinearInput = torch.Tensor | Fp8Activations  # a linear layer's input: as is, or quantized per token


def apply_linear(ops: Ops, layer: nn.Module, x: LinearInput) -> torch.Tensor:
    """x · Wᵀ (+ b) by the ops table's product for a plain nn.Linear (its batch-invariant one under
    `batch_invariant`), by the layer itself for a quantized one (Fp8Linear: its own scaled product; from
    Fp8Activations, which such a layer takes when `takes_fp8_activations`, without quantizing x); a
    row-parallel layer's partial product is then summed over its `reduce_group` (make_linear)."""
    if isinstance(x, Fp8Activations):
        y = layer.forward_quantized(x)
    elif type(layer) is nn.Linear:
        y = ops.linear(x, layer.weight, layer.bias)
    else:
        y = layer(x)
    return y if layer.reduce_group is None else layer.reduce_group.all_reduce(y)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual stream): with a residual, adds it first (fused)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[Fp8Activations, torch.Tensor]:
        """forward with the normed output quantized per token for an FP8 layer, by one fused op."""
        if residual is None:
            return Fp8Activations(*self.ops.rms_norm_fp8(x, self.weight, self.eps)), x
        q, scale, residual = self.ops.add_rms_norm_fp8(x, residual, self.weight, self.eps)
        return Fp8Activations(q, scale), residual


def norm_for(
    norm: RMSNorm, fp8: bool, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[LinearInput, torch.Tensor]:
    """norm(x, residual), its output quantized per token when `fp8` (for the FP8 layer it feeds)."""
    return norm.forward_fp8(x, residual) if fp8 else norm(x, residual)


class Attention(nn.Module):
    """Self-attention of one layer. `k_scale`, `v_scale`: an FP8 KV cache stores K / k_scale and V / v_scale
    (1, or the checkpoint's per-layer scales); a cache in the model's dtype ignores them.

    Under tensor parallelism the layer holds its rank's query and KV heads (`shard`): QKV is
    column-parallel, o_proj row-parallel (its all-reduce over `group` completes the layer's output)."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: Ops,
        dtype: torch.dtype,
        quant: QuantizationConfig | None = None,
        shard: ModelShard | None = None,
        group: TPGroup | None = None,
    ) -> None:
        super().__init__()
        shard = ModelShard.whole(config) if shard is None else shard
        self.ops = ops
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = shard.q_size(config.head_dim), shard.kv_size(config.head_dim)
        self.scale = self.head_dim**-0.5
        self.window = config.attention_window(layer)
        hf = f"model.layers.{layer}.self_attn"
        self.qkv_proj = make_linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=config.qkv_bias,
            dtype=dtype,
            quant=quant,
            hf_modules=(f"{hf}.q_proj", f"{hf}.k_proj", f"{hf}.v_proj"),
        )
        self.o_proj = make_linear(
            self.q_size,
            config.hidden_size,
            bias=False,
            dtype=dtype,
            quant=quant,
            hf_modules=(f"{hf}.o_proj",),
            reduce_group=None if shard.is_whole else group,
        )
        self.k_scale = 1.0
        self.v_scale = 1.0
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: LinearInput, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        # x: [T, H] (or quantized, for an FP8 qkv_proj) → [T, H]
        qkv = apply_linear(self.ops, self.qkv_proj, x)
        return apply_linear(self.ops, self.o_proj, self.attend(qkv, positions, cos_sin, meta, kv_cache))

    def attend(
        self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """qkv [T, q_size + 2·kv_size] → RoPE, K/V into the cache, attention → [T, q_size]."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(T * self.num_heads, self.head_dim))[0]
            k = self.k_norm(k.reshape(T * self.num_kv_heads, self.head_dim))[0]
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        kv_scales = {"k_scale": self.k_scale, "v_scale": self.v_scale} if k_cache.dtype == FP8_KV_DTYPE else {}
        q, k = self.ops.rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, **kv_scales)
        D = meta.num_decode_tokens
        decode = prefill = None
        if D:
            decode = self.ops.decode_attention(
                q[:D],
                k_cache,
                v_cache,
                meta.decode_seq_lens,
                meta.decode_block_tables,
                self.scale,
                meta.max_decode_seq_len,
                meta.decode_prefix_len,
                window=self.window,
                **kv_scales,
            )
        if D < T:
            prefill = self.ops.prefill_attention(
                q[D:],
                k_cache,
                v_cache,
                meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens,
                meta.prefill_block_tables,
                self.scale,
                meta.max_prefill_q_len,
                window=self.window,
                **kv_scales,
            )
        # One kind of row (every decode step): its output as it is, with no copy into a joint buffer, which
        # cost a launch a layer.
        parts = [o for o in (decode, prefill) if o is not None]
        out = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else torch.empty_like(q)
        return out.reshape(T, self.q_size)


class MLP(nn.Module):
    """SwiGLU over the rank's MLP columns (`shard`): gate/up column-parallel, down_proj row-parallel.
    With `fused_fp8_quant` and a down_proj that takes per-token FP8 activations, SwiGLU's op writes them."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: Ops,
        dtype: torch.dtype,
        quant: QuantizationConfig | None = None,
        shard: ModelShard | None = None,
        group: TPGroup | None = None,
        *,
        fused_fp8_quant: bool = True,
    ) -> None:
        super().__init__()
        shard = ModelShard.whole(config) if shard is None else shard
        self.ops = ops
        hf = f"model.layers.{layer}.mlp"
        h, f = config.hidden_size, shard.intermediate_size
        self.gate_up_proj = make_linear(
            h, 2 * f, bias=False, dtype=dtype, quant=quant, hf_modules=(f"{hf}.gate_proj", f"{hf}.up_proj")
        )
        self.down_proj = make_linear(
            f,
            h,
            bias=False,
            dtype=dtype,
            quant=quant,
            hf_modules=(f"{hf}.down_proj",),
            reduce_group=None if shard.is_whole else group,
        )
        self.quantize_down_input = fused_fp8_quant and takes_fp8_activations(self.down_proj)

    def activation(self, gate_up: torch.Tensor) -> LinearInput:
        """silu(g) ⊙ u of gate_up = [g | u]: quantized per token when down_proj takes it so."""
        if self.quantize_down_input:
            return Fp8Activations(*self.ops.silu_and_mul_fp8(gate_up))
        return self.ops.silu_and_mul(gate_up)

    def forward(self, x: LinearInput) -> torch.Tensor:
        gate_up = apply_linear(self.ops, self.gate_up_proj, x)
        return apply_linear(self.ops, self.down_proj, self.activation(gate_up))


class DecoderLayer(nn.Module):
    """One layer (module docstring). `fused_fp8_quant`: the norms and SwiGLU quantize the inputs of the
    FP8 layers after them that take per-token activations (False: each such layer quantizes its own)."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: Ops,
        dtype: torch.dtype,
        quant: QuantizationConfig | None = None,
        shard: ModelShard | None = None,
        group: TPGroup | None = None,
        *,
        fused_fp8_quant: bool = True,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, ops, dtype, quant, shard, group)
        self.mlp = MLP(config, layer, ops, dtype, quant, shard, group, fused_fp8_quant=fused_fp8_quant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.quantize_qkv_input = fused_fp8_quant and takes_fp8_activations(self.self_attn.qkv_proj)
        self.quantize_gate_up_input = fused_fp8_quant and takes_fp8_activations(self.mlp.gate_up_proj)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttnMetadata,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm_for(self.input_layernorm, self.quantize_qkv_input, x, residual)
        h = self.self_attn(h, positions, cos_sin, meta, kv_cache)
        h, residual = norm_for(self.post_attention_layernorm, self.quantize_gate_up_input, h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """The decoder: `forward(input_ids, positions, meta, kv_caches)` → final hidden states [T, H];
    `compute_logits(hidden)` → logits [N, V].

    Parameters are created in `dtype` on the current default device (the loader builds the model on the
    meta device and materialises it with `loader.materialize`); `init_rope_table` must run once on the
    real device.
    With `quant`, the decoder layers' linear layers it does not ignore are FP8 (quantization/linear.py);
    the embeddings and the LM head stay in `dtype`.

    Tensor parallelism: `shard` is the rank's slice of the model (distributed/shard.py) and `group` the
    ranks' group; the embedding and the LM head then hold the rank's vocabulary rows, and
    `compute_logits` gathers every rank's columns. Without them the model is whole.

    `fused_fp8_quant`: FP8 layers taking per-token activations get them from the norm or SwiGLU before
    them (module docstring; DecoderLayer). It changes launches, not results.
    """

    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        max_positions: int,
        dtype: torch.dtype,
        quant: QuantizationConfig | None = None,
        shard: ModelShard | None = None,
        group: TPGroup | None = None,
        *,
        fused_fp8_quant: bool = True,
    ) -> None:
        super().__init__()
        shard = ModelShard.whole(config) if shard is None else shard
        assert shard.is_whole or group is not None, "a shard of the model needs its group"
        self.config = config
        self.quant = quant
        self.ops = ops
        self.max_positions = max_positions
        self.shard = shard
        self.group = None if shard.is_whole else group
        h, v = config.hidden_size, shard.vocab_size
        if self.group is None:
            # Given its weight, nn.Embedding skips its random init: on the meta device that init would
            # import torch._dynamo (seconds of start-up on a CPU) for values the loader overwrites anyway.
            self.embed_tokens = nn.Embedding(v, h, _weight=torch.empty(v, h, dtype=dtype))
        else:
            self.embed_tokens = VocabParallelEmbedding(v, h, vocab_start=shard.vocab_start, group=group, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, ops, dtype, quant, shard, self.group, fused_fp8_quant=fused_fp8_quant)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(h, v, bias=False, dtype=dtype)
        self.register_buffer("cos_sin", torch.empty(max_positions, config.head_dim), persistent=False)

    def init_rope_table(self) -> None:
        """Fill the float32 [max_positions, D] cos/sin table on the model's device."""
        c = self.config
        self.cos_sin = cos_sin_table(
            c.head_dim, c.rope_theta, c.rope_scaling, self.max_positions, device=self.embed_tokens.weight.device
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]: the LM head's weight, which is the embedding table when the two are tied (the rank's
        vocabulary rows under tensor parallelism)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor:
        # input_ids, positions: [T] → hidden: [T, H]
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.cos_sin, meta, kv_cache)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[N, H] → [N, V] logits in `dtype` (None: the model's dtype, which the samplers upcast as they read
        it, saving an [N, V] float32 copy per step)."""
        logits = self.ops.linear(hidden, self.lm_head_weight)
        if self.group is not None:
            logits = self.group.all_gather_last(logits)
        return logits if dtype is None else logits.to(dtype)
