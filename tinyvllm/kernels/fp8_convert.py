"""float32 → float8_e4m3fn inside Triton kernels: saturate to ±448, round to nearest even.

On CUDA the conversion is the hardware's (`cvt.rn.satfinite.e4m3x2.f32` after our clamp). Triton's CPU
interpreter converts exactly representable values correctly but drops the carry when rounding crosses a
power of two (124.95 → 64 instead of 128), so under the interpreter (`EMULATE`) the value is first
rounded in float32 arithmetic and only then converted, exactly:

    a = |x| ≤ 448 with biased float32 exponent E (at least 127 − 6: e4m3's subnormals share the
    spacing of its smallest normal binade); e4m3 spaces a's binade by ulp = 2^(E − 127 − 3).
    With B = 2^(E − 127 + 20) = 2²³ · ulp, a + B lies in [B, 2B), where float32's spacing is ulp, so
    the float32 addition rounds a to a multiple of ulp, ties to even, and (a + B) − B is exact.

The even multiple of ulp is e4m3's even mantissa, so this is e4m3's round-to-nearest-even.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # e4m3fn's largest finite value


@triton.jit
def round_to_e4m3(x):
    """float32 x (|x| ≤ 448) rounded to the nearest e4m3 value (ties to even), still float32."""
    bits = x.to(tl.int32, bitcast=True)
    a = tl.abs(x)
    biased = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased = tl.maximum(biased, 127 - 6)
    big = ((biased + 20) << 23).to(tl.float32, bitcast=True)
    r = (a + big) - big
    return tl.where(bits < 0, -r, r)  # the sign bit: −0 stays −0


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """float32 x → float8_e4m3fn, saturating at ±448; EMULATE: round in float32 first (the interpreter)."""
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    if EMULATE:
        x = round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def cache_value(y, scale, dtype: tl.constexpr, FP8KV: tl.constexpr, EMULATE: tl.constexpr):
    """A K or V value y (float32, already rounded to the model's dtype) as the cache stores it: y in
    `dtype`, or e4m3(y / scale) with FP8KV. One return: the compiler requires every return of a function
    to carry one type, constexpr branches included."""
    if FP8KV:
        stored = to_e4m3(y / scale, EMULATE)
    else:
        stored = y.to(dtype)
    return stored
