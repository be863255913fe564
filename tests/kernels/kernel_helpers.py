"""Inputs and error measures shared by the kernel tests (CPU interpreter and CUDA alike)."""

from __future__ import annotations

import torch

# Relative error ‖out − ref‖ / ‖ref‖ against a float64 reference on the same (rounded) inputs.
# float32: the kernels compute in float32 (IEEE dots for float32 inputs), so only summation order
#   differs: ~1e-7 per element, growing like √n over long rows; 1e-5 leaves two orders of margin.
# bfloat16: the output is rounded to bf16 (relative step 2⁻⁸ = 3.9e-3, RMS error ~1e-3) and attention
#   rounds P to bf16 before P·V (FA2 does the same), another ~1e-3; Triton's CPU interpreter
#   truncates fp32 → bf16 instead of rounding to nearest, doubling both: 1e-2 bounds all of it.
# float16: 10 mantissa bits instead of 7: 8× below bf16.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; fails on any NaN/inf in out (an unwritten, poisoned element)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{int(bad.sum())} non-finite output elements, first at {bad.nonzero()[0].tolist()}"
    o, r = out.double().cpu(), ref.double().cpu()
    denom = r.norm().item()
    return (o - r).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, factor: float = 1.0) -> None:
    err = rel_err(out, ref)
    assert err <= TOL[dtype] * factor, f"relative error {err:.3e} > {TOL[dtype] * factor:.1e} ({dtype})"


def make_paged_cache(
    contexts: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    spare_blocks: int = 5,
    share_prefix: int = 0,
    kv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches [num_blocks, Hk, block_size, D] holding each sequence's context in blocks scattered at
    random through a cache with spare blocks; returns (k_cache, v_cache, block_tables int32).

    Everything no sequence owns is NaN: spare blocks, slots past a sequence's end in its last block,
    and block-table padding (which points at a spare block). A kernel that reads one key too many
    therefore returns NaN. `share_prefix` > 0 makes every sequence reuse sequence 0's first
    `share_prefix` blocks (prefix caching; those blocks must be full in every sequence). `kv`, if
    given, is [2, sum(contexts), Hk, D]: the K and V values to store, in sequence order; otherwise
    they are drawn from N(0, 1) (on `device`, with `gen`, which must live there too).
    """
    per_seq = [-(-c // block_size) for c in contexts]
    assert all(c >= share_prefix * block_size for c in contexts), "shared blocks must be full"
    owned = [n - share_prefix if s else n for s, n in enumerate(per_seq)]
    num_blocks = sum(owned) + spare_blocks + 1
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=gen.device))
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    poison_block = perm.pop()
    width = max([*per_seq, 1]) + 2
    tables = torch.full((len(contexts), width), poison_block, dtype=torch.int32)
    blocks_of, slots, src = [], [], []
    offset = 0
    for s, (ctx, n) in enumerate(zip(contexts, per_seq)):
        shared = share_prefix if s else 0
        blocks = blocks_of[0][:shared] if s else []
        blocks = blocks + [perm.pop() for _ in range(n - shared)]
        blocks_of.append(blocks)
        tables[s, :n] = torch.tensor(blocks, dtype=torch.int32)
        first = shared * block_size  # tokens before it live in sequence 0's blocks
        t = torch.arange(first, ctx)
        slots.append(torch.tensor(blocks, dtype=torch.int64)[t // block_size] * block_size + t % block_size)
        src.append(offset + t)
        offset += ctx
    slots_t = torch.cat(slots).to(device) if slots else torch.zeros(0, dtype=torch.int64, device=device)
    src_t = torch.cat(src).to(device) if src else torch.zeros(0, dtype=torch.int64, device=device)
    if kv is None:
        kv = torch.randn(2, offset, num_kv_heads, head_dim, generator=gen, device=device)
    kv = kv.to(device=device, dtype=dtype)
    caches = []
    for i in range(2):
        cache = torch.full((num_blocks * block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
        cache[slots_t] = kv[i, src_t]
        caches.append(cache.view(num_blocks, block_size, num_kv_heads, head_dim).permute(0, 2, 1, 3).contiguous())
    return caches[0], caches[1], tables.to(device)


def packed_queries(
    q_lens: list[int], num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [sum(q_lens), Hq, D], cu_seqlens_q int32 [S+1]) with q a strided view, as the model passes it
    (a slice of a wider fused qkv row). `gen` lives on `device`."""
    total = sum(q_lens)
    wide = torch.randn(total, num_heads + 3, head_dim, generator=gen, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return wide[:, 1 : num_heads + 1], cu.to(device)


def free_below_window(tables: torch.Tensor, first_query: list[int], window: int, block_size: int) -> None:
    """Point, in place, every block-table entry whose block holds only keys below the window of the
    sequence's first query (position first_query[s]) at the NaN block padding the table. This is what
    the KV cache may free: block i once (i+1)·bs ≤ c − W + 1."""
    poison = tables[0, -1].item()  # make_paged_cache pads every row with a NaN block
    for s, c in enumerate(first_query):
        tables[s, : max(0, c - window + 1) // block_size] = poison
