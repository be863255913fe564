"""How deep the attention kernels' key loops really prefetch, compiled for the H200 (sm_90) without a GPU.

The sweeps' five-stage candidates (decode_attention.CANDIDATE_CONFIGS, prefill_attention.CANDIDATE_CONFIGS)
exist because Triton pipelines these loops only from five stages on: below that the loop keeps one K/V
buffer and waits for every copy at each tile (`ttg.async_wait` num 0); at five it keeps two buffers and
the next tile's copies stay in flight across the wait (num > 0). This checks that premise in the compiled
TTGIR of the paged decode kernel, the paged prefill kernel and the cascade prefix kernel (whose depth is
DecodeConfig.prefix_stages, 0 meaning its launch's default of 3). Runs in a subprocess without
TRITON_INTERPRET (tests/kernels/sm90_compile.py); skipped where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.kernels.sm90_compile import compiled_or_skip, facts_from_subprocess

DECODE_STAGES = (3, 5)
PREFILL_STAGES = (2, 5)
PREFIX_STAGES = (0, 5)  # DecodeConfig.prefix_stages; 0: the prefix kernel's default depth (3)
DEFAULT_DEPTH = {"decode": 3, "prefill": 2, "prefix": 0}


def _waits(kernel) -> list[int]:
    """The `num` of every ttg.async_wait in the kernel's TTGIR: copies allowed to stay in flight."""
    return [int(n) for n in re.findall(r"async_wait[^\n]*num = (\d+)", kernel.asm["ttgir"])]


def compile_decode(stages: int) -> list[int]:
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels.decode_attention import DecodeConfig, decode_attention_fwd

    B, Hq, Hk, D, bs = 4, 32, 8, 64, 16
    q = torch.zeros(B, Hq, D, dtype=torch.bfloat16)
    cache = torch.zeros(64, Hk, bs, D, dtype=torch.bfloat16)
    lens = torch.full((B,), 300, dtype=torch.int32)
    tables = torch.zeros(B, 20, dtype=torch.int32)
    with compile_only_for_sm90() as launched:
        decode_attention_fwd(q, cache, cache, lens, tables, 0.125, 320, config=DecodeConfig(64, 2, stages, 4, 1))
    return _waits(dict(launched)["_decode_kernel"])


def compile_prefix(stages: int) -> list[int]:
    """The cascade prefix kernel of a decode launch with a 128-key shared prefix, prefix_stages=stages."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels.decode_attention import DecodeConfig, decode_attention_fwd

    B, Hq, Hk, D, bs = 4, 32, 8, 64, 16
    q = torch.zeros(B, Hq, D, dtype=torch.bfloat16)
    cache = torch.zeros(64, Hk, bs, D, dtype=torch.bfloat16)
    lens = torch.full((B,), 300, dtype=torch.int32)
    tables = torch.zeros(B, 20, dtype=torch.int32)
    prefix = torch.tensor([128], dtype=torch.int32)
    cfg = DecodeConfig(64, 2, 3, 4, 1, prefix_stages=stages)
    with compile_only_for_sm90() as launched:
        decode_attention_fwd(q, cache, cache, lens, tables, 0.125, 320, config=cfg, prefix_len=prefix)
    return _waits(dict(launched)["_prefix_kernel"])


def compile_prefill(stages: int) -> list[int]:
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels.prefill_attention import PrefillConfig, prefill_attention_fwd

    Hq, Hk, D, bs = 32, 8, 64, 16
    q = torch.zeros(1024, Hq, D, dtype=torch.bfloat16)
    cache = torch.zeros(128, Hk, bs, D, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1024], dtype=torch.int32)
    lens = torch.tensor([1024], dtype=torch.int32)
    tables = torch.arange(64, dtype=torch.int32)[None]
    with compile_only_for_sm90() as launched:
        prefill_attention_fwd(q, cache, cache, cu, lens, tables, 0.125, 1024, config=PrefillConfig(64, 64, 4, stages))
    return _waits(dict(launched)["_prefill_kernel"])


def summarise() -> dict:
    def waits() -> dict:
        return {
            **{f"decode/{s}": compile_decode(s) for s in DECODE_STAGES},
            **{f"prefill/{s}": compile_prefill(s) for s in PREFILL_STAGES},
            **{f"prefix/{s}": compile_prefix(s) for s in PREFIX_STAGES},
        }

    return compiled_or_skip("waits", waits)


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)["waits"]


@pytest.mark.parametrize("kernel", ["decode", "prefill", "prefix"])
def test_five_stages_keep_copies_in_flight(facts, kernel):
    deep = facts[f"{kernel}/5"]
    assert deep and max(deep) > 0, deep


@pytest.mark.parametrize("kernel", ["decode", "prefill", "prefix"])
def test_the_default_depth_waits_for_every_copy(facts, kernel):
    """The shallow depths the five-stage candidates are compared with (decode's default 3, prefill's 2 of
    its short chunks at head dim 64, prefix_stages 0 for the prefix kernel)."""
    shallow = facts[f"{kernel}/{DEFAULT_DEPTH[kernel]}"]
    assert shallow and max(shallow) == 0, shallow


if __name__ == "__main__":
    print(json.dumps(summarise()))
