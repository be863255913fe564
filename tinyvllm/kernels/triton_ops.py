"""The Triton ops table: the reference's functions, same names and signatures, as Triton kernels.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (slow; for tests). Importing this module needs
`triton` but no device.
"""

from __future__ import annotations

from tinyvllm.kernels.activation import silu_and_mul, silu_and_mul_fp8
from tinyvllm.kernels.decode_attention import decode_attention
from tinyvllm.kernels.gemv import fused_gemv
from tinyvllm.kernels.kv_cache import write_kv_cache
from tinyvllm.kernels.placeholders import resolve_placeholders
from tinyvllm.kernels.prefill_attention import prefill_attention
from tinyvllm.kernels.rms_norm import add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8
from tinyvllm.kernels.rope import rope, rope_write_kv

__all__ = [
    "add_rms_norm",
    "add_rms_norm_fp8",
    "decode_attention",
    "fused_gemv",
    "prefill_attention",
    "resolve_placeholders",
    "rms_norm",
    "rms_norm_fp8",
    "rope",
    "rope_write_kv",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "write_kv_cache",
]
