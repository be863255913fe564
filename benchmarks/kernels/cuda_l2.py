"""L2 persistence through the CUDA driver API (ctypes): the helpers `bench_l2_residency.py` measures with.

Since compute capability 8.0 the driver can set aside part of L2 for *persisting* accesses
(`cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)`): lines a kernel reads with the persisting property
stay there, and ordinary accesses use that part of L2 only while persisting lines do not. A kernel gets
the property through an access-policy window, an address range [base, base + num_bytes) of which a
fraction `hit_ratio` of the lines is accessed as persisting; a captured graph carries one per kernel
node (`cuGraphKernelNodeSetAttribute`). The idea measured: a batch-1 decode step streams 2.47 GB of
weights through the H200's 62.9 MB of L2, so nothing survives from one step to the next; keeping the
LM head's last rows in the set-aside would serve them from L2 in every step. On the lent H200 it did
not (docs/perf.md, v16): the engine does not use this.

torch exposes neither the limit nor the window; the functions return None or 0 where there is no
CUDA driver.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

_CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
_CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
_CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_CU_GRAPH_NODE_TYPE_KERNEL = 0
_CU_ACCESS_PROPERTY_NORMAL, _CU_ACCESS_PROPERTY_STREAMING, _CU_ACCESS_PROPERTY_PERSISTING = 0, 1, 2


class _AccessPolicyWindow(ctypes.Structure):  # CUaccessPolicyWindow
    _fields_ = [
        ("base_ptr", ctypes.c_void_p),
        ("num_bytes", ctypes.c_size_t),
        ("hitRatio", ctypes.c_float),
        ("hitProp", ctypes.c_int),
        ("missProp", ctypes.c_int),
    ]


class _LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes
    _fields_ = [("pad", ctypes.c_char * 64), ("accessPolicyWindow", _AccessPolicyWindow)]


class L2Limits(NamedTuple):
    """What the device allows: its L2 size, the most of it that can be set aside for persisting
    accesses, and the longest access-policy window, in bytes."""

    l2_bytes: int
    max_persisting_bytes: int
    max_window_bytes: int


class AccessPolicyWindow(NamedTuple):
    """[base_ptr, base_ptr + num_bytes): a fraction hit_ratio of its lines accessed as persisting, the
    rest as ordinary accesses."""

    base_ptr: int
    num_bytes: int
    hit_ratio: float


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _check(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        lib = _driver()
        if lib is not None:
            lib.cuGetErrorString(result, ctypes.byref(message))
        text = message.value.decode() if message.value else "unknown error"
        raise RuntimeError(f"{what} failed: CUDA driver error {result} ({text})")


def l2_limits(device: torch.device) -> L2Limits | None:
    """The device's L2 limits, or None where there is no CUDA device or driver."""
    lib = _driver()
    if device.type != "cuda" or lib is None or not torch.cuda.is_available():
        return None
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    handle = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(handle), ordinal), "cuDeviceGet")
    values = [torch.cuda.get_device_properties(ordinal).L2_cache_size]
    for attribute in (
        _CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
        _CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE,
    ):
        value = ctypes.c_int()
        _check(lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, handle), "cuDeviceGetAttribute")
        values.append(value.value)
    return L2Limits(*values)


def persisting_l2_bytes() -> int:
    """The current context's set-aside for persisting accesses, in bytes (0 without a driver)."""
    lib = _driver()
    if lib is None:
        return 0
    value = ctypes.c_size_t()
    _check(lib.cuCtxGetLimit(ctypes.byref(value), _CU_LIMIT_PERSISTING_L2_CACHE_SIZE), "cuCtxGetLimit")
    return value.value


def set_persisting_l2_bytes(nbytes: int) -> int:
    """Set aside `nbytes` of L2 (the driver rounds it and caps it at the device's maximum) for the
    current context's persisting accesses; 0 gives it back. Returns the set-aside now in force. The
    context must be current (any CUDA work by torch on this thread makes it so)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    lib = _driver()
    if lib is None:
        raise RuntimeError("no CUDA driver: cannot set aside L2")
    torch.cuda.init()
    _check(lib.cuCtxSetLimit(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(nbytes)), "cuCtxSetLimit")
    return persisting_l2_bytes()


def reset_persisting_l2() -> None:
    """Demote every persisting line in L2 to an ordinary one (cuCtxResetPersistingL2Cache)."""
    lib = _driver()
    if lib is not None:
        _check(lib.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")


def lm_head_window(weight: torch.Tensor, persisting_bytes: int, max_window_bytes: int) -> AccessPolicyWindow | None:
    """The window over the last whole rows of `weight` [rows, K] (contiguous) that fit in both the
    set-aside and the longest window, all of them persisting; None when not one row fits."""
    if not weight.is_contiguous() or weight.dim() != 2:
        raise ValueError("the LM head's weight must be a contiguous [rows, K] matrix")
    row_bytes = weight.shape[1] * weight.element_size()
    rows = min(weight.shape[0], min(persisting_bytes, max_window_bytes) // row_bytes)
    if rows <= 0:
        return None
    base = weight.data_ptr() + (weight.shape[0] - rows) * row_bytes
    return AccessPolicyWindow(base, rows * row_bytes, 1.0)


def _kernel_nodes(raw_graph: int) -> list[ctypes.c_void_p]:
    lib = _driver()
    count = ctypes.c_size_t()
    _check(lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    kernels = []
    for node in nodes:
        kind = ctypes.c_int()
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == _CU_GRAPH_NODE_TYPE_KERNEL:
            kernels.append(ctypes.c_void_p(node))
    return kernels


def set_graph_window(raw_graph: int, window: AccessPolicyWindow) -> int:
    """Give every kernel node of a captured, not yet instantiated graph (`CUDAGraph(keep_graph=True)`'s
    `raw_cuda_graph()`) the access-policy window; lines outside it are ordinary accesses. Returns the
    number of kernel nodes. Instantiate the graph afterwards: an executable graph keeps the attributes
    its nodes had when it was instantiated."""
    value = _LaunchAttributeValue()
    value.accessPolicyWindow = _AccessPolicyWindow(
        window.base_ptr, window.num_bytes, window.hit_ratio, _CU_ACCESS_PROPERTY_PERSISTING, _CU_ACCESS_PROPERTY_NORMAL
    )
    nodes = _kernel_nodes(raw_graph)
    for node in nodes:
        _check(
            _driver().cuGraphKernelNodeSetAttribute(
                node, _CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(value)
            ),
            "cuGraphKernelNodeSetAttribute",
        )
    return len(nodes)


def graph_windows(raw_graph: int) -> list[AccessPolicyWindow]:
    """The access-policy window of every kernel node of a graph (num_bytes 0: none), for checks."""
    out = []
    for node in _kernel_nodes(raw_graph):
        value = _LaunchAttributeValue()
        _check(
            _driver().cuGraphKernelNodeGetAttribute(
                node, _CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(value)
            ),
            "cuGraphKernelNodeGetAttribute",
        )
        w = value.accessPolicyWindow
        out.append(AccessPolicyWindow(w.base_ptr or 0, w.num_bytes, w.hitRatio))
    return out
