"""fused_gemv (kernels/gemv.py) against the reference: every input transform (plain, RMSNorm, SwiGLU)
with and without the residual add, M ∈ {1, 3, 16}, odd N and K (masked tiles), strided rows, the FMA
and the tl.dot paths, with and without split-K.

Two kinds of check:
  * accuracy against a float64 reference on the same rounded inputs (kernel_helpers.TOL);
  * the rounding order against the unfused ops, exactly: with W = I the product is exact, so
    fused_gemv(x, I, ...) must equal rms_norm(x, w) / silu_and_mul(x) / round(x + r) bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_close

from tinyvllm.kernels import reference, triton_ops
from tinyvllm.kernels.gemv import (
    MAX_ROWS,
    TUNED_M1_H200,
    GemvConfig,
    candidate_configs,
    check_config,
    default_config,
    fused_gemv_fwd,
    split_k_tickets,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]
VARIANTS = {
    "plain": {},
    "norm": {"norm": True},
    "silu": {"silu": True},
    "residual": {"res": True},
    "silu_residual": {"silu": True, "res": True},
    "norm_residual": {"norm": True, "res": True},
}
# (name, config): None = the default heuristic (no split at these sizes); forced split-K on both paths.
CONFIGS = [
    ("default", None),
    ("fma_split3", GemvConfig(block_n=16, block_k=32, split_k=3, num_warps=4, num_stages=2, use_dot=False)),
    ("dot_split2", GemvConfig(block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=2, use_dot=True)),
]


def make_inputs(M, N, K, dtype, device, variant, seed):
    """x (a strided row view, as the model's slices), W, and the variant's keyword arguments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    flags = VARIANTS[variant]
    width = 2 * K if flags.get("silu") else K
    x = (torch.randn(M, width + 3, generator=gen, device=device) * 2).to(dtype)[:, 1 : width + 1]
    w = (torch.randn(N, K, generator=gen, device=device) / K**0.5).to(dtype)
    kw = {}
    if flags.get("norm"):
        kw["norm_weight"] = (1 + 0.3 * torch.randn(K, generator=gen, device=device)).to(dtype)
        kw["eps"] = 1e-5
    if flags.get("silu"):
        kw["silu_mul"] = True
    if flags.get("res"):
        kw["residual"] = (torch.randn(M, N, generator=gen, device=device) * 3).to(dtype)
    return x, w, kw


def ref64(x, w, kw):
    return reference.fused_gemv(
        x.double(), w.double(), **{k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()}
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_fused_gemv_vs_float64(dtype, M, variant, device):
    N, K = 50, 77  # neither a multiple of any tile: masked rows and columns on every path
    x, w, kw = make_inputs(M, N, K, dtype, device, variant, seed=M * 31 + len(variant))
    ref = ref64(x, w, kw)
    for name, cfg in CONFIGS:
        out = fused_gemv_fwd(x, w, config=cfg, **kw)
        assert out.shape == (M, N) and out.dtype == dtype, name
        # bf16: the output rounding plus the rounded input transform (norm or SwiGLU): 1.5× TOL.
        assert_close(out, ref, dtype, factor=1.5)


@pytest.mark.parametrize("M", [1, 16])
def test_split_k_real_tile_sizes(M, device):
    """A [96, 1024] product under the default heuristic's tile sizes, split in 4 along K (even tiles:
    the unmasked path) and in 3 (a ragged last split), each against float64 and bit-identical when
    repeated (the split reduction sums in split order whatever order the programs finish in)."""
    N, K = 96, 1024
    x, w, kw = make_inputs(M, N, K, torch.bfloat16, device, "silu_residual", seed=M)
    ref = ref64(x, w, kw)
    base = default_config(M, N, K, 132)
    for split in (4, 3):
        cfg = base._replace(split_k=split)
        out = fused_gemv_fwd(x, w, config=cfg, **kw)
        assert_close(out, ref, torch.bfloat16, factor=1.5)
        assert torch.equal(out, fused_gemv_fwd(x, w, config=cfg, **kw))
    assert not split_k_tickets(device, 1).any(), "split-K counters must be back at zero after each launch"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_roundings_equal_unfused_ops(name, cfg, dtype, device):
    """W = I makes the product exact, so the fused transforms must reproduce the unfused ops' roundings
    bit for bit: those of the Triton ops (the same arithmetic and rounding mode: the CPU interpreter
    truncates to bf16) and, for RMSNorm and the residual add in float16/float32, the torch reference's
    too. (Its SwiGLU writes g·σ(g)·u where the kernels write g/(1 + e^-g)·u: an fp32 ulp apart.)
    x holds multiples of 1/4 below 4 in magnitude, so Σx² is exact in any summation order and rstd is
    the same number in all three."""
    M, K = 3, 40
    gen = torch.Generator(device=device).manual_seed(7)
    x = (torch.randint(-15, 16, (M, 2 * K), generator=gen, device=device) / 4).to(dtype)
    nw = (1 + 0.3 * torch.randn(K, generator=gen, device=device)).to(dtype)
    r = torch.randn(M, K, generator=gen, device=device).to(dtype)
    eye = torch.eye(K, device=device, dtype=dtype)
    xs = x[:, :K]
    # Not bit-exact against the torch reference: bf16 on the CPU (the interpreter truncates where torch
    # rounds), and RMSNorm in float32 on CUDA (torch's rsqrt and Triton's 1/sqrt are an ulp apart; seen
    # on the H200). Against the Triton ops, always bit-exact.
    exact_ref = not (
        (dtype == torch.bfloat16 and device.type == "cpu") or (dtype == torch.float32 and device.type == "cuda")
    )
    cases = [
        (
            fused_gemv_fwd(xs, eye, norm_weight=nw, eps=1e-5, config=cfg),
            triton_ops.rms_norm(xs, nw, 1e-5),
            reference.rms_norm(xs, nw, 1e-5),
            exact_ref,
        ),
        (
            fused_gemv_fwd(xs, eye, residual=r, config=cfg),
            triton_ops.add_rms_norm(xs, r, nw, 1e-5)[1],
            reference.add_rms_norm(xs, r, nw, 1e-5)[1],
            not (dtype == torch.bfloat16 and device.type == "cpu"),
        ),
        (
            fused_gemv_fwd(x, eye, silu_mul=True, config=cfg),
            triton_ops.silu_and_mul(x),
            reference.silu_and_mul(x),
            False,
        ),
    ]
    for ours, tri, ref, exact in cases:
        assert torch.equal(ours, tri)
        if exact:
            assert torch.equal(ours, ref)
        else:
            assert_close(ours, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_residual_added_to_rounded_product(name, cfg, dtype, device):
    """out = round(round(y) + r), as the unfused model (o_proj's output rounded, then add_rms_norm's
    add), not round(y + r). W = I + c·(shift by one) gives y_n = x_n + c·x_{n+1}: two products exact in
    fp32 and one fp32 addition, the same number in every summation order, but not a bf16/fp16 value."""
    M, K = 3, 40
    gen = torch.Generator(device=device).manual_seed(8)
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    r = (torch.randn(M, K, generator=gen, device=device) * 4).to(dtype)
    w = (torch.eye(K, device=device) + 0.71 * torch.eye(K, device=device).roll(1, dims=1)).to(dtype)
    out = fused_gemv_fwd(x, w, residual=r, config=cfg)
    y = fused_gemv_fwd(x, w, config=cfg)
    assert torch.equal(out, triton_ops.add_rms_norm(y, r, r[0], 1e-5)[1])
    if dtype == torch.float16 or device.type == "cuda":  # torch rounds as the kernel does
        y_exact = (x.float() @ w.float().T).to(dtype)
        assert torch.equal(y, y_exact)
        assert torch.equal(out, (y_exact.float() + r.float()).to(dtype))
        assert not torch.equal(out, ((x.float() @ w.float().T) + r.float()).to(dtype))


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_bias_added_before_the_one_rounding(name, cfg, dtype, M, device):
    """out = round(y + b), as nn.Linear (Qwen2's qkv_proj) computes it, not round(round(y) + b): against
    float64 on random inputs (split-K sums included), and exactly with W = I + ½·(shift by one), whose
    y_n = x_n + ½·x_{n+1} is one float32 number in every summation order."""
    N, K = 50, 77
    x, w, _ = make_inputs(M, N, K, dtype, device, "plain", seed=M + 11)
    b = (torch.randn(N, generator=torch.Generator(device=device).manual_seed(M), device=device) * 2).to(dtype)
    out = fused_gemv_fwd(x, w, bias=b, config=cfg)
    assert_close(out, x.double() @ w.double().T + b.double(), dtype, factor=1.5)
    K = 40
    gen = torch.Generator(device=device).manual_seed(9)
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    b = (torch.randn(K, generator=gen, device=device) * 4).to(dtype)
    # c = 1/2: c·x is exact in float32 for float32 x too, so y_n is one rounding whether or not the
    # products are fused into FMAs (with c = 0.71 a float32 x makes fma and mul+add differ).
    w = (torch.eye(K, device=device) + 0.5 * torch.eye(K, device=device).roll(1, dims=1)).to(dtype)
    y32 = x.float() @ w.float().T
    out = fused_gemv_fwd(x, w, bias=b, config=cfg)
    if dtype == torch.float32 or device.type == "cuda" or dtype == torch.float16:  # torch rounds as the kernel
        assert torch.equal(out, (y32 + b.float()).to(dtype))
    if dtype != torch.float32:
        assert not torch.equal(out, (y32.to(dtype).float() + b.float()).to(dtype))


def test_bias_argument_errors(device):
    x, w = torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="bias must be"):
        fused_gemv_fwd(x, w, bias=torch.zeros(5, device=device))
    with pytest.raises(ValueError, match="not both"):
        fused_gemv_fwd(x, w, bias=torch.zeros(4, device=device), residual=torch.zeros(2, 4, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_table_function_matches_reference(dtype, device):
    """The ops-table entry (reference signature, default config) on a decode-like shape."""
    x, w, kw = make_inputs(2, 130, 96, dtype, device, "norm", seed=3)
    out = triton_ops.fused_gemv(x, w, **kw)
    assert_close(out, reference.fused_gemv(x, w, **kw), dtype, factor=1.5)


def test_strided_weight_rows_and_empty(device):
    gen = torch.Generator(device=device).manual_seed(4)
    big = torch.randn(20, 70, generator=gen, device=device)
    w = big[:, 3:67]  # row stride 70, unit column stride
    x = torch.randn(5, 64, generator=gen, device=device)
    assert_close(fused_gemv_fwd(x, w), x.double() @ w.double().T, torch.float32)
    assert fused_gemv_fwd(x[:0], w).shape == (0, 20)


def test_argument_errors(device):
    x = torch.zeros(2, 8, device=device)
    w = torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="at most"):
        fused_gemv_fwd(torch.zeros(MAX_ROWS + 1, 8, device=device), w)
    with pytest.raises(ValueError, match="columns"):
        fused_gemv_fwd(x, w, silu_mul=True)
    with pytest.raises(ValueError, match="not both"):
        fused_gemv_fwd(torch.zeros(2, 16, device=device), w, silu_mul=True, norm_weight=torch.ones(8, device=device))
    with pytest.raises(TypeError, match="share a dtype"):
        fused_gemv_fwd(x, w.half())
    with pytest.raises(ValueError, match="residual"):
        fused_gemv_fwd(x, w, residual=torch.zeros(2, 5, device=device))
    with pytest.raises(ValueError, match=r"tl\.dot"):
        fused_gemv_fwd(x, w, config=GemvConfig(8, 16, 1, 4, 2, True))


@pytest.mark.parametrize("M", [1, 2, 4, 16])
def test_heuristic_at_llama_shapes(M):
    """Host-only: the default configs at the Llama-3.2-1B / 3.1-8B shapes on 132 SMs are valid, split
    only where N gives too few programs, and each split covers whole, equal K tiles."""
    shapes = [
        (3072, 2048),
        (2048, 2048),
        (16384, 2048),
        (2048, 8192),
        (128256, 2048),
        (6144, 4096),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
    ]
    for N, K in shapes:
        for norm in (False, True):
            cfg = default_config(M, N, K, 132, norm=norm)
            check_config(cfg)
            if M == 1 and not norm and (N, K) in TUNED_M1_H200:
                assert cfg == TUNED_M1_H200[N, K]  # measured on the H200, whatever the heuristic says
                continue
            assert cfg.use_dot == (M > 1)
            programs = -(-N // cfg.block_n) * cfg.split_k
            assert cfg.split_k == 1 or programs <= 2 * 4 * 132, (N, K, cfg)
            assert K % (cfg.split_k * cfg.block_k) == 0, (N, K, cfg)
            if norm:  # the prologue's re-reads of x stay below the weight bytes
                assert programs * M <= N
        assert default_config(M, 128256, 2048, 132).split_k == 1
    assert default_config(1, 2048, 8192, 132).split_k == 4
    for cfg in candidate_configs(M, 2048, 8192, 132):
        check_config(cfg)
