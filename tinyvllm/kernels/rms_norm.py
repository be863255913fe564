"""RMSNorm and fused residual-add + RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization", eq. 4), in Hugging Face LlamaRMSNorm's rounding order:

    y = w ⊙ round_x( x / sqrt(mean(x²) + eps) )          (x: [T, H], w: [H])
    add_rms_norm:  r' = round_x(x + residual);  y = rms_norm(r')

All arithmetic in float32 (float64 for float64 inputs). One program per row: the row is read once,
reduced in registers and written once, so the kernel moves the fewest bytes (memory-bound).

`rms_norm_fp8` / `add_rms_norm_fp8` feed an FP8 linear layer that quantizes its input per token: the
same program rounds y to the dtype `rms_norm` stores it in and writes, instead of y, its FP8 codes and
row scale (kernels/fp8_quant.py, bit for bit: s = max|y| / 448, q = e4m3(y / s)), so y never goes
through memory. The residual output is written as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.fp8_quant import empty_quantized, row_scale, store_e4m3
from tinyvllm.kernels.grid_dependency import wait_for_previous
from tinyvllm.kernels.launch import (
    FLOAT_DTYPES,
    check_dim,
    check_float,
    check_last_dim_contiguous,
    next_power_of_2,
    upcast_dot,
)
from tinyvllm.kernels.pdl import options as pdl_options

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    res_out_ptr,
    s_ptr,
    H,
    eps,
    stride_x,
    stride_res,
    stride_y,
    stride_res_out,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    Y_DTYPE: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program per row: y = w ⊙ round(x / sqrt(mean(x²) + eps)), rounded to Y_DTYPE; with HAS_RESIDUAL x
    is first replaced by round(x + residual), which is also stored. Stores y at y_ptr, or with QUANTIZE
    its e4m3 codes there (y_ptr then float8) and its row scale at s_ptr (module docstring). PDL: launched
    as a dependent (kernels/pdl.py)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    wait_for_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    acc_ty = tl.float64 if x.dtype == tl.float64 else tl.float32
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(acc_ty) + r.to(acc_ty)).to(x.dtype)  # r' rounded to x's dtype, as the reference
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(acc_ty)
    mean_sq = tl.sum(xf * xf, axis=0) / H
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    normed = (xf * rstd).to(x.dtype)  # rounded before the weight multiply
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(acc_ty) * normed.to(acc_ty)).to(Y_DTYPE)
    if QUANTIZE:
        y = y.to(tl.float32)  # exact: the rounded y, as a kernel reading it back would see it
        scale = row_scale(tl.max(tl.abs(y), 0))  # masked columns hold 0
        tl.store(s_ptr + row, scale)
        store_e4m3(y_ptr + row * stride_y + cols, y, scale, mask, EMULATE_FP8)
    else:
        tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Checks, then one program per row: (y, None, the new residual or None), or with `quantize` (y's
    codes [T, H] float8_e4m3fn, y's row scales [T] float32, the new residual or None)."""
    check_dim("x", x, 2)
    check_float("x", x, FLOAT_DTYPES if quantize else _DTYPES)
    check_float("weight", weight, FLOAT_DTYPES if quantize else _DTYPES)
    T, H = x.shape
    if weight.shape != (H,):
        raise ValueError(f"weight must have shape ({H},), got {tuple(weight.shape)}")
    check_last_dim_contiguous("x", x)
    weight = weight.contiguous()
    # torch's promotion of `weight * y.to(x.dtype)`: bf16 weight with bf16 x → bf16, fp32 weight → fp32.
    y_dtype = torch.promote_types(weight.dtype, x.dtype)
    if quantize:
        y, scales = empty_quantized(T, H, x.device)
    else:
        y, scales = torch.empty((T, H), dtype=y_dtype, device=x.device), None
    res_out = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        check_last_dim_contiguous("residual", residual)
        res_out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return y, scales, res_out
    block_h = next_power_of_2(H)
    num_warps = 4 if block_h <= 2048 else 8 if block_h <= 8192 else 16
    _rms_norm_kernel[(T,)](
        x,
        residual if residual is not None else x,
        weight,
        y,
        res_out if res_out is not None else y,
        scales if scales is not None else y,
        H,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        y.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        HAS_RESIDUAL=residual is not None,
        QUANTIZE=quantize,
        Y_DTYPE=_TL_DTYPES[y_dtype],
        EMULATE_FP8=upcast_dot(x.device),
        BLOCK_H=block_h,
        num_warps=num_warps,
        **pdl_options(x.device),
    )
    return y, scales, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w ⊙ round(x / sqrt(mean(x²) + eps)); x: [T, H], weight: [H] → [T, H]."""
    y, _, _ = _launch(x, None, weight, eps)
    return y


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """r' = round(x + residual); returns (rms_norm(r'), r'), both new tensors; inputs are not modified."""
    y, _, res_out = _launch(x, residual, weight, eps)
    return y, res_out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x, weight, eps) quantized per token, without storing it: (q [T, H] float8_e4m3fn,
    s [T] float32), bit for bit `quantize_per_token(rms_norm(x, weight, eps))`. float16/bfloat16/float32."""
    q, s, _ = _launch(x, None, weight, eps, quantize=True)
    return q, s


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm with its normed output quantized per token: (q, s, r'), where (q, s) is bit for bit
    `quantize_per_token(add_rms_norm(x, residual, weight, eps)[0])` and r' = round(x + residual)."""
    q, s, res_out = _launch(x, residual, weight, eps, quantize=True)
    return q, s, res_out
