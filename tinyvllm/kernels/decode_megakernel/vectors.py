"""The activation vectors a phase reads after its barrier: the residual stream and its RMSNorm.

Data written inside the launch is read with `.cg` loads (from L2): an SM's L1 is not coherent with the
other SMs' stores.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def residual_at(r_ptr, o_ptr, offs, mask, SPLIT_O: tl.constexpr):
    """The residual stream at `offs`: r, or with SPLIT_O (phase D after a split phase C) round(round(o) + r),
    o being phase C's int64 fixed-point sums of W_o·attention (`o_group_phase`: 2³² units per 1.0), converted
    to float32 (correctly rounded) and then to r's dtype."""
    x = tl.load(r_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    if SPLIT_O:
        fixed = tl.load(o_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
        o = (fixed.to(tl.float32) * 2.3283064365386963e-10).to(x.dtype)  # × 2⁻³², exact
        x = (x.to(tl.float32) + o.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def rstd(r_ptr, o_ptr, H, eps, BH: tl.constexpr, SPLIT_O: tl.constexpr):
    """1 / sqrt(mean(r²) + eps) of the residual vector r (`residual_at`), as rms_norm.py computes it."""
    cols = tl.arange(0, BH)
    x = residual_at(r_ptr, o_ptr, cols, cols < H, SPLIT_O).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)


@triton.jit
def normed(r_ptr, o_ptr, w_ptr, H, eps, BH: tl.constexpr, SPLIT_O: tl.constexpr):
    """RMSNorm(r; w) of the residual vector (`residual_at`) in rms_norm.py's roundings: [BH] in r's
    dtype, zeros beyond H."""
    cols = tl.arange(0, BH)
    mask = cols < H
    x = residual_at(r_ptr, o_ptr, cols, mask, SPLIT_O)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * inv_rms).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)


@triton.jit
def normed_chunks(
    r_ptr,
    o_ptr,
    w_ptr,
    H,
    eps,
    M: tl.constexpr,
    NC: tl.constexpr,
    CW: tl.constexpr,
    BH: tl.constexpr,
    SPLIT_O: tl.constexpr,
):
    """`normed` laid out as [M, CW]: row c < NC holds columns c·CW + [0, CW), the rows from NC on are zero
    (the A operand of phase D's tensor-core product, `gate_up_dot_unit`)."""
    inv_rms = rstd(r_ptr, o_ptr, H, eps, BH, SPLIT_O)
    c = tl.arange(0, M)[:, None]
    cols = c * CW + tl.arange(0, CW)[None, :]
    ok = (c < NC) & (cols < H)
    x = residual_at(r_ptr, o_ptr, cols, ok, SPLIT_O)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = (x.to(tl.float32) * inv_rms).to(x.dtype)
    return (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)
