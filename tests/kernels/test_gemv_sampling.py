"""The sampler fused into the LM head's product (gemv.py's `sampling=`): every row's id equals the
separate sampler's (kernels/sampling.py) over the same logits, token for token, greedy and Gumbel
rows mixed, on both product paths, with N cut into blocks that do not line up with the sampler's
noise tiles; the host copy gets the same ids; two launches in a row (the arrival counter resets)."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.kernels.gemv import GemvConfig, GemvSampling, fused_gemv_fwd
from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

CONFIGS = [
    ("default", None),
    ("dot_lm_head", GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3, use_dot=True)),
    ("fma_split_forced_off", GemvConfig(block_n=16, block_k=32, split_k=3, num_warps=4, num_stages=2, use_dot=False)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_fused_sampling_equals_the_sampler(name, cfg, M, dtype, device):
    gen = torch.Generator(device=device).manual_seed(M)
    N, K = 2600, 64  # 2,600 logits: two noise tiles of 2,048, the second partial
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    w = (torch.randn(N, K, generator=gen, device=device) / 2).to(dtype)
    temperature = torch.tensor([0.0, 0.8, 1.7][:M], device=device)
    seeds = torch.tensor([5, 6, 7][:M], device=device)
    host = torch.full((M,), -1, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    for launch in range(2):
        ids = torch.full((M,), -1, dtype=torch.int64, device=device)
        logits = fused_gemv_fwd(x, w, config=cfg, sampling=GemvSampling(temperature, seeds + launch, ids, host))
        # the product itself unchanged (sampling takes whole rows per program: no split-K)
        assert torch.equal(logits, fused_gemv_fwd(x, w, config=cfg and cfg._replace(split_k=1)))
        want = sample_greedy_or_gumbel(logits, temperature, seeds + launch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert ids.tolist() == want.tolist() == host.tolist()
        assert ids[0] == logits[0].float().argmax()  # the greedy row


def test_fused_sampling_refuses_what_it_cannot_do(device):
    x = torch.randn(2, 32, device=device)
    w = torch.randn(64, 32, device=device)
    t = torch.zeros(2, device=device)
    s = torch.zeros(2, dtype=torch.int64, device=device)
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="plain product"):
        fused_gemv_fwd(x, w, residual=torch.zeros(2, 64, device=device), sampling=GemvSampling(t, s, ids))
    with pytest.raises(ValueError, match="temperature"):
        fused_gemv_fwd(x, w, sampling=GemvSampling(t[:1], s, ids))
    with pytest.raises(ValueError, match="seeds"):
        fused_gemv_fwd(x, w, sampling=GemvSampling(t, s.int(), ids))
    with pytest.raises(ValueError, match="host_ids"):
        fused_gemv_fwd(x, w, sampling=GemvSampling(t, s, ids, torch.zeros(3, dtype=torch.int64)))
