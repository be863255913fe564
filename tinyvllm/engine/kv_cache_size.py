"""How many KV cache blocks the engine allocates, and the reason, which the startup log states.

On CUDA the cache takes what `gpu_memory_utilization` of the card leaves (the runner profiles the
rest). On the CPU there is no such budget to fill: the cache is sized to the work, what `max_num_seqs`
sequences of `max_model_len` tokens can hold at once, and capped at a fraction of the machine's memory;
when capped, the scheduler preempts sequences to fit. An explicit block count or byte budget overrides
both.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

# cgroup memory limits (v2, then v1): a container may have far less memory than the host it runs on.
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclass(frozen=True)
class KVCacheSize:
    """A sized KV cache: `num_blocks` blocks of `bytes_per_block` bytes each, and why that many."""

    num_blocks: int
    bytes_per_block: int
    reason: str

    def describe(self, block_size: int) -> str:
        """One line for the log: '2,048 blocks × 16 tokens (64.0 MiB): <reason>'."""
        total = format_bytes(self.num_blocks * self.bytes_per_block)
        return f"{self.num_blocks:,} blocks × {block_size} tokens ({total}): {self.reason}"


def format_bytes(n: int) -> str:
    """`n` bytes in binary units with one decimal ('1.5 GiB')."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} TiB"


def total_memory_bytes() -> int | None:
    """The memory this process may use: the machine's RAM, or the cgroup's limit when lower. None when
    the platform does not say (os.sysconf unavailable)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    for path in _CGROUP_LIMIT_FILES:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit
            total = min(total, int(text))
    return total


def size_from_blocks(num_blocks: int, bytes_per_block: int) -> KVCacheSize:
    return KVCacheSize(num_blocks, bytes_per_block, "set by num_gpu_blocks_override")


def size_from_bytes(budget: int, bytes_per_block: int) -> KVCacheSize:
    """As many whole blocks as `budget` bytes hold (at least one)."""
    n = max(1, budget // bytes_per_block)
    return KVCacheSize(n, bytes_per_block, f"set by kv_cache_memory_bytes ({format_bytes(budget)})")


def size_for_work(
    *,
    bytes_per_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    memory_bytes: int | None,
    max_memory_fraction: float,
) -> KVCacheSize:
    """The CPU default: `max_num_seqs × ceil(max_model_len / block_size)` blocks, so that every sequence
    the scheduler may run at once can reach `max_model_len` without preemption; at most
    `max_memory_fraction` of `memory_bytes` (not capped when that is None), and at least one block."""
    per_seq = math.ceil(max_model_len / block_size)
    needed = max_num_seqs * per_seq
    why = f"max_num_seqs {max_num_seqs} × max_model_len {max_model_len} needs {needed:,} blocks"
    if memory_bytes is None:
        return KVCacheSize(needed, bytes_per_block, f"{why} (the machine's memory is unknown: not capped)")
    cap_bytes = int(memory_bytes * max_memory_fraction)
    cap = max(1, cap_bytes // bytes_per_block)
    share = f"{max_memory_fraction:g} of the {format_bytes(memory_bytes)} memory"
    if needed <= cap:
        return KVCacheSize(needed, bytes_per_block, f"{why}, within the cap ({share})")
    return KVCacheSize(
        cap,
        bytes_per_block,
        f"{why} ({format_bytes(needed * bytes_per_block)}), capped at {share}; "
        f"{cap // per_seq:,} sequences of full length fit, the scheduler preempts beyond that "
        f"(set kv_cache_memory_bytes to choose)",
    )
