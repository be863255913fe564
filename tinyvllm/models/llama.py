"""Llama 3.x decoder over a packed (varlen) batch and a paged KV cache.

Per layer, with r the residual stream:
    h = RMSNorm(r);  q, k, v = h Wqkv;  q, k ← RoPE(q, k, positions);  cache ← (k, v)
    r = r + Attention(q, cache) Wo
    h = RMSNorm(r);  r = r + (silu(h Wg) ⊙ h Wu) Wd
and logits = RMSNorm(r) Wlm (Wlm = Wemb when embeddings are tied).

Q, K and V share one matrix product (`qkv_proj`, rows [q | k | v]) and so do gate and up
(`gate_up_proj`, rows [gate | up]); the loader fills them from Hugging Face's separate tensors.

Batch-1 decode steps (T ≤ `fused_max_tokens` rows, default 1) take a fused path when the ops table has
`fused_gemv` and the model allows it (`fuse_small_batches`): the matrix-vector products are our own
kernels wherever they beat cuBLAS on the H200 (docs/perf.md), with the neighbouring ops folded in,
    h   = RMSNorm(r);  qkv = fused_gemv(h, Wqkv)
    r   = fused_gemv(attn, Wo, residual=r)               residual add in the epilogue
    h   = RMSNorm(r);  gu = h Wguᵀ (cuBLAS)
    r   = fused_gemv(gu, Wd, silu_mul=True, residual=r)  SwiGLU in the prologue, residual add in the epilogue
so r is always the complete residual stream (the first layer's is the embeddings); the RMSNorms stay
kernels of their own (folding them into the products' prologue re-reads r in every program: measured
slower), and the LM head of such a batch is a plain fused_gemv. The roundings are those of the unfused
path; only the order of the float32 sums inside the products differs. The kernels serve up to 16 rows,
but at 2–16 rows cuBLAS was faster on the H200, hence the default of 1.

With `enable_decode_megakernel()` (the engine's default on CUDA up to hidden size 2048), a decode step of
one sequence runs all layers and the final norm in one kernel launch instead (models/llama_megakernel.py),
with the same maths and roundings as the fused path.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from tinyvllm.config import ModelConfig
from tinyvllm.kernels import Ops
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.models.rope import cos_sin_table

logger = logging.getLogger(__name__)


class MegakernelDoesNotFit(RuntimeError):
    """The compiled decode megakernel needs more of an SM (shared memory) than this GPU gives one program."""


KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, Hk, block_size, D]
FUSED_MAX_TOKENS = 1  # default: batches up to this many token rows take the fused matrix-vector path


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        # x: [T, H] → [T, H]
        return self.o_proj(self.attend(self.qkv_proj(x), positions, cos_sin, meta, kv_cache))

    def attend(
        self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """qkv [T, q_size + 2·kv_size] → RoPE, K/V into the cache, attention → [T, q_size]."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rope(q, k, positions, cos_sin)
        k_cache, v_cache = kv_cache
        self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        D = meta.num_decode_tokens
        if D:
            out[:D] = self.ops.decode_attention(
                q[:D],
                k_cache,
                v_cache,
                meta.decode_seq_lens,
                meta.decode_block_tables,
                self.scale,
                meta.max_decode_seq_len,
                meta.decode_prefix_len,
            )
        if D < T:
            out[D:] = self.ops.prefill_attention(
                q[D:],
                k_cache,
                v_cache,
                meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens,
                meta.prefill_block_tables,
                self.scale,
                meta.max_prefill_q_len,
            )
        return out.reshape(T, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


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


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops, dtype)
        self.mlp = LlamaMLP(config, ops, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttnMetadata,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, cos_sin, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_fused(
        self, r: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """The small-batch path (module docstring): residual stream r [T, H] → the next layer's."""
        gemv = self.self_attn.ops.fused_gemv
        attn, mlp = self.self_attn, self.mlp
        ln_in, ln_post = self.input_layernorm, self.post_attention_layernorm
        qkv = gemv(ln_in(r)[0], attn.qkv_proj.weight)
        o = attn.attend(qkv, positions, cos_sin, meta, kv_cache)
        r = gemv(o, attn.o_proj.weight, residual=r)
        gate_up = F.linear(ln_post(r)[0], mlp.gate_up_proj.weight)
        return gemv(gate_up, mlp.down_proj.weight, silu_mul=True, residual=r)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, meta, kv_caches) → final hidden states; compute_logits → logits.

    Parameters are created in `dtype` on the current default device (the loader builds it on the meta
    device and materialises it with `to_empty`); `init_rope_table` must run once on the real device.
    `fuse_small_batches` allows the fused path for batches of ≤ `fused_max_tokens` rows (module
    docstring); both can be changed on an existing model (before capturing CUDA graphs).
    """

    def __init__(
        self, config: ModelConfig, ops: Ops, max_positions: int, dtype: torch.dtype, fuse_small_batches: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.fuse_small_batches = fuse_small_batches
        self.fused_max_tokens = FUSED_MAX_TOKENS
        self.max_positions = max_positions
        # Given its weight, nn.Embedding skips its random init: on the meta device that init would import
        # torch._dynamo (seconds of start-up on a CPU) for values the loader overwrites anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin", torch.empty(max_positions, config.head_dim), persistent=False)
        self.decode_megakernel = None  # set by enable_decode_megakernel
        self.lm_head_rows = None  # set by enable_pruned_lm_head

    def enable_decode_megakernel(self, config=None) -> None:
        """Run decode steps of one sequence as one kernel launch (models/llama_megakernel.py); restacks
        the layer weights, so call it after loading them (and before capturing CUDA graphs)."""
        from tinyvllm.kernels.decode_megakernel import MegakernelConfig
        from tinyvllm.models.llama_megakernel import LlamaDecodeMegakernel

        self.decode_megakernel = LlamaDecodeMegakernel(self, config or MegakernelConfig())

    def enable_pruned_lm_head(self) -> None:
        """Keep an int8 copy of the LM head's weight (V·H bytes more) for `sample_pruned`."""
        from tinyvllm.kernels.lm_head_bounds import quantize_rows

        self.lm_head_rows = quantize_rows(self.lm_head_weight)

    def init_rope_table(self) -> None:
        """Fill the float32 [max_positions, D] cos/sin table on the model's device."""
        c = self.config
        self.cos_sin = cos_sin_table(
            c.head_dim, c.rope_theta, c.rope_scaling, self.max_positions, device=self.embed_tokens.weight.device
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def uses_fused_path(self, num_rows: int) -> bool:
        """Whether a batch of `num_rows` token rows (or hidden rows, for the logits) is fused."""
        return self.fuse_small_batches and self.ops.fused_gemv is not None and 0 < num_rows <= self.fused_max_tokens

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor:
        # input_ids, positions: [T] → hidden: [T, H]
        if self.decode_megakernel is not None and input_ids.shape[0] == 1 and meta.num_decode_tokens == 1:
            try:
                return self.decode_megakernel(input_ids, positions, meta, kv_caches)
            except MegakernelDoesNotFit as e:  # raised before anything ran: the layers one by one from now on
                logger.warning("decode megakernel off: %s", e)
                self.decode_megakernel = None
        x = self.embed_tokens(input_ids)
        if self.uses_fused_path(x.shape[0]):
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer.forward_fused(x, positions, self.cos_sin, meta, kv_cache)
            return self.norm(x)[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.cos_sin, meta, kv_cache)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[N, H] → [N, V] logits, in `dtype` (None: the model's dtype, which the samplers upcast as they
        read it, saving a [N, V] float32 copy per step)."""
        if self.uses_fused_path(hidden.shape[0]):
            logits = self.ops.fused_gemv(hidden, self.lm_head_weight)
        else:
            logits = F.linear(hidden, self.lm_head_weight)
        return logits if dtype is None else logits.to(dtype)

    def compute_logits_sampled(
        self,
        hidden: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        ids: torch.Tensor,
        host_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`compute_logits(hidden, dtype=None)`, and every row's id drawn by the fused greedy/Gumbel
        sampler (kernels/sampling.py; temperature [N] float32, 0 = greedy, seeds [N] int64) into `ids`
        [N] int64 and, when given, `host_ids` (pinned). Where the fused Triton product computes the
        logits, its programs also find the sampler's per-block bests and the sampler's reduce kernel
        follows (gemv.py, `sampling=`: two kernels instead of three); else the sampler's own kernels
        follow. Needs the Triton kernels (on CUDA or the interpreter)."""
        if self.uses_fused_path(hidden.shape[0]) and self.ops.name == "triton":
            from tinyvllm.kernels.gemv import GemvSampling, fused_gemv_fwd

            return fused_gemv_fwd(hidden, self.lm_head_weight, sampling=GemvSampling(temperature, seeds, ids, host_ids))
        from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

        logits = self.compute_logits(hidden, dtype=None)
        sample_greedy_or_gumbel(logits, temperature, seeds, out=ids, host_out=host_ids)
        return logits

    def can_sample_pruned(self, num_rows: int) -> bool:
        """Whether `sample_pruned` serves a batch of `num_rows` hidden rows (one, with the int8 copy)."""
        return num_rows == 1 and self.lm_head_rows is not None and self.ops.name == "triton" and self.uses_fused_path(1)

    def sample_pruned(
        self,
        hidden: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        ids: torch.Tensor,
        host_ids: torch.Tensor | None = None,
    ) -> None:
        """`compute_logits_sampled`'s ids for one row without its logits: the int8 copy bounds every
        row's score and the product runs over the few rows that can hold the sampled id
        (kernels/lm_head_bounds.py: the same id, bit for bit, from ~half the LM head's bytes)."""
        if not self.can_sample_pruned(hidden.shape[0]):
            raise RuntimeError("sample_pruned needs enable_pruned_lm_head(), the Triton ops and one row")
        from tinyvllm.kernels.gemv import GemvSampling
        from tinyvllm.kernels.lm_head_bounds import sample_pruned

        sample_pruned(hidden, self.lm_head_weight, self.lm_head_rows, GemvSampling(temperature, seeds, ids, host_ids))
