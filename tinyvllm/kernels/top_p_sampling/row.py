"""What every kernel of the truncating sampler reads of a row, the same way: the floats' order keys,
the logits under the bitmask, l = z · (1 / T), a row's parameters, and min-p's strict threshold.

The threshold search (search.py and its helpers) and the radix select (radix.py) both use these, so that
they compute each value, key and threshold with the same arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.sampling import allowed_by


@triton.jit
def key(x):
    """The float32 x as an int64 that orders as the floats compare: consecutive keys are consecutive
    floats, and −0.0 has +0.0's key 0 (so the key just below 0.0 is the largest negative float, which
    compares below 0.0: −0.0 does not)."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(b >= 0, b, (b ^ 0x7FFFFFFF) + 1)


@triton.jit
def from_key(k):
    """The inverse of `key` (+0.0 for key 0)."""
    b = tl.where(k >= 0, k, (k - 1) ^ 0x7FFFFFFF)
    return b.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def loaded(row_ptr, mask_row_ptr, offs, V, HAS_MASK: tl.constexpr):
    """(z, valid) at `offs`: the logits as float32, −inf past V and where the bitmask disallows."""
    valid = offs < V
    if HAS_MASK:
        valid = valid & allowed_by(mask_row_ptr, offs, valid)
    return tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32), valid


@triton.jit
def scaled(row_ptr, mask_row_ptr, offs, V, inv_t, HAS_MASK: tl.constexpr):
    """l = z · inv_t at `offs` (float32; −inf past V and where the bitmask disallows), −0.0 made +0.0."""
    z, _ = loaded(row_ptr, mask_row_ptr, offs, V, HAS_MASK)
    return z * inv_t + 0.0


@triton.jit
def l_at(g, inv_t):
    """l = z · inv_t (`scaled`'s arithmetic) of the float32 z whose key is g."""
    return from_key(g) * inv_t + 0.0


@triton.jit
def params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row):
    """(1 / T (1 for greedy rows), whether the row truncates, k, p, min_p) of a row."""
    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)  # 0: off
    p = tl.load(top_p_ptr + row)  # ≥ 1: off
    min_p = tl.load(min_p_ptr + row)  # 0: off
    active = (temperature != 0.0) & ((k > 0) | (p < 1.0) | (min_p > 0.0))
    inv_t = 1.0 / tl.where(temperature == 0.0, 1.0, temperature)
    return inv_t, active, k, p, min_p


@triton.jit
def min_p_floor(thr, m, min_p):
    """thr raised to just below max l + log(min_p) (min_p > 0), min-p's strict threshold: every kernel
    that writes a threshold uses this expression, so that min-p cuts where the search's does."""
    if min_p > 0.0:
        thr = tl.maximum(thr, from_key(key(m + tl.log(min_p) + 0.0) - 1))
    return thr
