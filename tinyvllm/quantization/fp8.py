"""FP8 (float8_e4m3fn) numerics: the reference every FP8 kernel and loader is checked against.

e4m3fn has 4 exponent bits (bias 7), 3 mantissa bits, no infinities; its largest finite value is 448
and its smallest subnormal 2⁻⁹. A value x with scale s is stored as q = e4m3(clamp(x / s, ±448)) (round
to nearest, ties to even) and read back as q · s. Scales are float32 and chosen so the largest |x| of
the group maps to 448:

    per output channel (weights):  s_n = max_k |W[n, k]| / 448      W[n, :] ≈ q[n, :] · s_n
    per token (activations):       s_t = max_k |x[t, k]| / 448      x[t, :] ≈ q[t, :] · s_t
    per tensor:                    s   = max |x| / 448

An all-zero group gets s = 1 (any s represents zeros exactly; 1 keeps the division finite). A quantized
product y = x Wᵀ is then y[t, n] = s_t · s_n · Σ_k q_x[t, k] q_W[n, k]: the sum runs over FP8 values
(exact products, float32 accumulation) and the two scales multiply the result once.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 scales amax / 448, with 1 where amax is 0."""
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x / scale, ±448)) in float32 arithmetic; `scale` broadcasts against x."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per output channel of a weight, per token of an activation) quantization of x [M, K] →
    (q [M, K] float8_e4m3fn, scales [M] float32)."""
    scale = amax_scale(x.abs().amax(dim=-1))
    return to_fp8(x, scale[:, None]), scale


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor quantization → (q float8_e4m3fn, scale: a 0-d float32 tensor)."""
    scale = amax_scale(x.abs().amax())
    return to_fp8(x, scale), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q · scale in float32 (`scale` broadcast: [M, 1] per row, 0-d per tensor)."""
    return q.to(torch.float32) * scale
