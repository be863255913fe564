"""Every tile config of the batch-invariant matrix product compiles, for the H200 (sm_90), to the same
tensor-core instruction family: warpgroup MMA (wgmma) with a k-step of 16 and no mma.sync, the condition
under which a row's bits do not depend on the tile (kernels/invariant_matmul.py); a `tma` config loads its
operands with TMA (cp.async.bulk.tensor). float32 products take no tensor-core instruction at all (FMA,
exact products).

Compiled without a GPU in a subprocess without TRITON_INTERPRET (tests/kernels/sm90_compile.py); skipped
where this Triton cannot compile for CUDA. The bits themselves: tests/gpu/test_invariant_matmul_gpu.py.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.kernels.sm90_compile import compiled_or_skip, facts_from_subprocess

MMA = re.compile(r"(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)")


def compile_configs() -> dict:
    """{"<dtype> <config>": [the MMA instructions of its PTX, and "tma" when it loads by TMA]} for every
    config × 16-bit dtype, and float32 with FLOAT32_CONFIG."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels import invariant_matmul as im

    out = {}
    cases = [(dtype, c) for dtype in (torch.bfloat16, torch.float16) for c in im.all_configs()]
    cases.append((torch.float32, im.FLOAT32_CONFIG))
    for dtype, config in cases:
        x = torch.zeros(3, 2048, dtype=dtype)
        w = torch.zeros(2048, 2048, dtype=dtype)
        o = torch.empty(3, 2048, dtype=dtype)
        with compile_only_for_sm90() as launched:
            im.launch(x, w, None, o, config, upcast=False)
        ptx = launched[0][1].asm["ptx"]
        found = sorted(set(MMA.findall(ptx))) + (["tma"] if "cp.async.bulk.tensor" in ptx else [])
        out[f"{str(dtype)[6:]} {tuple(config)}"] = found
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=600)


def test_every_config_is_wgmma_k16(facts):
    configs = facts["configs"]
    assert len(configs) > 10
    for name, instructions in configs.items():
        if name.startswith("float32"):
            assert instructions == [], (name, instructions)  # FMA dot
            continue
        tma = name.endswith("True)")
        assert ("tma" in instructions) == tma, (name, instructions)
        instructions = [i for i in instructions if i != "tma"]
        assert instructions, name
        for ins in instructions:
            assert ins.startswith("wgmma.mma_async") and re.search(r"\.m64n\d+k16\.", ins), (name, ins)


if __name__ == "__main__":
    print(json.dumps(compiled_or_skip("configs", compile_configs)))
