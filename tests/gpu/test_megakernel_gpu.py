"""The decode megakernel on the GPU at the `llama-3.2-1b` shape and at every family's (Qwen3, Qwen2 biases,
sliding windows on every layer or some): one program per SM, grid barriers, split
attention with the ticket merge, against the layer-by-layer path of the same weights.

float32 (TF32 off): only the order of float32 sums differs, so hidden state and logits agree to 1e-5
(relative; the CPU test of 2 layers shows ~2e-7). bfloat16: the 4e-2 bound of tests/models (every
product output rounded to 8 bits; a skipped norm or residual gives 0.27–1.1). The new K/V land in the
cache slot and nowhere else; the barrier counters, tickets and phase C's fixed-point sums are zero after
each launch, so a CUDA graph of the kernel replays to the same result, bitwise, with `split_o` (the default:
its int64 sums are exact, whatever order the atomics land in) and without. Repeated launches on fresh
workspaces and a reused one are bitwise equal (a race between phases shows there first).
The engine's batch-1 greedy decode through the megakernel is compared with transformers in
tests/gpu/test_engine_gpu.py (the "alone" generations).
"""

from __future__ import annotations

import pytest
import torch

from tinyvllm.config import ModelConfig, RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.engine.paths.megakernel import DecodeMegakernel
from tinyvllm.kernels import get_ops
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.decode_megakernel import MegakernelConfig
from tinyvllm.models.checkpoint import make_config
from tinyvllm.models.loader import build_model

pytestmark = pytest.mark.gpu
BLOCK = 16
MAX_CTX = 2048


# Real shapes of every family the megakernel serves, by (preset, config.json overrides): Qwen3-0.6B
# (q/k norm, query width 2048 ≠ hidden 1024, head dim 128, tied embeddings of 151,936 rows) and 1.7B
# (hidden 2048); Qwen2.5-1.5B's q/k/v biases and hidden 1536 with 3 KV heads (groups of 4: its own 12/2
# heads are refused);
# Mistral-7B's layers (4 of them) with a window of 512 keys on each; Qwen3-0.6B with a window on layers
# 14.. only. Contexts up to 1500 run past the windows.
FAMILY_SHAPES = {
    "qwen3-0.6b": ("qwen3-0.6b", {}),
    "qwen3-1.7b": ("qwen3-1.7b", {}),
    "qwen2.5-bias": ("qwen2.5-1.5b", {"num_key_value_heads": 3}),
    "mistral-window": ("mistral-7b", {"num_hidden_layers": 4, "sliding_window": 512}),
    "qwen3-mixed-window": (
        "qwen3-0.6b",
        {"use_sliding_window": True, "sliding_window": 512, "max_window_layers": 14},
    ),
}


def setup(dtype: torch.dtype, preset: str = "llama-3.2-1b", overrides: dict | None = None):
    config = ModelConfig.from_dict(make_config(preset, **(overrides or {})))
    model = build_model(
        config,
        get_ops("triton"),
        model_dir="",
        device=torch.device("cuda"),
        dtype=dtype,
        max_positions=MAX_CTX,
        load_format="dummy",
        seed=0,
    )
    c = config
    gen = torch.Generator(device="cuda").manual_seed(1)
    kv = torch.randn(
        (c.num_hidden_layers, 2, MAX_CTX // BLOCK + 1, c.num_key_value_heads, BLOCK, c.head_dim),
        generator=gen,
        device="cuda",
    ).to(dtype)
    return model, kv


def step(ctx: int, num_blocks: int):
    gen = torch.Generator().manual_seed(ctx)
    table = torch.randperm(num_blocks, generator=gen)[: -(-ctx // BLOCK)].to(torch.int32)
    pos = ctx - 1
    slot = int(table[pos // BLOCK]) * BLOCK + pos % BLOCK
    i32 = torch.int32
    meta = AttnMetadata(
        slot_mapping=torch.tensor([slot]),
        num_decode_tokens=1,
        decode_seq_lens=torch.tensor([ctx], dtype=i32),
        decode_block_tables=table[None, :],
        max_decode_seq_len=ctx,
        num_prefills=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=i32),
        prefill_seq_lens=torch.zeros(0, dtype=i32),
        prefill_block_tables=table[None, :0],
        max_prefill_q_len=0,
        max_prefill_seq_len=0,
    )
    for name in (
        "slot_mapping",
        "decode_seq_lens",
        "decode_block_tables",
        "prefill_cu_seqlens_q",
        "prefill_seq_lens",
        "prefill_block_tables",
    ):
        setattr(meta, name, getattr(meta, name).cuda())
    return torch.tensor([4242], device="cuda"), torch.tensor([pos], device="cuda"), meta, slot


def forward(model, mk, ids, pos, meta, kv):
    """(hidden, float32 logits) of one decode step: through the megakernel `mk`, or with None the
    layer-by-layer fused path, as the runner's paths pick them."""
    paths = ModelExecutor(model, RunnerConfig(decode_megakernel=False, pruned_lm_head=False), "cuda")
    paths.megakernel = mk
    hidden = paths.hidden_states(ids, pos, meta, [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])])
    assert paths.megakernel is mk, "the megakernel did not fit this GPU: the layered path ran instead"
    return hidden, paths.lm_head.logits(hidden)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
@pytest.mark.parametrize("kv_align", [False, True], ids=["", "kv_align"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_megakernel_equals_layered_path_at_1b_shape(dtype, kv_align):
    """One decode step through the megakernel equals the layered path (hidden state, logits, the new
    token's K/V, nothing else in the cache written); with `kv_align` too, phase B's K/V tiles loaded as
    16-byte vectors (the cache here is aligned, so the hint applies)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, kv = setup(dtype)
    mk = DecodeMegakernel(model, MegakernelConfig(kv_align=kv_align))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert mk.workspace.programs == sms  # one program per SM
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    for ctx in (1, 333, 1500):
        ids, pos, meta, slot = step(ctx, kv.shape[2])
        kv_ref, kv_mk = kv.clone(), kv.clone()
        h_ref, l_ref = forward(model, None, ids, pos, meta, kv_ref)
        h, logits = forward(model, mk, ids, pos, meta, kv_mk)
        at = (slice(None), slice(None), slot // BLOCK, slice(None), slot % BLOCK)
        errs = rel(h, h_ref), rel(logits, l_ref), rel(kv_mk[at], kv_ref[at])
        assert max(errs) <= tol, (ctx, errs)
        kv_mk[at] = kv_ref[at]
        assert torch.equal(kv_mk, kv_ref)
        assert int(mk.workspace.barrier.abs().sum()) == 0 and int(mk.workspace.tickets.abs().sum()) == 0
        assert int(torch.count_nonzero(mk.workspace.o_sums)) == 0


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILY_SHAPES))
def test_megakernel_equals_layered_path_for_every_family(family, dtype):
    """As the 1B test above, at each family's real shape (FAMILY_SHAPES), with both phase-C schemes, and with
    `kv_align` (head dim 128 here: the aligned loads are also what removes the register spills).

    float32: the megakernel equals the layered path to 1e-5. bf16: two bf16 computations of 28 layers
    differ by their rounding, which grows with depth, so each is measured against the float32 model on the
    same (unrounded) weights and K/V: the megakernel's error may not exceed 1.25× the layered path's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    preset, overrides = FAMILY_SHAPES[family]
    model, kv = setup(dtype, preset, overrides)
    exact = setup(torch.float32, preset, overrides) if dtype == torch.bfloat16 else None
    c = model.config
    from tinyvllm.engine.paths.megakernel import megakernel_unsupported

    assert megakernel_unsupported(model) is None
    for split_o, kv_align in ((True, False), (False, False), (True, True)):
        mk = DecodeMegakernel(model, MegakernelConfig(split_o=split_o, kv_align=kv_align))
        assert (mk.shape.qk_norm, mk.shape.qkv_bias) == (c.qk_norm, c.qkv_bias)
        for ctx in (1, 333, 1500):
            ids, pos, meta, slot = step(ctx, kv.shape[2])
            kv_ref, kv_mk = kv.clone(), kv.clone()
            h_ref, l_ref = forward(model, None, ids, pos, meta, kv_ref)
            h, logits = forward(model, mk, ids, pos, meta, kv_mk)
            at = (slice(None), slice(None), slot // BLOCK, slice(None), slot % BLOCK)
            if exact is None:
                errs = rel(h, h_ref), rel(logits, l_ref), rel(kv_mk[at], kv_ref[at])
                assert max(errs) <= 1e-5, (split_o, ctx, errs)
            else:
                h32, l32 = forward(exact[0], None, ids, pos, meta, exact[1].clone())
                ours, layered = (rel(h, h32), rel(logits, l32)), (rel(h_ref, h32), rel(l_ref, l32))
                assert all(o <= 1.25 * r for o, r in zip(ours, layered)), (split_o, ctx, ours, layered)
                assert rel(kv_mk[at], kv_ref[at]) <= 4e-2, (split_o, ctx)
            kv_mk[at] = kv_ref[at]
            assert torch.equal(kv_mk, kv_ref)
            assert int(mk.workspace.barrier.abs().sum()) == 0 and int(mk.workspace.tickets.abs().sum()) == 0
        del mk
        torch.cuda.empty_cache()


@torch.no_grad()
@pytest.mark.parametrize("split_o", [True, False], ids=["split_o", "ticket_merge"])
def test_megakernel_replays_in_a_cuda_graph(split_o):
    model, kv = setup(torch.bfloat16)
    mk = DecodeMegakernel(model, MegakernelConfig(split_o=split_o))
    ids, pos, meta, _ = step(700, kv.shape[2])
    eager, _ = forward(model, mk, ids, pos, meta, kv)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured, _ = forward(model, mk, ids, pos, meta, kv)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


@torch.no_grad()
@pytest.mark.parametrize("split_o", [True, False], ids=["split_o", "ticket_merge"])
@pytest.mark.parametrize("ctx", [65, 129, 700])
def test_megakernel_launches_are_bitwise_reproducible(ctx, split_o):
    """No sum's order depends on timing (split_o's atomics add exact fixed-point values; the ticket merge sums
    the splits in order), so every launch must give the same bits (issue #34): a hand-over between phases
    that sometimes reads a stale vector (one that every single-launch tolerance check passes) shows up as a
    launch that differs. Fresh workspaces and a reused one; short contexts, where attention depends most
    on q."""
    model, kv = setup(torch.bfloat16)
    ids, pos, meta, _ = step(ctx, kv.shape[2])
    config = MegakernelConfig(split_o=split_o)
    mk = DecodeMegakernel(model, config)
    first, _ = forward(model, mk, ids, pos, meta, kv.clone())
    for launch in range(12):
        if launch % 3 == 0:
            mk = mk.variant(config)  # the same weights, a fresh workspace: zeroed scratch, counters and tickets
        again, _ = forward(model, mk, ids, pos, meta, kv.clone())
        assert torch.equal(again, first), (launch, float((again.float() - first.float()).abs().max()))


# FP8 (docs/fp8.md): weights float8_e4m3fn with a float32 scale per row, dequantized in registers, and/or a
# float8_e4m3fn KV cache with per-layer scales (≠ 1, different for K and V and from layer to layer).
FP8_KV_SCALES = (0.05, 0.125, 0.5, 0.02)  # layer l takes k_scale, v_scale = these at l % 2 · 2, + 1


def fp8_setup(dtype: torch.dtype, fp8_weights: bool, fp8_kv: bool, preset: str = "llama-3.2-1b"):
    """(model, reference model, kv buffer): with `fp8_weights` the model's decoder linear layers are FP8,
    the dummy weights quantized per row, and the reference's plain layers hold the dequantized weights
    q · s (rounded to dtype); without, both are the same model. With `fp8_kv` the buffer is FP8: the random
    K/V of `setup` stored as e4m3(x) (so K = cache · k_scale), and both models carry the scales."""
    from tinyvllm.models.decoder import CausalLM
    from tinyvllm.quantization.config import QuantizationConfig
    from tinyvllm.quantization.fp8 import quantize_rows
    from tinyvllm.quantization.linear import Fp8Linear

    ref, kv = setup(dtype, preset)
    model = ref
    if fp8_weights:
        with torch.device("cuda"):
            model = CausalLM(ref.config, get_ops("triton"), MAX_CTX, dtype, quant=QuantizationConfig())
        model.init_rope_table()
        with torch.no_grad():
            plain = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                if p.dtype != torch.float8_e4m3fn and not name.endswith("weight_scale"):
                    p.copy_(plain[name])
            for name, module in model.named_modules():
                if isinstance(module, Fp8Linear):
                    linear = ref.get_submodule(name)
                    q, s = quantize_rows(linear.weight.float())
                    module.weight.copy_(q)
                    module.weight_scale.copy_(s)
                    linear.weight.copy_((q.float() * s[:, None]).to(dtype))
    if fp8_kv:
        kv = kv.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        for m in {id(ref): ref, id(model): model}.values():
            for i, layer in enumerate(m.layers):
                j = i % 2 * 2
                layer.self_attn.k_scale, layer.self_attn.v_scale = FP8_KV_SCALES[j], FP8_KV_SCALES[j + 1]
    return model, ref, kv


def e4m3_ordinal(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes → int ordinals in value order (adjacent representable values differ by 1;
    +0 and −0 share 0)."""
    u = codes.view(torch.uint8).to(torch.int32)
    mag = u & 0x7F
    return torch.where(u >= 0x80, -mag, mag)


def first_flip(new_a: torch.Tensor, new_b: torch.Tensor) -> tuple[int | None, torch.Tensor]:
    """Two steps' new K/V codes, [layers, 2, heads, D] each: (the first layer whose codes differ or None,
    that layer's code distances |ordinal_a − ordinal_b|)."""
    dist = (e4m3_ordinal(new_a) - e4m3_ordinal(new_b)).abs()
    differing = dist.flatten(1).amax(1).nonzero()
    if differing.numel() == 0:
        return None, dist[0]
    first = int(differing[0])
    return first, dist[first]


# How far flipped e4m3 codes may move the final hidden state: one code moves every later layer, most at
# one key, where it is that head's whole attention output (docs/perf.md §9 has the sizes seen).
FLIP_TOL = {torch.float32: 1e-2, torch.bfloat16: 1e-1}
# The share of a float32 layer's new codes that may flip (two of the 1B shape's 1,024): values that agree
# to ~1e-7 rarely straddle a rounding midpoint.
MAX_FLIPS = 2 / 1024


@torch.no_grad()
@pytest.mark.parametrize(
    "preset,dtype,fp8_weights,fp8_kv",
    [
        ("llama-3.2-1b", torch.float32, True, False),
        ("llama-3.2-1b", torch.bfloat16, True, False),
        ("llama-3.2-1b", torch.float32, False, True),
        ("llama-3.2-1b", torch.bfloat16, True, True),
        ("qwen3-0.6b", torch.float32, True, True),  # q/k norm: phase B writes the new key, quantized
    ],
    ids=["w-f32", "w-bf16", "kv-f32", "w-kv-bf16", "qwen3-w-kv-f32"],
)
def test_fp8_megakernel_equals_dequantized_reference(preset, dtype, fp8_weights, fp8_kv):
    """The FP8 megakernel (x · dequant(W), the cache read and written with its scales) against the
    reference's layer-by-layer path on the dequantized weights (cuBLAS / our bf16 kernels, and the decode
    attention and KV-write kernels over the same FP8 cache): float32 1e-5 (sum order only), bf16 4e-2 (the
    reference's weights rounded to bf16 add 2⁻⁹ per weight).

    With an FP8 cache the two paths round their new keys and values to e4m3 from values that agree to the
    last bits, not bit for bit: a value that close to a rounding midpoint takes neighbouring codes in the
    two paths, and the flipped code changes every later layer (at one key, the whole attention output of
    its head). So, in float32, every layer before the first one whose new codes differ agrees code for
    code, and in that layer a few codes differ (MAX_FLIPS), each by one e4m3 step (a wrong scale, slot or a
    stale key differs in many codes, or by more). In bf16 the paths' values differ in their last bits
    (2⁻⁸ against e4m3's 2⁻³ steps, more codes apart near zero), so codes differ from the first layer and
    the new K/V agree within 0.1 as a whole. Without a flip the tolerances above hold; after one the hidden
    state agrees within what flipped codes move it (FLIP_TOL)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, ref, kv = fp8_setup(dtype, fp8_weights, fp8_kv, preset)
    mk = DecodeMegakernel(model)
    assert mk.weights.fp8 == fp8_weights
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    kv_tol = tol if not fp8_kv or dtype == torch.float32 else 0.1
    for ctx in (1, 2, 333, 1500):
        ids, pos, meta, slot = step(ctx, kv.shape[2])
        kv_ref, kv_mk = kv.clone(), kv.clone()
        h_ref, l_ref = forward(ref, None, ids, pos, meta, kv_ref)
        h, logits = forward(model, mk, ids, pos, meta, kv_mk)
        at = (slice(None), slice(None), slot // BLOCK, slice(None), slot % BLOCK)
        err = max(rel(h, h_ref), rel(logits, l_ref))
        flip = None
        if fp8_kv:
            flip, dist = first_flip(kv_mk[at], kv_ref[at])
            if flip is not None and dtype == torch.float32:
                flipped = int((dist > 0).sum())
                assert int(dist.max()) == 1 and flipped <= MAX_FLIPS * dist.numel(), (ctx, flip, flipped)
        if flip is None:
            assert err <= tol, (ctx, rel(h, h_ref), rel(logits, l_ref))
            assert rel(kv_mk[at].float(), kv_ref[at].float()) <= kv_tol, ctx
        else:
            assert err <= FLIP_TOL[dtype], (ctx, flip, err)
            before = slice(None) if dtype == torch.bfloat16 else slice(0, flip)
            if flip > 0 or dtype == torch.bfloat16:
                assert rel(kv_mk[at][before].float(), kv_ref[at][before].float()) <= kv_tol, ctx
        kv_mk[at] = kv_ref[at]
        assert torch.equal(kv_mk.view(torch.uint8), kv_ref.view(torch.uint8))
        assert int(mk.workspace.barrier.abs().sum()) == 0 and int(torch.count_nonzero(mk.workspace.o_sums)) == 0


@torch.no_grad()
@pytest.mark.parametrize("split_o", [True, False], ids=["split_o", "ticket_merge"])
def test_fp8_megakernel_reproducible_and_replays_in_a_cuda_graph(split_o):
    """FP8 weights and cache: launches are bitwise equal (fresh workspaces and a reused one), and a CUDA
    graph of the launch replays to the eager result."""
    model, _, kv = fp8_setup(torch.bfloat16, True, True)
    config = MegakernelConfig(split_o=split_o)
    mk = DecodeMegakernel(model, config)
    ids, pos, meta, _ = step(129, kv.shape[2])
    first, _ = forward(model, mk, ids, pos, meta, kv.clone())
    for launch in range(6):
        if launch % 3 == 0:
            mk = mk.variant(config)
        again, _ = forward(model, mk, ids, pos, meta, kv.clone())
        assert torch.equal(again, first), launch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    buf = kv.clone()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured, _ = forward(model, mk, ids, pos, meta, buf)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)
