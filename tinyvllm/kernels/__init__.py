"""The ops table: one named set of kernels, chosen once and passed to the model explicitly.

`get_ops("torch")` gives the pure-torch reference (any device); `get_ops("triton")` gives our Triton
kernels (CUDA, or the CPU under TRITON_INTERPRET=1). Both have exactly the signatures documented in
`tinyvllm.kernels.reference`; `linear` is `F.linear`'s (torch's product: cuBLAS on CUDA).

`batch_invariant=True` swaps in ops whose result for a token row does not depend on the other rows of
the step, on the chunk its prompt was cut into, or on prefix-cache hits (docs/determinism.md): on the
torch backend the row-by-row reference (kernels/batch_invariant.py); on the Triton backend our matrix
product, whose tile changes with M but no row's sum does (kernels/invariant_matmul.py), and one attention
kernel, with the same key tiles, for prefill and decode rows (prefill_attention.invariant_*). No fused small-batch
product there: the runner keeps the fused paths off under it.

`rms_norm_fp8`, `add_rms_norm_fp8` and `silu_and_mul_fp8` return their op's output quantized per token
for an FP8 linear layer (the reference's module docstring); the Triton table fuses the quantization into
the norm / activation kernel.

`flash_attention` (kernels/flash_attention_op.py) is the training op: attention differentiable through
our FlashAttention-2 forward and backward kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.nn import functional as F

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
    rope_write_kv: Callable  # rope, then write_kv_cache of the rotated k and v (one launch on Triton)
    prefill_attention: Callable
    decode_attention: Callable
    silu_and_mul: Callable
    rms_norm_fp8: Callable  # rms_norm, then per-token FP8 quantization: (q, s)
    add_rms_norm_fp8: Callable  # add_rms_norm, the normed output quantized: (q, s, residual)
    silu_and_mul_fp8: Callable  # silu_and_mul, then per-token FP8 quantization: (q, s)
    linear: Callable = F.linear  # x [T, K] @ weightᵀ (+ bias) → [T, N], F.linear's signature
    batch_invariant: bool = False  # every op computes a row the same way whatever the batch
    fused_gemv: Callable | None = None  # small-M matrix product with fused norm / SwiGLU / residual add
    resolve_placeholders: Callable | None = None  # async scheduling's device-side input ids (decode graphs)


def get_ops(backend: str, batch_invariant: bool = False) -> Ops:
    """The ops table for `backend` ("torch" or "triton"), batch-invariant on request (module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {list(BACKENDS)}")
    if batch_invariant:
        return _batch_invariant_ops(backend)
    if backend == "torch":
        from tinyvllm.kernels import reference as m
    else:
        from tinyvllm.kernels import triton_ops as m  # imports triton lazily
        from tinyvllm.kernels.triton_key import persist_triton_key

        persist_triton_key()  # Triton's cache key read back, not rehashed from its whole library
    return Ops(
        name=backend,
        rms_norm=m.rms_norm,
        add_rms_norm=m.add_rms_norm,
        rope=m.rope,
        write_kv_cache=m.write_kv_cache,
        rope_write_kv=m.rope_write_kv,
        prefill_attention=m.prefill_attention,
        decode_attention=m.decode_attention,
        silu_and_mul=m.silu_and_mul,
        rms_norm_fp8=m.rms_norm_fp8,
        add_rms_norm_fp8=m.add_rms_norm_fp8,
        silu_and_mul_fp8=m.silu_and_mul_fp8,
        fused_gemv=m.fused_gemv,
        resolve_placeholders=m.resolve_placeholders,
    )


def _batch_invariant_ops(backend: str) -> Ops:
    from tinyvllm.kernels import reference

    if backend == "torch":
        from tinyvllm.kernels import batch_invariant as m

        return Ops(
            name="torch",
            rms_norm=m.rms_norm,
            add_rms_norm=m.add_rms_norm,
            rope=m.rope,
            write_kv_cache=reference.write_kv_cache,
            rope_write_kv=m.rope_write_kv,
            prefill_attention=m.prefill_attention,
            decode_attention=m.decode_attention,
            silu_and_mul=m.silu_and_mul,
            rms_norm_fp8=m.rms_norm_fp8,
            add_rms_norm_fp8=m.add_rms_norm_fp8,
            silu_and_mul_fp8=m.silu_and_mul_fp8,
            linear=m.linear,
            batch_invariant=True,
            resolve_placeholders=reference.resolve_placeholders,
        )
    from tinyvllm.kernels import invariant_matmul, prefill_attention, triton_ops

    return Ops(
        name="triton",
        rms_norm=triton_ops.rms_norm,  # one program per row, blocks from H alone
        add_rms_norm=triton_ops.add_rms_norm,
        rope=triton_ops.rope,  # one program per row
        write_kv_cache=triton_ops.write_kv_cache,
        rope_write_kv=triton_ops.rope_write_kv,  # one program per row
        prefill_attention=prefill_attention.invariant_prefill_attention,
        decode_attention=prefill_attention.invariant_decode_attention,
        silu_and_mul=triton_ops.silu_and_mul,  # elementwise
        rms_norm_fp8=triton_ops.rms_norm_fp8,  # one program per row, as rms_norm
        add_rms_norm_fp8=triton_ops.add_rms_norm_fp8,
        silu_and_mul_fp8=triton_ops.silu_and_mul_fp8,  # one program per row
        linear=invariant_matmul.linear,
        batch_invariant=True,
        resolve_placeholders=triton_ops.resolve_placeholders,
    )


def default_backend(device_type: str) -> str:
    """Triton on CUDA, the torch reference elsewhere."""
    return "triton" if device_type == "cuda" else "torch"
