"""Decode attention's optional paths compiled for the H200 (sm_90) without a GPU: the merge folded into
the split kernel (one launch; its tickets are gpu-scope atomics) over a bf16 and an FP8 cache, and cascade
attention with the shared prefix split over several programs, with and without a window. The
interpreter tests (test_decode_attention.py, test_window_attention.py) check what they compute; only the
compiler checks that they compile (tests/kernels/sm90_compile.py). Runs in a subprocess without
TRITON_INTERPRET; skipped where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import compiled_or_skip, facts_from_subprocess

# name -> (cache dtype, fold_merge, cascade prefix_splits (0: no cascade), window)
VARIANTS = {
    "fold/bf16": ("bfloat16", True, 0, None),
    "fold/fp8": ("float8_e4m3fn", True, 0, None),
    "fold/window": ("bfloat16", True, 0, 100),
    "cascade/ps4": ("bfloat16", False, 4, None),
    "cascade/ps4/window": ("bfloat16", False, 4, 100),
}


def compile_variant(cache_dtype: str, fold: bool, prefix_splits: int, window: int | None) -> dict:
    """The kernels one decode attention call launches for this variant, compiled for sm_90, with whether
    each holds gpu-scope atomics."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels.decode_attention import DecodeConfig, decode_attention_fwd

    B, Hq, Hk, D, bs = 4, 32, 8, 64, 16
    q = torch.zeros(B, Hq, D, dtype=torch.bfloat16)
    cache = torch.zeros(64, Hk, bs, D, dtype=getattr(torch, cache_dtype))
    lens = torch.full((B,), 300, dtype=torch.int32)
    tables = torch.zeros(B, 20, dtype=torch.int32)
    cfg = DecodeConfig(64, 2, 3, 4, 1, fold_merge=fold, prefix_splits=max(1, prefix_splits))
    prefix = torch.tensor([128], dtype=torch.int32) if prefix_splits else None
    with compile_only_for_sm90() as launched:
        decode_attention_fwd(
            q, cache, cache, lens, tables, 0.125, 320, config=cfg, num_splits=4, prefix_len=prefix, window=window
        )
    return {name: "atom.global" in k.asm["ptx"] or "atom.acq_rel" in k.asm["ptx"] for name, k in launched}


def summarise() -> dict:
    return compiled_or_skip("variants", lambda: {n: compile_variant(*v) for n, v in VARIANTS.items()})


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)["variants"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_attention_variant_compiles_for_sm90(facts, variant):
    got = facts[variant]
    if VARIANTS[variant][1]:  # folded: one launch, whose tickets are atomics
        assert got == {"_decode_kernel": True}, got
    else:
        assert list(got) == ["_decode_kernel", "_prefix_kernel", "_merge_kernel"], got


if __name__ == "__main__":
    print(json.dumps(summarise()))
