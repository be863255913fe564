"""`flash_attention`: softmax attention as a training op, a `torch.autograd.Function` whose forward and
backward are our FlashAttention-2 Triton kernels (`flash_forward`, `flash_backward`), with the torch
reference (`reference.attention`, plain autograd) as the fallback.

    out = flash_attention(q, k, v, causal=True, cu_seqlens=None, scale=None)

Layouts: packed variable lengths, q [T, Hq, D] and k, v [T, Hk, D] with `cu_seqlens` [S + 1] int32 (row
offsets of S sequences, self-attention: each sequence's queries attend to its own keys), or dense
[B, L, H, D] (batch, length, heads, head dim: FlashAttention's `flash_attn_func` layout), which is
packed by a reshape. Query head h reads KV head h // (Hq / Hk) (GQA, MQA); scale defaults to D^−½.

Backends: "triton" (CUDA, or the CPU under TRITON_INTERPRET=1) or "torch" (any device); None picks
Triton on CUDA and the reference elsewhere. The kernels take float16 and bfloat16 (float32
accumulation; P and dS rounded to the input dtype before their matrix products, as FA2) and float32 and
float64 (IEEE products, accumulating in float32 resp. float64: for tests and `gradcheck`; float64 only
under the interpreter), head dims 16, 32, 64 and 128. Everything else is a TypeError/ValueError naming
the fix (often backend="torch"). By default (`deterministic=True`) two backward passes give bitwise
equal gradients; `deterministic=False` lets dQ be summed with float32 atomic adds in an order that
varies from run to run (`flash_backward`'s "atomic" dQ mode).
"""

from __future__ import annotations

import itertools
import os
from typing import NamedTuple

import torch

from tinyvllm.kernels import reference
from tinyvllm.kernels.launch import check_last_dim_contiguous, check_same_device

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_HEAD_DIMS = (16, 32, 64, 128)


class ForwardConfig(NamedTuple):
    """Tiles of the forward: block_m query rows per program, block_n keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class BackwardConfig(NamedTuple):
    """Tiles of the backward: the dK/dV kernel owns dkdv_n keys and loops over dkdv_m query rows at a
    time; the dQ kernel owns dq_m query rows and loops over dq_n keys; the preprocess (and the fused
    modes' dQ conversion) takes block_pre rows. dq_mode (`flash_backward` module docstring): "separate"
    (a second pass, deterministic), "atomic" (dQ added inside the dK/dV kernel, not deterministic) or
    "ordered" (the same adds in a fixed order, deterministic); the fused modes ignore the dq_* fields.

    Hopper options, off unless set (the kernels then load through pointers; `HOPPER_BACKWARD` sets
    dkdv_tma, and dkdv_ws past SHORT_SEQLEN, at head dim 128): dkdv_tma / dq_tma make that kernel read
    its Q, K, V and dO tiles through tensor descriptors (TMA on sm_90) where the tensors' alignment
    allows (`launch.tma_usable`; else pointer loads); dkdv_ws / dq_ws ask Triton to warp-specialise
    that kernel's inner loops (`tl.range(..., warp_specialize=True)`; not with "ordered")."""

    dkdv_m: int
    dkdv_n: int
    dkdv_warps: int
    dkdv_stages: int
    dq_m: int
    dq_n: int
    dq_warps: int
    dq_stages: int
    block_pre: int = 64
    dq_mode: str = "separate"
    dkdv_tma: bool = False
    dkdv_ws: bool = False
    dq_tma: bool = False
    dq_ws: bool = False


DETERMINISTIC_DQ_MODES = ("separate", "ordered")


# 16-bit inputs on Hopper (227 KB of shared memory per SM): per head dim, (config for sequences up to
# SHORT_SEQLEN, config for longer ones). HOPPER_BACKWARD is the deterministic default, HOPPER_BACKWARD_ATOMIC
# the one `deterministic=False` takes. Both tables are printed, ready to paste, by
# `benchmarks/kernels/bench_attention_backward.py --sweep` (candidates in attention_backward_sweep.py);
# the entries below are that sweep's winners (docs/perf.md section 3a: L 1k for the short entry, the
# geometric mean over L 4k and 16k for the long one; 16 and 32 keep the d 64 candidates' small tiles). At
# d 128 the dK/dV kernel reads its tiles by TMA, and beyond SHORT_SEQLEN runs its loop warp-specialised.
SHORT_SEQLEN = 2048
HOPPER_BACKWARD: dict[int, tuple[BackwardConfig, BackwardConfig]] = {
    16: (BackwardConfig(32, 128, 4, 5, 128, 32, 4, 5, 64), BackwardConfig(32, 128, 4, 5, 128, 32, 4, 5, 64)),
    32: (BackwardConfig(32, 128, 4, 5, 128, 32, 4, 5, 64), BackwardConfig(32, 128, 4, 5, 128, 32, 4, 5, 64)),
    64: (BackwardConfig(32, 64, 4, 3, 64, 32, 4, 3, 64), BackwardConfig(64, 128, 4, 3, 128, 64, 4, 3, 64)),
    128: (
        BackwardConfig(64, 64, 4, 2, 64, 64, 4, 2, 64, dkdv_tma=True),
        BackwardConfig(64, 128, 8, 3, 128, 64, 8, 3, 64, dkdv_tma=True, dkdv_ws=True),
    ),
}
HOPPER_BACKWARD_ATOMIC: dict[int, tuple[BackwardConfig, BackwardConfig]] = {
    16: (
        BackwardConfig(32, 128, 4, 3, 0, 0, 0, 0, 64, "atomic"),
        BackwardConfig(32, 128, 4, 3, 0, 0, 0, 0, 64, "atomic"),
    ),
    32: (
        BackwardConfig(32, 128, 4, 3, 0, 0, 0, 0, 64, "atomic"),
        BackwardConfig(32, 128, 4, 3, 0, 0, 0, 0, 64, "atomic"),
    ),
    64: (
        BackwardConfig(64, 64, 4, 2, 0, 0, 0, 0, 64, "atomic"),
        BackwardConfig(64, 128, 8, 3, 0, 0, 0, 0, 64, "atomic"),
    ),
    128: (
        BackwardConfig(64, 128, 8, 3, 0, 0, 0, 0, 64, "atomic"),
        BackwardConfig(64, 128, 8, 3, 0, 0, 0, 0, 64, "atomic"),
    ),
}
HOPPER_FORWARD: dict[int, ForwardConfig] = {
    16: ForwardConfig(128, 64, 4, 3),
    32: ForwardConfig(128, 64, 4, 3),
    64: ForwardConfig(128, 64, 4, 3),
    128: ForwardConfig(128, 64, 8, 3),
}
# The CPU interpreter: small tiles (several per sequence at test lengths), no pipelining.
INTERPRETER_FORWARD = ForwardConfig(16, 16, 4, 1)
INTERPRETER_BACKWARD = BackwardConfig(16, 16, 4, 1, 16, 16, 4, 1, 16)


def default_configs(
    head_dim: int, dtype: torch.dtype, device: torch.device, max_seqlen: int | None = None, deterministic: bool = True
) -> tuple[ForwardConfig, BackwardConfig]:
    """Tile configs for this head dim, dtype, device and longest sequence (None: a long one): the Hopper
    tables for 16-bit inputs (HOPPER_BACKWARD_ATOMIC when not deterministic), their tiles halved for 4-
    and 8-byte inputs, 2 pipeline stages before Hopper (less shared memory)."""
    if device.type != "cuda":
        return INTERPRETER_FORWARD, INTERPRETER_BACKWARD._replace(dq_mode="separate" if deterministic else "atomic")
    table = HOPPER_BACKWARD if deterministic else HOPPER_BACKWARD_ATOMIC
    short, long = table[head_dim]
    fwd, bwd = HOPPER_FORWARD[head_dim], short if max_seqlen is not None and max_seqlen <= SHORT_SEQLEN else long
    if dtype in (torch.float32, torch.float64):
        fwd = fwd._replace(block_m=fwd.block_m // 2, block_n=fwd.block_n // 2, num_stages=2)
        bwd = bwd._replace(
            dkdv_m=bwd.dkdv_m // 2, dkdv_n=bwd.dkdv_n // 2, dkdv_stages=2,
            dq_m=max(bwd.dq_m // 2, 16), dq_n=max(bwd.dq_n // 2, 16), dq_stages=2,
        )  # fmt: skip
    if torch.cuda.get_device_capability(device)[0] < 9:
        fwd = fwd._replace(num_stages=min(fwd.num_stages, 2))
        bwd = bwd._replace(dkdv_stages=min(bwd.dkdv_stages, 2), dq_stages=min(bwd.dq_stages, 2))
    return fwd, bwd


# ------------------------------------------------------------------------------------------ checks
def _check_kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the Triton kernels need beyond the shared checks: a device, a dtype and a head dim they serve."""
    if q.device.type != "cuda" and not (q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(
            f"the Triton flash_attention runs on CUDA (or the CPU under TRITON_INTERPRET=1), got {q.device}; "
            "pass backend='torch' for the reference"
        )
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"the Triton flash_attention takes {[str(d) for d in KERNEL_DTYPES]}, got {q.dtype}; "
            "pass backend='torch' for other dtypes"
        )
    if q.dtype == torch.float64 and q.device.type == "cuda":
        raise TypeError(
            "the Triton flash_attention takes float64 only under TRITON_INTERPRET=1 (tests, gradcheck): "
            "Triton's CUDA matrix products have no float64 form here; pass backend='torch' for float64 on CUDA"
        )
    D = q.shape[-1]
    if D not in KERNEL_HEAD_DIMS:
        raise ValueError(
            f"the Triton flash_attention supports head dims {list(KERNEL_HEAD_DIMS)}, got {D}; "
            "pass backend='torch' for the reference"
        )


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, max_seqlen: int | None) -> int:
    """Validate packed-sequence offsets against `total` rows; returns the longest sequence. Reads
    cu_seqlens on the host (one device sync) unless max_seqlen is given, which is then trusted."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}; convert with .to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with S + 1 ≥ 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
            raise TypeError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
        return max_seqlen
    offsets = cu_seqlens.tolist()
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if offsets[0] != 0 or offsets[-1] != total or min(lengths) < 0:
        raise ValueError(
            f"cu_seqlens must rise from 0 to the number of rows ({total}) without decreasing, got {offsets[:8]}"
            + ("..." if len(offsets) > 8 else "")
        )
    return max(lengths)


def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None) -> float:
    """Shapes, dtypes, devices and strides every backend needs; returns the scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            "q, k, v must all be packed [T, H, D] (with cu_seqlens) or dense [B, L, H, D], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_same_device(q=q, k=k, v=v)
    *lead_q, Hq, D = q.shape
    *lead_k, Hk, Dk = k.shape
    if lead_q != lead_k or v.shape != k.shape or Dk != D or Hk == 0 or Hq % Hk:
        raise ValueError(
            f"k and v must be [..., Hk, D] with q's leading dims and head dim and Hq a multiple of Hk; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)
    if scale is None:
        return D**-0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    return float(scale)


def _backward_config(
    q: torch.Tensor, max_seqlen: int, deterministic: bool, bwd_config: BackwardConfig | None
) -> BackwardConfig:
    """The backward's config: the given one (which must be deterministic when asked to), else the default."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if bwd_config is None:
        return default_configs(q.shape[-1], q.dtype, q.device, max_seqlen, deterministic)[1]
    if deterministic and bwd_config.dq_mode not in DETERMINISTIC_DQ_MODES:
        raise ValueError(
            f"bwd_config.dq_mode={bwd_config.dq_mode!r} is not deterministic; pass deterministic=False for it, "
            f"or a dq_mode of {list(DETERMINISTIC_DQ_MODES)}"
        )
    return bwd_config


# ------------------------------------------------------------------------------------------ the op
def _kernel_forward(q, k, v, cu_seqlens, max_seqlen, scale, causal, fwd: ForwardConfig):
    from tinyvllm.kernels.flash_forward import flash_forward

    return flash_forward(q, k, v, cu_seqlens, max_seqlen, scale, causal, *fwd)


class FlashAttentionFunction(torch.autograd.Function):
    """Packed attention with the Triton kernels both ways; arguments as `flash_attention_fwd`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, causal, fwd_cfg, bwd_cfg):
        out, lse = _kernel_forward(q, k, v, cu_seqlens, max_seqlen, scale, causal, fwd_cfg)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.causal, ctx.bwd_cfg = max_seqlen, scale, causal, bwd_cfg
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        from tinyvllm.kernels.flash_backward import flash_backward

        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        if do.stride(-1) != 1:
            do = do.contiguous()
        dq, dk, dv = flash_backward(
            do, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale, ctx.causal, ctx.bwd_cfg
        )
        return dq, dk, dv, None, None, None, None, None, None


def _prepare(q, k, v, causal, cu_seqlens, scale, max_seqlen, backend):
    """Check the arguments and pack dense inputs: (q, k, v packed, cu_seqlens, max_seqlen, scale,
    backend, dense shape or None)."""
    scale = _check_common(q, k, v, causal, scale)
    if backend is None:
        backend = "triton" if q.device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    if backend == "triton":
        _check_kernel_inputs(q, k, v)
    dense = None
    if q.dim() == 4:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens goes with packed [T, H, D] inputs; dense [B, L, H, D] inputs take none")
        B, L = q.shape[:2]
        dense = q.shape
        q, k, v = (t.reshape(B * L, *t.shape[2:]) for t in (q, k, v))
        cu_seqlens = torch.arange(0, B + 1, dtype=torch.int32, device=q.device) * L
        max_seqlen = L
    elif cu_seqlens is None:  # one sequence
        cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        max_seqlen = q.shape[0]
    else:
        check_same_device(q=q, cu_seqlens=cu_seqlens)
        max_seqlen = _check_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)
    return q, k, v, cu_seqlens, max_seqlen, scale, backend, dense


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    max_seqlen: int | None = None,
    backend: str | None = None,
    deterministic: bool = True,
    fwd_config: ForwardConfig | None = None,
    bwd_config: BackwardConfig | None = None,
) -> torch.Tensor:
    """Softmax attention, differentiable in q, k and v (module docstring for layouts and backends).

    For each sequence (rows cu_seqlens[s] .. cu_seqlens[s+1]−1, or each batch entry of a dense input)
    and query head h, row i:  out[i] = softmax(scale · q_i Kᵀ[0..hi(i)]) V[0..hi(i)], hi(i) = i when
    causal, else the sequence's last row; K and V are those of KV head h // (Hq / Hk).

    Args:
        q: [T, Hq, D] packed, or [B, L, Hq, D] dense. k, v: [T, Hk, D] or [B, L, Hk, D], q's dtype.
        causal: mask keys after the query's own position.
        cu_seqlens: [S + 1] int32 row offsets of the packed sequences (rising from 0 to T); None: the
            packed rows are one sequence.
        scale: the softmax scale, positive; None: D^−½.
        max_seqlen: the longest sequence (sizes the kernel grid); None: read from cu_seqlens, which
            synchronises with the device and checks cu_seqlens. A given value is trusted.
        backend: "triton", "torch" or None (Triton on CUDA, the reference elsewhere).
        deterministic: the backward gives bitwise equal gradients on every run (the default); False
            allows dQ's float32 atomic adds, whose order varies (the kernels' "atomic" dQ mode).
        fwd_config, bwd_config: tile configs for the kernels (default: `default_configs`); a bwd_config
            whose dq_mode is "atomic" needs deterministic=False.

    Returns:
        out, q's shape and dtype.
    """
    q_in_shape = q.shape
    q, k, v, cu_seqlens, max_seqlen, scale, backend, dense = _prepare(
        q, k, v, causal, cu_seqlens, scale, max_seqlen, backend
    )
    if backend == "torch":
        out = reference.attention(q, k, v, cu_seqlens, scale, causal)
    else:
        fwd = fwd_config or default_configs(q.shape[-1], q.dtype, q.device)[0]
        bwd = _backward_config(q, max_seqlen, deterministic, bwd_config)
        out = FlashAttentionFunction.apply(q, k, v, cu_seqlens, max_seqlen, scale, causal, fwd, bwd)
    return out.reshape(q_in_shape) if dense is not None else out


def flash_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    max_seqlen: int | None = None,
    backend: str | None = None,
    fwd_config: ForwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward alone, without autograd: (out as `flash_attention`, lse [Hq, T] float32 (float64 for
    float64 inputs)), lse[h, i] = log Σ_j exp(scale · q_i·k_j) over the keys row i sees, natural log.
    Dense inputs give lse over their packed rows, T = B·L."""
    q_in_shape = q.shape
    q, k, v, cu_seqlens, max_seqlen, scale, backend, dense = _prepare(
        q, k, v, causal, cu_seqlens, scale, max_seqlen, backend
    )
    with torch.no_grad():
        if backend == "torch":
            out = reference.attention(q, k, v, cu_seqlens, scale, causal)
            lse = reference.attention_lse(q, k, cu_seqlens, scale, causal)
        else:
            fwd = fwd_config or default_configs(q.shape[-1], q.dtype, q.device)[0]
            out, lse = _kernel_forward(q, k, v, cu_seqlens, max_seqlen, scale, causal, fwd)
    return (out.reshape(q_in_shape) if dense is not None else out), lse


def flash_attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    causal: bool = True,
    bwd_config: BackwardConfig | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels alone (benchmarks time them without autograd): packed, checked inputs as
    `FlashAttentionFunction.backward` receives them; returns (dq, dk, dv). bwd_config and deterministic
    as `flash_attention`'s."""
    from tinyvllm.kernels.flash_backward import flash_backward

    cfg = _backward_config(q, max_seqlen, deterministic, bwd_config)
    return flash_backward(do, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal, cfg)


__all__ = [
    "DETERMINISTIC_DQ_MODES",
    "HOPPER_BACKWARD",
    "HOPPER_BACKWARD_ATOMIC",
    "BackwardConfig",
    "FlashAttentionFunction",
    "ForwardConfig",
    "default_configs",
    "flash_attention",
    "flash_attention_bwd",
    "flash_attention_fwd",
]
