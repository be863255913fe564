"""The pruned LM head's int8 copy of a weight, by rows: its layout, the torch reference and one Triton kernel.

For W [N, K] (K a multiple of 4), row i gets
    s_i = float32(max_k |w_ik| / 127)                                  (float64 division, then rounded)
    q_ik = clamp(rint(w_ik / s_i), −127, 127)  (float64, ties to even; q_i = 0 where s_i = 0)
    slack_i = ↑f32((‖w_i − s_i q_i‖₂ + ROUNDING_SLACK · ‖w_i‖₂) · (1 + 2⁻⁴⁰))
where ↑f32 rounds up to a float32 and the norms are float64 sums (the factor covers their rounding: a
float64 sum of n non-negative terms errs by at most n · 2⁻⁵³ relative in any order, 2⁻⁴⁰ at n = 8,192;
the kernel's sums, tree-reduced per block, err by far less). kernels/lm_head_bounds.py explains the
slack's use. The bytes u = q + 128 are packed four to an int32 word, word c of a row holding columns
c, c + K/4, c + K/2, c + 3K/4 (byte j from column c + j·K/4).

`quantize_rows` runs `_quantize_rows_kernel`: every row's scale, bytes and slack in one launch, each
program reading its rows twice (the absmax, then the bytes and sums; the second pass mostly from L2).
The torch form (`quantize_rows_reference`, a dozen float64 kernels over chunks of rows) is its
specification: the same scales and bytes bit for bit, the slack the same up to the float64 sums' order
(tests/kernels/test_int8_rows.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.launch import cdiv

ROUNDING_SLACK = 2.0**-10  # relative to ‖w_i‖₂ ‖h‖₂: both fp32 sums' rounding (lm_head_bounds.py)
_ROUND_UP = 1 + 2.0**-40  # the float64 sums' rounding (module docstring)
_RINT_MAGIC = 6755399441055744.0  # 1.5 · 2⁵²: (x + m) − m rounds x to the nearest integer, ties to even


class QuantizedRows(NamedTuple):
    """An int8 copy of a weight [N, K] by rows: packed [N, K/4] int32 (bytes q + 128, module docstring),
    scale [N] float32 (w_i ≈ scale_i · q_i), slack [N] float32 (module docstring)."""

    packed: torch.Tensor
    scale: torch.Tensor
    slack: torch.Tensor


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 (K a multiple of 4) → packed [N, K/4] int32 (`QuantizedRows`)."""
    N, K = q.shape
    u = (q.to(torch.int32) + 128).view(N, 4, K // 4)  # u[:, j, c]: column j·K/4 + c
    return u[:, 0] | (u[:, 1] << 8) | (u[:, 2] << 16) | (u[:, 3] << 24)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """`pack_rows`'s inverse: packed [N, K/4] int32 → q [N, K] int8."""
    u = torch.stack([(packed >> (8 * j)) & 0xFF for j in range(4)], dim=1)  # [N, 4, K/4]
    return (u - 128).to(torch.int8).flatten(1)


def _check(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] % 4:
        raise ValueError(
            f"weight must be a 2-D float tensor with a multiple of 4 columns, got {tuple(weight.shape)} {weight.dtype}"
        )


@torch.no_grad()
def quantize_rows_reference(weight: torch.Tensor, chunk_rows: int = 8192) -> QuantizedRows:
    """The int8 copy of `weight` [N, K] in torch (the module docstring's maths), `chunk_rows` rows at a
    time (the float64 residuals of a chunk are its only large temporary)."""
    _check(weight)
    N, K = weight.shape
    packed = torch.empty((N, K // 4), dtype=torch.int32, device=weight.device)
    scale = torch.empty(N, dtype=torch.float32, device=weight.device)
    slack = torch.empty(N, dtype=torch.float32, device=weight.device)
    for r0 in range(0, N, chunk_rows):
        w = weight[r0 : r0 + chunk_rows].double()
        s = (w.abs().amax(dim=1) / 127.0).float()  # the scale the kernel multiplies by, in float32
        safe = torch.where(s > 0, s, torch.ones_like(s)).double()
        q = torch.clamp(torch.round(w / safe[:, None]), -127, 127)
        q = torch.where(s[:, None] > 0, q, torch.zeros_like(q))
        err = (w - s.double()[:, None] * q).norm(dim=1)
        bound = (err + ROUNDING_SLACK * w.norm(dim=1)) * _ROUND_UP
        b32 = bound.float()
        b32 = torch.where(b32.double() < bound, torch.nextafter(b32, torch.full_like(b32, float("inf"))), b32)
        packed[r0 : r0 + chunk_rows] = pack_rows(q.to(torch.int8))
        scale[r0 : r0 + chunk_rows] = s
        slack[r0 : r0 + chunk_rows] = b32
    return QuantizedRows(packed, scale, slack)


@triton.jit
def _quantize_rows_kernel(
    w_ptr,
    packed_ptr,
    scale_ptr,
    slack_ptr,
    N,
    stride_w,
    K4: tl.constexpr,  # K / 4: packed words per row
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROUNDING: tl.constexpr,
    ROUND_UP: tl.constexpr,
    MAGIC: tl.constexpr,
):
    """BLOCK_R rows a program: their absmax, then bytes, packed words and the two float64 sums."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    base = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)  # |w| of a bf16/fp16/fp32 weight is exact in float32
    for c0 in range(0, K4, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < K4)[None, :]
        for j in tl.static_range(4):
            w = tl.load(base + (j * K4 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1))
    s32 = (amax.to(tl.float64) / 127.0).to(tl.float32)
    s64 = s32.to(tl.float64)
    nonzero = s32 > 0
    safe = tl.where(nonzero, s64, 1.0)
    err2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    norm2 = tl.zeros([BLOCK_R], dtype=tl.float64)
    for c0 in range(0, K4, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < K4)[None, :]
        word = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
        for j in tl.static_range(4):
            w = tl.load(base + (j * K4 + cols)[None, :], mask=mask, other=0.0).to(tl.float64)
            q = (w / safe[:, None] + MAGIC) - MAGIC  # rint, ties to even (|w / s| ≤ 127 here)
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            q = tl.where(nonzero[:, None], q, 0.0)
            e = w - s64[:, None] * q
            err2 += tl.sum(e * e, axis=1)
            norm2 += tl.sum(w * w, axis=1)
            word = word | ((q.to(tl.int32) + 128) << (8 * j))
        tl.store(packed_ptr + rows.to(tl.int64)[:, None] * K4 + cols[None, :], word, mask=mask)
    bound = (tl.sqrt(err2) + ROUNDING * tl.sqrt(norm2)) * ROUND_UP
    b32 = bound.to(tl.float32)
    up = (b32.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)  # next float32 above b32 ≥ 0
    b32 = tl.where(b32.to(tl.float64) < bound, up, b32)
    tl.store(scale_ptr + rows, s32, mask=row_ok)
    tl.store(slack_ptr + rows, b32, mask=row_ok)


@torch.no_grad()
def quantize_rows(weight: torch.Tensor, block_rows: int = 4, block_c: int = 128) -> QuantizedRows:
    """The int8 copy of `weight` [N, K] (a float dtype, K a multiple of 4, unit stride along K) in one
    launch of `_quantize_rows_kernel` (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    _check(weight)
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along its rows")
    N, K = weight.shape
    K4 = K // 4
    packed = torch.empty((N, K4), dtype=torch.int32, device=weight.device)
    scale = torch.empty(N, dtype=torch.float32, device=weight.device)
    slack = torch.empty(N, dtype=torch.float32, device=weight.device)
    block_c = min(block_c, triton.next_power_of_2(K4))
    _quantize_rows_kernel[(cdiv(N, block_rows),)](
        weight,
        packed,
        scale,
        slack,
        N,
        weight.stride(0),
        K4=K4,
        BLOCK_R=block_rows,
        BLOCK_C=block_c,
        ROUNDING=ROUNDING_SLACK,
        ROUND_UP=_ROUND_UP,
        MAGIC=_RINT_MAGIC,
    )
    return QuantizedRows(packed, scale, slack)
