"""Launch helpers shared by the Triton kernels: argument checks, device facts, small arithmetic.

Nothing here touches a device at import time; device properties are read on first use and cached.
"""

from __future__ import annotations

import functools

import torch

# Fallback when no CUDA device is present (the CPU interpreter): the H200's multiprocessor count.
DEFAULT_NUM_SMS = 132

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for positive b."""
    return -(-a // b)


def is_power_of_2(n: int) -> bool:
    """Whether n is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of `device` (CUDA), or DEFAULT_NUM_SMS elsewhere (the interpreter)."""
    if device.type == "cuda":
        return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_NUM_SMS


def upcast_dot(device: torch.device) -> bool:
    """Whether kernels must cast bf16 `tl.dot` operands to fp32 first.

    Triton's CPU interpreter (3.9) multiplies bf16 operands of `tl.dot` as their raw uint16 bits;
    bf16 → fp32 is exact and so is the product of two bf16 values in fp32, so the cast computes
    the same function the tensor cores do. On CUDA the cast is never made.
    """
    return device.type != "cuda"


def tma_usable(*tensors: torch.Tensor) -> bool:
    """Whether kernels may read these tensors through tensor descriptors (`tl.make_tensor_descriptor`):
    each base address and every stride but the last (which must be 1) a multiple of 16 bytes, as TMA
    requires of any descriptor the kernels build inside them (whose bases are row and head offsets of
    these tensors), and on CUDA an sm_90 or later device. Elsewhere (the CPU interpreter, the sm_90
    compile-only tests) only the alignment is checked."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
    device = tensors[0].device
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's allocator protocol: `size` bytes of CUDA memory (torch's allocations are 512-byte aligned)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Give Triton a global-memory allocator unless one is set: a kernel that builds tensor descriptors
    on the device writes them into a scratch buffer that the launch allocates through it."""
    import triton

    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # a Triton without this private module: set ours
        pass
    triton.set_allocator(_scratch)


def check_float(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    """Raise TypeError unless t's dtype is one of `allowed`."""
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in allowed]}")


def check_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    """Raise ValueError unless t has `ndim` dimensions."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor lives on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


def check_int(name: str, t: torch.Tensor) -> None:
    """Raise TypeError unless t is int32 or int64."""
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless t's last dimension has unit stride (or a single element)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride()})")


def check_window(window: int | None) -> None:
    """Raise unless `window` (a sliding attention window, in keys) is None or a positive int."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be an int or None, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"window must be at least 1 key, got {window}")


def check_kv_scales(k_scale: float, v_scale: float) -> None:
    """An FP8 cache's scales: positive, finite floats."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise ValueError(f"{name} of an FP8 KV cache must be a positive finite number, got {value!r}")


def check_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, **index_tensors: torch.Tensor
) -> tuple[int, int]:
    """The checks both attention launchers share: q [rows, Hq, D] against caches [N, Hk, bs, D] of q's
    dtype or float8_e4m3fn (an FP8 cache), D a power of two in 16..256, Hq a multiple of Hk, a positive
    scale, integer index tensors on q's device, unit-stride last dimensions. Returns (Hk, block_size)."""
    check_dim("q", q, 3)
    check_dim("k_cache", k_cache, 4)
    check_float("q", q)
    for name, t in index_tensors.items():
        check_int(name, t)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, **index_tensors)
    _, Hq, D = q.shape
    _, Hk, block_size, Dk = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise TypeError(
            f"the caches ({k_cache.dtype}, {v_cache.dtype}) must both be q's dtype ({q.dtype}) or float8_e4m3fn"
        )
    if Dk != D or Hq % Hk:
        raise ValueError(f"q [rows, {Hq}, {D}] does not fit the cache [N, {Hk}, bs, {Dk}]")
    if not is_power_of_2(D) or not 16 <= D <= 256:
        raise ValueError(f"head dim must be a power of two in 16..256, got {D}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or index_tensors["block_tables"].stride(-1) != 1:
        raise ValueError("q, the caches and block_tables must be contiguous in their last dimension")
    return Hk, block_size
