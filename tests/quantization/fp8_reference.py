"""A float64 hand reference of float8_e4m3fn rounding, built from the format's definition."""

from __future__ import annotations

import torch


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value, from its definition (bias 7, 3 mantissa bits,
    subnormals at exponent 0, S.1111.111 is NaN), float64 ascending."""
    values = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals and zero
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return torch.tensor(sorted(values), dtype=torch.float64)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3fn grid after clamping to ±448, in float64 (ties: the grid value
    with the even mantissa, i.e. the even index on the grid)."""
    grid = e4m3_grid()
    a = x.double().abs().clamp(max=448.0)
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return torch.sign(x.double()) * grid[pick]
