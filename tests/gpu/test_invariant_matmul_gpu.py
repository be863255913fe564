"""The batch-invariant matrix product's tile table on the GPU (bf16, the `llama-3.2-1b` projections):
row t of x[:M] Wᵀ has the same bits under every config of the table and of the sweep's candidates and for
every M, which is what lets `pick_config` change the tile with M (kernels/invariant_matmul.py).

Every (shape, config, M) is compared with one reference: the first config's product of all rows; rows are
also computed alone (M = 1) at the edges of 64- and 128-row tiles. A failure names the configs that
differ, grouped by family (BLOCK_M, warps) so a family that leaves wgmma's sum shows as one line.

`test_probe_families` (informational, never fails) launches configs outside the table's invariants (another
BLOCK_K; mma.sync tiles) and prints whether their bits happen to agree: what the invariants rest on.
"""

from __future__ import annotations

import collections

import pytest
import torch

from tinyvllm.kernels import invariant_matmul as im

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
# projection -> (N, K), llama-3.2-1b
SHAPES = {
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "lm_head": (128256, 2048),
}
MS = (1, 3, 64, 129, 256, 1000)
ALONE_ROWS = (0, 63, 64, 127, 128, 500, 999)


def _problem(name: str, bias: bool = False):
    N, K = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    w = (torch.randn(N, K, generator=gen, device="cuda") / K**0.5).to(BF16)
    x = torch.randn(max(MS), K, generator=gen, device="cuda").to(BF16)
    b = torch.randn(N, generator=gen, device="cuda").to(BF16) if bias else None
    return x, w, b


def _mismatches(x, w, b, configs) -> list[tuple]:
    """(config, M or 'alone t', rows that differ) for every case whose bits differ from the reference."""
    ref = im.matmul_fwd(x, w, b, config=configs[0])
    bad = []
    for config in configs:
        for M in MS:
            out = im.matmul_fwd(x[:M], w, b, config=config)
            rows = (out != ref[:M]).any(dim=1).sum().item()
            if rows:
                bad.append((config, M, rows))
        for t in ALONE_ROWS:
            if not torch.equal(im.matmul_fwd(x[t : t + 1], w, b, config=config), ref[t : t + 1]):
                bad.append((config, f"alone {t}", 1))
    for M in MS:  # the table's own choice
        if not torch.equal(im.matmul_fwd(x[:M], w, b), ref[:M]):
            bad.append(("table", M, -1))
    return bad


def _by_family(bad: list[tuple]) -> str:
    fams = collections.defaultdict(list)
    for config, M, rows in bad:
        key = "table" if config == "table" else f"block_m={config.block_m} warps={config.num_warps}"
        fams[key].append(f"{tuple(config) if config != 'table' else ''} M={M}: {rows} rows")
    return "\n".join(f"{k}: {len(v)} cases, e.g. {v[:3]}" for k, v in fams.items())


@pytest.mark.parametrize("name,bias", [(n, False) for n in SHAPES] + [("qkv", True)])
def test_rows_have_the_same_bits_under_every_config_and_m(name, bias):
    x, w, b = _problem(name, bias)
    configs = im.all_configs()
    bad = _mismatches(x, w, b, configs)
    print(f"\n{name}{' +bias' if bias else ''}: {len(configs)} configs x M {MS}: {len(bad)} mismatching cases")
    assert not bad, f"{name}: rows differ from {tuple(configs[0])}'s:\n{_by_family(bad)}"
    # and the product is right: the float64 product within one bf16 rounding of the largest element
    # (inputs exact in float64; the float32 sum's error is far below bf16's 2⁻⁹ relative half-ulp)
    ref = x[:64].double() @ w.double().T + (b.double() if b is not None else 0)
    err = (im.matmul_fwd(x[:64], w, b).double() - ref).abs().max().item()
    assert err <= 2**-8 * ref.abs().max().item(), err


PROBES = {
    "block_k=32": im.MatmulConfig(64, 64, 32, 4, 4),
    "block_k=128": im.MatmulConfig(64, 64, 128, 4, 3),
    "block_m=16 (mma.sync)": im.MatmulConfig(16, 64, 64, 4, 4),
    "warps=2 (mma.sync)": im.MatmulConfig(64, 64, 64, 2, 4),
}


def test_probe_families():
    """Informational: which configs outside the invariants still agree with the table's bits (printed)."""
    x, w, _ = _problem("o")
    ref = im.matmul_fwd(x, w, config=im.DEFAULT_CONFIG)
    print()
    for label, config in PROBES.items():
        line = []
        for M in (1, 64, 1000):
            out = torch.empty(M, w.shape[0], dtype=BF16, device="cuda")
            im.launch(x[:M], w, None, out, config, upcast=False)
            line.append(f"M={M}: {(out != ref[:M]).any(dim=1).sum().item()} rows differ")
        print(f"probe {label} {tuple(config)}: " + ", ".join(line))
