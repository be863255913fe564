"""A batch-invariant matrix product: row t of x Wᵀ is computed the same way for every number of rows M.

    out[t, n] = round(Σ_k x[t, k] · W[n, k] (+ b[n]))     x: [M, K], W: [N, K] (nn.Linear layout)

cuBLAS picks its kernel, its tile and its split-K from (M, N, K), so a row's last bits change with the
number of rows beside it (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025, §"Batch
invariant matmul"). Here one tile config serves every M: a program owns a BLOCK_M × BLOCK_N output tile
and walks K in BLOCK_K steps from 0 upwards, accumulating `tl.dot` products in float32; there is no
split-K and no stream-K. Each output element is then the same sequence of float32 tensor-core
accumulations (k-block 0, 1, 2, ...) whatever M is and wherever row t falls inside its tile: rows of a
tile never mix. The bias is added to the float32 sum, rounding once to x's dtype (as F.linear does).

The fixed tile costs speed at small M (a decode step of 8 rows pads its tile to BLOCK_M), which is the
price of the mode; docs/determinism.md has the measurements.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.launch import cdiv, upcast_dot


class MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# One config for every M (that is the point); 16-bit inputs on Hopper: wgmma tiles of 64 × 128 × 64.
DEFAULT_CONFIG = MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (no M == 1 or M % 16 variant)
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (tile m, tile n): out[m-tile, n-tile] = round(x[m-tile] Wᵀ[:, n-tile] (+ b)), K in order."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(x_rows + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(w_rows + ks[:, None], mask=(ks[:, None] < K) & (offs_n[None, :] < N), other=0.0)  # Wᵀ
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: MatmulConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """x [M, K] @ weightᵀ [N, K] (+ bias [N]) → [M, N] in x's dtype, batch-invariant (module docstring).

    float32 inputs multiply exactly (no TF32), so the float32 product is invariant too."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError("x, weight (and bias [N]) must share a dtype")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    c = config
    _matmul_kernel[(cdiv(M, c.block_m), cdiv(N, c.block_n))](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        UPCAST=upcast_dot(x.device),
        IEEE=x.dtype == torch.float32,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's signature over `matmul_fwd` (the batch-invariant ops table's `linear`)."""
    return matmul_fwd(x, weight, bias)
