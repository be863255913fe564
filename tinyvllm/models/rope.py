"""Rotary position tables, with Llama 3's frequency-dependent scaling."""

from __future__ import annotations

import math

import torch

from tinyvllm.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """f_i = theta^(−2i/D) for i < D/2, in float32 as Hugging Face computes them, then Llama 3's scaling
    (see `RopeScaling`): long wavelengths divided by `factor`, short ones kept, the band between blended."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def cos_sin_table(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos(p·f) in the first half of each row, sin(p·f) in the second."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
