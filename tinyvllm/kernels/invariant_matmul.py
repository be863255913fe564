"""A batch-invariant matrix product: row t of x Wᵀ is computed the same way for every number of rows M.

    out[t, n] = round(Σ_k x[t, k] · W[n, k] (+ b[n]))     x: [M, K], W: [N, K] (nn.Linear layout)

cuBLAS picks its kernel, its tile and its split-K from (M, N, K), so a row's last bits change with the
number of rows beside it (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025, §"Batch
invariant matmul"). Here a program owns a BLOCK_M × BLOCK_N output tile and walks K in BLOCK_K steps from 0
upwards, accumulating `tl.dot` products in float32; there is no split-K and no stream-K. Operands come in
by masked pointer loads or, for a `tma` config, by the tensor memory accelerator (host tensor descriptors,
out-of-range elements read as zero): the same operands reach the same dot chain either way. Each output
element is then the float32 chain

    acc ← 0;  for k-block j = 0, 1, 2, ...:  for k-step i = 0 .. BLOCK_K/16 − 1:
        acc ← mma(x[t, ks], W[n, ks], acc)     ks = the 16 k's of step i of block j

whose value depends on BLOCK_K, the K order, the tensor-core instruction family and its k-step (16 for
16-bit inputs) and nothing else: not on BLOCK_M, BLOCK_N, the warp count, the pipeline depth or the order
in which tiles run (rows and columns of a tile never mix). So the tile may change with M without changing
any row's bits, as long as every config keeps the invariants `check_table` enforces:

  * one BLOCK_K (64) for every config;
  * BLOCK_M ∈ {64, 128} and num_warps ∈ {4, 8}, which keeps every 16-bit product on Hopper's warpgroup MMA
    (wgmma m64nNk16; a smaller BLOCK_M or 1–2 warps make Triton fall back to mma.sync m16n8k16, whose
    accumulation may round differently). tests/kernels/test_invariant_matmul_codegen.py compiles every
    config of the table for sm_90 and checks its PTX holds wgmma k16 only; tests/gpu/
    test_invariant_matmul_gpu.py checks the bits on the GPU across every config and M.

`TILE_TABLE` picks the tile from M's bucket and N (N is the weight's, fixed for a layer, so choosing by
it is invariant too): at decode sizes (M ≤ 64: one row tile) narrow column tiles give enough programs to
stream the weight over every SM; at prefill sizes wide tiles reuse each loaded operand. float32 inputs
(exact products, no TF32: FMA dots, summed per element in k order) take `FLOAT32_CONFIG` for every M.
The bias is added to the float32 sum, rounding once to x's dtype (as F.linear does). Another table: assign
`TILE_TABLE` (after `check_table`); one product's tile: `matmul_fwd(config=...)`.

benchmarks/kernels/bench_invariant_matmul.py times the candidates per bucket against cuBLAS.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tinyvllm.kernels.flash_tiles import ordered_dot
from tinyvllm.kernels.launch import cdiv, upcast_dot


class MatmulConfig(NamedTuple):
    """A tile: BLOCK_M × BLOCK_N outputs per program, K in BLOCK_K steps; `tma`: operands loaded by the
    tensor memory accelerator (host tensor descriptors; Hopper and later) instead of masked pointer loads.
    Both load paths feed the same `tl.dot` chain, so they give the same bits."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False


class TileRule(NamedTuple):
    """The config for products with M ≤ max_m rows and N ≤ max_n output columns."""

    max_m: int
    max_n: int
    config: MatmulConfig


BLOCK_K = 64  # every config's: a different BLOCK_K is a different sum (module docstring)
WGMMA_BLOCK_M = (64, 128)
WGMMA_WARPS = (4, 8)
GROUP_M = 8  # row tiles per group in the launch order (L2 reuse of W's column tiles at large M)
ANY = sys.maxsize


def _c(block_m: int, block_n: int, num_warps: int, num_stages: int, tma: bool = False) -> MatmulConfig:
    return MatmulConfig(block_m, block_n, BLOCK_K, num_warps, num_stages, tma)


def _t(block_m: int, block_n: int, num_warps: int, num_stages: int) -> MatmulConfig:
    return _c(block_m, block_n, num_warps, num_stages, tma=True)


# The config of the mode's first form: one tile for every M; float32 products keep it.
DEFAULT_CONFIG = _c(64, 128, 4, 4)
FLOAT32_CONFIG = DEFAULT_CONFIG

# First matching rule wins. Columns: M bucket, N bound, tile (block_m, block_n, warps, stages; `_t`: TMA
# loads). The decode buckets size BLOCK_N so that N / BLOCK_N fills the 132 SMs of an H200 for the 1B
# model's widths (qkv 3072, o/down 2048, gate_up 16384, LM head 128256); each rule is the sweep's winner
# for its bucket (benchmarks/kernels/bench_invariant_matmul.py; docs/perf.md §11 has its figures).
TILE_TABLE: tuple[TileRule, ...] = (
    TileRule(64, 4096, _c(64, 16, 4, 8)),
    TileRule(64, 32768, _c(64, 64, 4, 5)),
    TileRule(64, ANY, _c(64, 128, 4, 4)),
    TileRule(128, 4096, _t(64, 32, 4, 6)),
    TileRule(128, 32768, _t(64, 128, 4, 4)),
    TileRule(128, ANY, _t(128, 64, 4, 4)),
    TileRule(256, 4096, _t(64, 64, 4, 5)),
    TileRule(256, ANY, _t(64, 128, 4, 4)),
    TileRule(1024, 4096, _t(128, 128, 8, 4)),
    TileRule(1024, ANY, _t(128, 128, 4, 4)),
    TileRule(ANY, ANY, _t(128, 128, 8, 4)),
)


# What the sweep bench (benchmarks/kernels/bench_invariant_matmul.py) times per M bucket, and what the GPU
# test checks for equal bits across: the table's configs and their neighbours in BLOCK_N, warps, stages.
CANDIDATES: dict[int, tuple[MatmulConfig, ...]] = {
    64: (
        _c(64, 16, 4, 8),
        _c(64, 64, 4, 5),
        _c(64, 128, 4, 4),
        _t(64, 16, 4, 8),
        _t(64, 32, 4, 6),
        _t(64, 64, 4, 5),
        _t(64, 128, 4, 4),
    ),
    128: (
        _c(64, 32, 4, 6),
        _c(64, 128, 4, 4),
        _c(128, 128, 8, 4),
        _t(64, 32, 4, 6),
        _t(64, 64, 4, 5),
        _t(64, 128, 4, 4),
        _t(128, 64, 4, 4),
        _t(128, 128, 8, 4),
    ),
    256: (
        _c(64, 64, 4, 5),
        _c(128, 128, 8, 4),
        _c(128, 256, 8, 3),
        _t(64, 64, 4, 5),
        _t(64, 128, 4, 4),
        _t(128, 64, 4, 4),
        _t(128, 128, 8, 4),
        _t(128, 256, 8, 3),
    ),
    1024: (_c(128, 128, 8, 4), _t(128, 128, 4, 4), _t(128, 128, 8, 4), _t(128, 256, 8, 3), _t(64, 256, 8, 3)),
    ANY: (_c(128, 256, 8, 3), _c(128, 128, 8, 4), _t(128, 128, 8, 4), _t(128, 256, 8, 3), _t(128, 256, 8, 4)),
}


def all_configs(table: tuple[TileRule, ...] | None = None) -> tuple[MatmulConfig, ...]:
    """Every distinct config of the candidates and of `table` (default TILE_TABLE), in a fixed order."""
    seen: dict[MatmulConfig, None] = {}
    for configs in CANDIDATES.values():
        seen.update(dict.fromkeys(configs))
    seen.update(dict.fromkeys(rule.config for rule in (TILE_TABLE if table is None else table)))
    return tuple(seen)


def check_config(config: MatmulConfig) -> None:
    """Raise unless `config` keeps the reduction order every config shares (module docstring)."""
    if config.block_k != BLOCK_K or config.block_m not in WGMMA_BLOCK_M or config.num_warps not in WGMMA_WARPS:
        raise ValueError(
            f"{config}: a batch-invariant tile needs block_k={BLOCK_K}, block_m in {WGMMA_BLOCK_M} and "
            f"num_warps in {WGMMA_WARPS} (one reduction order for every config)"
        )
    if config.block_n < 8 or config.block_n > 256 or config.block_n & (config.block_n - 1):
        raise ValueError(f"{config}: block_n must be a power of two in [8, 256]")
    if config.num_stages < 1:
        raise ValueError(f"{config}: num_stages must be ≥ 1")


def check_table(table: tuple[TileRule, ...]) -> None:
    """Raise unless every config of `table` passes check_config and the table covers every (M, N)."""
    for rule in table:
        check_config(rule.config)
    if not table or table[-1].max_m != ANY or table[-1].max_n != ANY:
        raise ValueError("a tile table's last rule must cover every M and N (max_m = max_n = ANY)")


check_table(TILE_TABLE)
for _config in all_configs():  # the sweep's candidates keep the order too
    check_config(_config)


def pick_config(M: int, N: int, dtype: torch.dtype, table: tuple[TileRule, ...] | None = None) -> MatmulConfig:
    """The tile for an [M, K] × [N, K]ᵀ product of `dtype`: the first rule of `table` (default
    TILE_TABLE) with M ≤ max_m and N ≤ max_n; FLOAT32_CONFIG for float32."""
    if dtype == torch.float32:
        return FLOAT32_CONFIG
    for rule in TILE_TABLE if table is None else table:
        if rule.max_m >= M and rule.max_n >= N:
            return rule.config
    raise ValueError(f"no tile rule covers M={M}, N={N}")


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Program p → output tile (m, n): GROUP-row-tile groups, column-major within a group."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP)
    return first_m + (pid % per_group) % rows_in_group, (pid % per_group) // rows_in_group


@triton.jit
def _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """out[offs_m, offs_n] = round(acc (+ b[offs_n])): the bias added to the float32 sum, one rounding."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (no M == 1 or M % 16 variant)
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program p → tile (m, n) in GROUP-row-tile groups, column-major within a group (the order tiles
    run in; it does not enter any element's sum): out[m-tile, n-tile] = round(x[m-tile] Wᵀ[:, n-tile] (+ b)),
    K in order."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(x_rows + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(w_rows + ks[:, None], mask=(ks[:, None] < K) & (offs_n[None, :] < N), other=0.0)  # Wᵀ
        if UPCAST:  # the interpreter: k-ordered sums (flash_tiles.ordered_dot)
            acc = ordered_dot(a, b, acc)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    x_desc,
    w_desc,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """`_matmul_kernel` with operands loaded through tensor descriptors: the tile's x [BLOCK_M, BLOCK_K]
    and W [BLOCK_N, BLOCK_K] boxes come in by TMA (out-of-range rows and k's read as zero, as the masked
    loads' `other=0`), so the k-ordered `tl.dot` chain and every element's sum are the same."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([off_m, k0])
        b = w_desc.load([off_n, k0])
        if UPCAST:
            acc = ordered_dot(a, b.T, acc)
        else:
            acc = tl.dot(a, b.T, acc)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


def tma_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA can load x and weight: 16-bit tensors with 16-byte-aligned bases and row strides (a
    config with `tma` falls back to pointer loads otherwise: the same bits)."""
    return x.dtype in (torch.bfloat16, torch.float16) and all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, weight)
    )


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: MatmulConfig,
    upcast: bool,
):
    """One launch of the kernel over contiguous-row x [M, K], weight [N, K] into out [M, N] (M ≥ 1);
    `upcast`: fp32 dot operands (the interpreter; launch.upcast_dot). Returns what Triton's launch does."""
    M, K = x.shape
    N = weight.shape[0]
    c = config
    grid = (cdiv(M, c.block_m) * cdiv(N, c.block_n),)
    if c.tma and tma_ok(x, weight):
        return _matmul_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [c.block_m, c.block_k]),
            TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k]),
            bias if bias is not None else weight,
            out,
            M,
            N,
            K,
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=c.block_m,
            BLOCK_N=c.block_n,
            BLOCK_K=c.block_k,
            GROUP=GROUP_M,
            UPCAST=upcast,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
    return _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        GROUP=GROUP_M,
        UPCAST=upcast,
        IEEE=x.dtype == torch.float32,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )


def matmul_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: MatmulConfig | None = None
) -> torch.Tensor:
    """x [M, K] @ weightᵀ [N, K] (+ bias [N]) → [M, N] in x's dtype, batch-invariant (module docstring).

    `config`: the tile (default: `pick_config`'s for M, N and the dtype); any config that passes
    check_config gives the same bits. float32 inputs multiply exactly (no TF32), so the float32 product is
    invariant too."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError("x, weight (and bias [N]) must share a dtype")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = x.shape[0]
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if config is None:
        config = pick_config(M, N, x.dtype)
    else:
        check_config(config)
    launch(x, weight, bias, out, config, upcast_dot(x.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's signature over `matmul_fwd` (the batch-invariant ops table's `linear`)."""
    return matmul_fwd(x, weight, bias)
