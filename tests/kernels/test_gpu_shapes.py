"""Every kernel against the reference at real shapes on CUDA: Llama-3.2-1B (32 query / 8 KV heads,
head dim 64) and head dim 128; prefill up to 8k tokens in mixed chunks; decode batch 1..256 at
contexts up to 32k; sliding windows up to 4,096 keys (Mistral 7B); bf16. The reference runs in
float32 on the GPU (TF32 off).

Tolerance (bf16, relative ‖out − ref‖/‖ref‖ ≤ 1e-2): bf16 output rounding (2⁻⁹ relative on average)
plus P rounded to bf16 before P·V, as FlashAttention does, give ~3e-3; 1e-2 leaves margin and still
catches any indexing error, which shows up as O(1) error.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_close, free_below_window, make_paged_cache, packed_queries

from tinyvllm.config import RopeScaling
from tinyvllm.kernels import reference, triton_ops
from tinyvllm.kernels.decode_attention import DEFAULT_CONFIG as DEFAULT_DECODE
from tinyvllm.kernels.decode_attention import DecodeConfig, decode_attention_fwd
from tinyvllm.kernels.gemv import fused_gemv_fwd
from tinyvllm.kernels.prefill_attention import prefill_attention_fwd
from tinyvllm.models.rope import cos_sin_table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def ref_prefill(q, k_cache, v_cache, cu, sl, tables, scale):
    return reference.prefill_attention(q.float(), k_cache.float(), v_cache.float(), cu, sl, tables, scale)


# (q_len, seq_len): a whole 4k prompt, a 2k chunk deep in a 6k context, a one-row chunk, a 1.5k prompt,
# a chunk at the end of an 8k context (prefix-cache hit): 8192 query rows.
MIXED = [(4096, 4096), (2048, 6144), (1, 3000), (1500, 1500), (547, 8000)]
PREFILL_CASES = [  # Hq, Hk, D, block_size, layout
    (32, 8, 64, 16, MIXED),
    (32, 8, 128, 16, MIXED),
    (32, 8, 64, 256, [(8192, 8192)]),
    (32, 8, 64, 1, [(1000, 3000), (333, 333)]),
    (32, 8, 128, 5, [(2000, 2500)]),
]


@pytest.mark.parametrize(
    "hq,hk,d,block_size,layout",
    PREFILL_CASES,
    ids=[f"d{c[2]}-bs{c[3]}-{sum(q for q, _ in c[4])}rows" for c in PREFILL_CASES],
)
def test_prefill_real_shapes(hq, hk, d, block_size, layout):
    gen = torch.Generator(device=CUDA).manual_seed(0)
    q_lens, seq_lens = zip(*layout)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), hk, d, block_size, BF16, CUDA, gen)
    q, cu = packed_queries(list(q_lens), hq, d, BF16, CUDA, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    out = triton_ops.prefill_attention(q, k_cache, v_cache, cu, sl, tables, d**-0.5, max(q_lens))
    assert_close(out, ref_prefill(q, k_cache, v_cache, cu, sl, tables, d**-0.5), BF16)


# Sliding windows (Mistral 7B: 4,096 keys, head dim 128) over the same layouts, with the blocks the KV
# cache may free (wholly below the window of a sequence's first query) pointing at a NaN block.
WINDOW_PREFILL_CASES = [  # Hq, Hk, D, block_size, layout, window
    (32, 8, 128, 16, MIXED, 4096),
    (32, 8, 64, 16, MIXED, 1000),  # off the tile grid
    (32, 8, 128, 5, [(2000, 2500), (3000, 8000)], 777),  # pages off the tile grid
    (32, 8, 128, 16, [(8192, 8192)], 8192),  # as wide as the context
]


@pytest.mark.parametrize(
    "hq,hk,d,block_size,layout,window",
    WINDOW_PREFILL_CASES,
    ids=[f"d{c[2]}-bs{c[3]}-{sum(q for q, _ in c[4])}rows-w{c[5]}" for c in WINDOW_PREFILL_CASES],
)
def test_prefill_window_real_shapes(hq, hk, d, block_size, layout, window):
    gen = torch.Generator(device=CUDA).manual_seed(3)
    q_lens, seq_lens = zip(*layout)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), hk, d, block_size, BF16, CUDA, gen)
    q, cu = packed_queries(list(q_lens), hq, d, BF16, CUDA, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    free_below_window(tables, [s - n for n, s in layout], window, block_size)
    out = triton_ops.prefill_attention(q, k_cache, v_cache, cu, sl, tables, d**-0.5, max(q_lens), window=window)
    ref = reference.prefill_attention(
        q.float(), k_cache.float(), v_cache.float(), cu, sl, tables, d**-0.5, window=window
    )
    assert_close(out, ref, BF16)


WINDOW_DECODE_CASES = [  # batch, contexts (None: all equal to max_ctx), max_ctx, window, head dim
    (1, None, 32768, 4096, 128),
    (16, "random", 8192, 4096, 128),
    (256, "random", 4096, 1000, 64),
    (64, None, 2048, 4096, 128),  # the window covers every context
]


@pytest.mark.parametrize(
    "batch,kind,max_ctx,window,d",
    WINDOW_DECODE_CASES,
    ids=[f"b{c[0]}-{c[1] or 'eq'}-{c[2]}-w{c[3]}-d{c[4]}" for c in WINDOW_DECODE_CASES],
)
def test_decode_window_real_shapes(batch, kind, max_ctx, window, d):
    gen = torch.Generator(device=CUDA).manual_seed(4)
    if kind == "random":
        contexts = torch.randint(1, max_ctx + 1, (batch,), generator=torch.Generator().manual_seed(4)).tolist()
        contexts[batch // 2] = 0  # a padded row
    else:
        contexts = [max_ctx] * batch
    k_cache, v_cache, tables = make_paged_cache(contexts, 8, d, 16, BF16, CUDA, gen)
    free_below_window(tables, [max(c - 1, 0) for c in contexts], window, 16)
    q = torch.randn(batch, 32, d, generator=gen, device=CUDA).to(BF16)
    sl = torch.tensor(contexts, dtype=torch.int32, device=CUDA)
    out = triton_ops.decode_attention(q, k_cache, v_cache, sl, tables, d**-0.5, max(contexts), window=window)
    ref = reference.decode_attention(q.float(), k_cache.float(), v_cache.float(), sl, tables, d**-0.5, window=window)
    assert_close(out, ref, BF16)


def test_cascade_window_real_shapes():
    """64 rows sharing a 2,048-key prefix (128 blocks), contexts 2,100..6,000, window 4,096: the prefix
    lies wholly inside some rows' windows, partly inside others' and below the rest."""
    gen = torch.Generator(device=CUDA).manual_seed(5)
    contexts = torch.randint(2100, 6001, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    k_cache, v_cache, tables = make_paged_cache(contexts, 8, 128, 16, BF16, CUDA, gen, share_prefix=128)
    window = 4096
    q = torch.randn(64, 32, 128, generator=gen, device=CUDA).to(BF16)
    sl = torch.tensor(contexts, dtype=torch.int32, device=CUDA)
    p = torch.tensor([2048], dtype=torch.int32, device=CUDA)
    cfg = DecodeConfig(64, 2, 3, 4, 1)
    out = decode_attention_fwd(
        q, k_cache, v_cache, sl, tables, 128**-0.5, max(contexts), config=cfg, prefix_len=p, window=window
    )
    ref = reference.decode_attention(q.float(), k_cache.float(), v_cache.float(), sl, tables, 128**-0.5, window=window)
    assert_close(out, ref, BF16)


def test_cascade_prefix_stream_matches_one_stream_in_graphs():
    """The prefix kernel on its own stream (`DecodeConfig.prefix_stream`: a fork and a join) writes the same
    partial slots as on the current stream: outputs bitwise equal, eagerly and replayed from a CUDA graph
    captured with the fork (256 rows sharing 1,024 keys, 128 own keys each), and equal to the reference."""
    gen = torch.Generator(device=CUDA).manual_seed(6)
    contexts = [1024 + 128] * 256
    k_cache, v_cache, tables = make_paged_cache(contexts, 8, 64, 16, BF16, CUDA, gen, share_prefix=64)
    q = torch.randn(256, 32, 64, generator=gen, device=CUDA).to(BF16)
    sl = torch.tensor(contexts, dtype=torch.int32, device=CUDA)
    p = torch.tensor([1024], dtype=torch.int32, device=CUDA)
    one, two = (DEFAULT_DECODE._replace(prefix_stream=on) for on in (False, True))

    def run(cfg):
        return decode_attention_fwd(q, k_cache, v_cache, sl, tables, 64**-0.5, 1152, config=cfg, prefix_len=p)

    expected = run(one)
    assert torch.equal(run(two), expected)  # also makes the side stream before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(two)
    q.copy_(torch.randn(q.shape, generator=gen, device=CUDA).to(BF16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, run(one))
    ref = reference.decode_attention(q.float(), k_cache.float(), v_cache.float(), sl, tables, 64**-0.5)
    assert_close(captured, ref, BF16)


DECODE_CASES = [  # batch, contexts (None: all equal to max_ctx), max_ctx
    (1, None, 32768),
    (1, None, 517),
    (16, "random", 8192),
    (64, None, 2048),
    (256, "random", 4096),
    (256, None, 512),
]


@pytest.mark.parametrize(
    "batch,kind,max_ctx", DECODE_CASES, ids=[f"b{c[0]}-{c[1] or 'eq'}-{c[2]}" for c in DECODE_CASES]
)
def test_decode_real_shapes(batch, kind, max_ctx):
    gen = torch.Generator(device=CUDA).manual_seed(1)
    if kind == "random":
        contexts = torch.randint(1, max_ctx + 1, (batch,), generator=torch.Generator().manual_seed(1)).tolist()
        contexts[batch // 2] = 0  # a padded row
    else:
        contexts = [max_ctx] * batch
    k_cache, v_cache, tables = make_paged_cache(contexts, 8, 64, 16, BF16, CUDA, gen)
    q = torch.randn(batch, 32, 64, generator=gen, device=CUDA).to(BF16)
    sl = torch.tensor(contexts, dtype=torch.int32, device=CUDA)
    out = triton_ops.decode_attention(q, k_cache, v_cache, sl, tables, 0.125, max(contexts))
    ref = reference.decode_attention(q.float(), k_cache.float(), v_cache.float(), sl, tables, 0.125)
    assert_close(out, ref, BF16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_default_configs_compile_and_agree(d, dtype):
    """The default tile configs of every head dim and dtype fit the GPU's shared memory and agree."""
    gen = torch.Generator(device=CUDA).manual_seed(d)
    layout = [(300, 300), (129, 700), (1, 64)]
    q_lens, seq_lens = zip(*layout)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), 2, d, 16, dtype, CUDA, gen)
    q, cu = packed_queries(list(q_lens), 8, d, dtype, CUDA, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    out, _ = prefill_attention_fwd(q, k_cache, v_cache, cu, sl, tables, d**-0.5, max(q_lens), return_lse=True)
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, sl, tables, d**-0.5)
    assert_close(out, ref, dtype)
    qd = torch.randn(3, 8, d, generator=gen, device=CUDA).to(dtype)
    out = decode_attention_fwd(qd, k_cache, v_cache, sl, tables, d**-0.5, max(seq_lens))
    ref = reference.decode_attention(qd.double(), k_cache.double(), v_cache.double(), sl, tables, d**-0.5)
    assert_close(out, ref, dtype)


def test_layer_ops_real_shapes():
    gen = torch.Generator(device=CUDA).manual_seed(2)
    T, H, F, hq, hk, d = 8192, 2048, 8192, 32, 8, 64
    x = torch.randn(T, H, generator=gen, device=CUDA).to(BF16)
    r = torch.randn(T, H, generator=gen, device=CUDA).to(BF16)
    w = torch.randn(H, generator=gen, device=CUDA).to(BF16)
    assert_close(triton_ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), BF16, factor=0.4)
    for ours, ref in zip(triton_ops.add_rms_norm(x, r, w, 1e-5), reference.add_rms_norm(x, r, w, 1e-5)):
        assert_close(ours, ref, BF16, factor=0.4)
    g = torch.randn(T, 2 * F, generator=gen, device=CUDA).to(BF16)
    assert_close(triton_ops.silu_and_mul(g), reference.silu_and_mul(g), BF16, factor=0.4)

    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    cos_sin = cos_sin_table(d, 500000.0, scaling, 131072, device=CUDA)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=gen, device=CUDA).to(BF16)
    q = qkv[:, : hq * d].reshape(T, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].reshape(T, hk, d)
    v = qkv[:, (hq + hk) * d :].reshape(T, hk, d)
    positions = torch.randint(0, 131072, (T,), generator=gen, device=CUDA)
    ref_q, ref_k = reference.rope(q.clone(), k.clone(), positions, cos_sin)
    triton_ops.rope(q, k, positions, cos_sin)
    assert_close(q, ref_q, BF16, factor=0.4)
    assert_close(k, ref_k, BF16, factor=0.4)

    num_blocks, bs = 1024, 16
    slots = torch.randperm(num_blocks * bs, device=CUDA)[:T]
    slots[::97] = -1
    caches = [torch.full((num_blocks, hk, bs, d), float("nan"), dtype=BF16, device=CUDA) for _ in range(4)]
    triton_ops.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(), caches[2].nan_to_num())
    assert torch.equal(caches[1].isnan(), caches[3].isnan())

    # The fused RoPE + cache write on fresh inputs: bit for bit the two kernels above, one after the other.
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=gen, device=CUDA).to(BF16)
    fused, split = qkv.clone(), qkv.clone()
    out = [torch.full((num_blocks, hk, bs, d), float("nan"), dtype=BF16, device=CUDA) for _ in range(4)]

    def views(t):
        return (
            t[:, : hq * d].reshape(T, hq, d),
            t[:, hq * d : (hq + hk) * d].reshape(T, hk, d),
            t[:, (hq + hk) * d :].reshape(T, hk, d),
        )

    triton_ops.rope_write_kv(*views(fused), positions, cos_sin, out[0], out[1], slots)
    q2, k2, v2 = views(split)
    triton_ops.rope(q2, k2, positions, cos_sin)
    triton_ops.write_kv_cache(k2, v2, out[2], out[3], slots)
    assert torch.equal(fused, split)
    for a, b in ((out[0], out[2]), (out[1], out[3])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# fused_gemv at the projections of Llama-3.2-1B, Llama-3.1-8B and the Qwen families, each with the fusion the model uses
# there: (N, K, variant). bf16 against the reference in float32 (TF32 off): the output rounding and the
# rounded input transform (bf16 normed values / SwiGLU products, which the float32 reference keeps
# exact) give ~3e-3; 1e-2 as above.
GEMV_SHAPES = [
    (3072, 2048, "norm"),
    (2048, 2048, "residual"),
    (16384, 2048, "norm"),
    (2048, 8192, "silu_residual"),
    (128256, 2048, "plain"),
    (6144, 4096, "norm"),
    (4096, 4096, "residual"),
    (28672, 4096, "norm"),
    (4096, 14336, "silu_residual"),
    # Qwen3-0.6B (query width 2048 ≠ hidden 1024, the tied 151,936-row LM head) and Qwen2.5-1.5B's
    # q/k/v product with its bias (the fused path's "bias" epilogue)
    (4096, 1024, "plain"),
    (1024, 2048, "residual"),
    (6144, 1024, "plain"),
    (1024, 3072, "silu_residual"),
    (151936, 1024, "plain"),
    (2048, 1536, "bias"),
]


def gemv_inputs(M, N, K, variant, gen):
    silu = variant.startswith("silu")
    x = torch.randn(M, 2 * K if silu else K, generator=gen, device=CUDA).to(BF16)
    w = (torch.randn(N, K, generator=gen, device=CUDA) / K**0.5).to(BF16)
    kw = {"silu_mul": True} if silu else {}
    if variant == "norm":
        kw = {"norm_weight": (1 + 0.1 * torch.randn(K, generator=gen, device=CUDA)).to(BF16), "eps": 1e-5}
    if variant.endswith("residual"):
        kw["residual"] = torch.randn(M, N, generator=gen, device=CUDA).to(BF16)
    if variant == "bias":
        kw["bias"] = torch.randn(N, generator=gen, device=CUDA).to(BF16)
    return x, w, kw


@pytest.mark.parametrize("M", [1, 2, 4, 16])
@pytest.mark.parametrize("n,k,variant", GEMV_SHAPES, ids=[f"{s[0]}x{s[1]}-{s[2]}" for s in GEMV_SHAPES])
def test_gemv_real_shapes(n, k, variant, M):
    gen = torch.Generator(device=CUDA).manual_seed(n + k + M)
    x, w, kw = gemv_inputs(M, n, k, variant, gen)
    if variant == "bias":  # the ops table's signature has no bias: the kernel's own entry point
        out = fused_gemv_fwd(x, w, **kw)
        ref = torch.nn.functional.linear(x.float(), w.float(), kw["bias"].float())
        assert_close(out, ref, BF16)
        assert torch.equal(out, fused_gemv_fwd(x, w, **kw)), "split-K must be deterministic"
        return
    out = triton_ops.fused_gemv(x, w, **kw)
    ref = reference.fused_gemv(
        x.float(), w.float(), **{a: v.float() if torch.is_tensor(v) else v for a, v in kw.items()}
    )
    assert_close(out, ref, BF16)
    assert torch.equal(out, triton_ops.fused_gemv(x, w, **kw)), "split-K must be deterministic"


def test_gemv_every_batch_size_and_cuda_graph():
    """M = 1..16 on the split-K shape (down_proj, SwiGLU + residual), then the same calls captured in
    one CUDA graph and replayed three times: the split-K counters reset themselves, so every replay
    gives the eager bits."""
    gen = torch.Generator(device=CUDA).manual_seed(3)
    calls = []
    for M in range(1, 17):
        x, w, kw = gemv_inputs(M, 2048, 8192, "silu_residual", gen)
        ref = reference.fused_gemv(x.float(), w.float(), silu_mul=True, residual=kw["residual"].float())
        eager = triton_ops.fused_gemv(x, w, **kw)
        assert_close(eager, ref, BF16)
        calls.append((x, w, kw, eager))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = [triton_ops.fused_gemv(x, w, **kw) for x, w, kw, _ in calls]
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for out, (_, _, _, eager) in zip(outs, calls):
            assert torch.equal(out, eager)


# The pruned LM head's int8 copy at the LM heads it is made for: the kernel against the torch reference
@pytest.mark.parametrize(("N", "K"), [(128256, 2048), (128256, 3072), (151936, 1024), (128256, 4096)])
def test_int8_rows_real_shapes(N, K):
    from tinyvllm.kernels.int8_rows import quantize_rows, quantize_rows_reference

    gen = torch.Generator(device=CUDA).manual_seed(N + K)
    w = (torch.randn(N, K, generator=gen, device=CUDA) * 0.02).to(torch.bfloat16)
    got, ref = quantize_rows(w), quantize_rows_reference(w)
    assert torch.equal(got.packed, ref.packed) and torch.equal(got.scale, ref.scale)
    torch.testing.assert_close(got.slack, ref.slack, rtol=1e-6, atol=0)
