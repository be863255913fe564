"""The ops table: one named set of kernels, chosen once and passed to the model explicitly.

`get_ops("torch")` gives the pure-torch reference (any device); `get_ops("triton")` gives our Triton
kernels (CUDA, or the CPU under TRITON_INTERPRET=1). Both have exactly the signatures documented in
`tinyvllm.kernels.reference`.

`flash_attention` (kernels/flash_attention_op.py) is the training op: attention differentiable through
our FlashAttention-2 forward and backward kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tinyvllm.kernels.flash_attention_op import flash_attention  # imports triton only when it runs

__all__ = ["BACKENDS", "Ops", "default_backend", "flash_attention", "get_ops"]

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    rope: Callable
    write_kv_cache: Callable
    prefill_attention: Callable
    decode_attention: Callable
    silu_and_mul: Callable
    fused_gemv: Callable | None = None  # small-M matrix product with fused norm / SwiGLU / residual add
    resolve_placeholders: Callable | None = None  # async scheduling's device-side input ids (decode graphs)


def get_ops(backend: str) -> Ops:
    """The ops table for `backend` ("torch" or "triton")."""
    if backend == "torch":
        from tinyvllm.kernels import reference as m
    elif backend == "triton":
        from tinyvllm.kernels import triton_ops as m  # imports triton lazily
    else:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {list(BACKENDS)}")
    return Ops(
        name=backend,
        rms_norm=m.rms_norm,
        add_rms_norm=m.add_rms_norm,
        rope=m.rope,
        write_kv_cache=m.write_kv_cache,
        prefill_attention=m.prefill_attention,
        decode_attention=m.decode_attention,
        silu_and_mul=m.silu_and_mul,
        fused_gemv=m.fused_gemv,
        resolve_placeholders=m.resolve_placeholders,
    )


def default_backend(device_type: str) -> str:
    """Triton on CUDA, the torch reference elsewhere."""
    return "triton" if device_type == "cuda" else "torch"
