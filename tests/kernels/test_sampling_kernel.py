"""The fused greedy/Gumbel sampling kernel: greedy equals argmax; sampling follows softmax(z/T);
a (seed, logits) pair always gives the same token, wherever the row sits in the batch."""

import math

import pytest
import torch

from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernel on a CPU


def sample(logits, temperature, seeds):
    return sample_greedy_or_gumbel(logits.to(DEV), temperature.to(DEV), seeds.to(DEV)).cpu()


def test_greedy_rows_are_argmax_with_lowest_index_on_ties():
    torch.manual_seed(0)
    logits = torch.randn(5, 3000)
    logits[1, 17] = logits[1, 2500] = 50.0  # tie: the lower index wins
    logits[2] = -1e30
    logits[2, 2999] = 0.0  # the last element, in the last partial tile
    temperature = torch.zeros(5)
    ids = sample(logits, temperature, torch.arange(5))
    expected = logits.argmax(-1)
    expected[1] = 17
    assert ids.tolist() == expected.tolist()


def test_sampling_follows_the_tempered_softmax():
    """Many rows with the same logits and distinct seeds: the empirical distribution must match
    softmax(z/T). Chi-square over 8 categories with 2000 draws: the 99.9% quantile for 7 degrees
    of freedom is 24.3."""
    V, N, T = 8, 2000, 0.7
    z = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.5])
    logits = z.expand(N, V).contiguous()
    ids = sample(logits, torch.full((N,), T), torch.arange(N) * 7919 + 1)
    counts = torch.bincount(ids, minlength=V).double()
    p = torch.softmax(z.double() / T, -1)
    chi2 = ((counts - N * p) ** 2 / (N * p)).sum().item()
    assert chi2 < 24.3, (chi2, counts.tolist(), (N * p).tolist())


def test_same_seed_same_token_anywhere_in_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 1000)
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    temperature = torch.ones(6)
    ids = sample(logits, temperature, seeds)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    again = sample(logits[perm], temperature[perm], seeds[perm])
    assert again.tolist() == ids[perm].tolist()
    other = sample(logits, temperature, seeds + 1000)
    assert other.tolist() != ids.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_temperature_approaches_greedy_and_masked_tokens_never_win(dtype):
    torch.manual_seed(2)
    logits = torch.randn(16, 700).to(dtype)
    logits[:, 100:200] = float("-inf")
    ids = sample(logits, torch.full((16,), 1e-4), torch.arange(16))
    assert ids.tolist() == logits.float().argmax(-1).tolist()
    hot = sample(logits, torch.full((16,), 5.0), torch.arange(16))
    assert not ((hot >= 100) & (hot < 200)).any()
    assert math.isfinite(float(hot.sum()))


def test_the_split_count_never_changes_the_token():
    """Rows are cut into chunks searched by separate programs; the noise is keyed by the vocabulary
    index and ties go to the lowest index across chunks too, so every split count gives the same ids
    as a single pass (and greedy rows the argmax)."""
    torch.manual_seed(3)
    V = 5000  # three 2,048-wide tiles, the last partial
    logits = torch.randn(4, V)
    logits[0, 100] = logits[0, 4100] = 40.0  # a greedy tie across chunks: index 100 wins
    temperature = torch.tensor([0.0, 0.8, 1.0, 0.0])
    seeds = torch.tensor([5, 6, 7, 8])
    args = (logits.to(DEV), temperature.to(DEV), seeds.to(DEV))
    by_split = {s: sample_greedy_or_gumbel(*args, splits=s).cpu().tolist() for s in (1, 2, 3, 7)}
    assert all(ids == by_split[1] for ids in by_split.values()), by_split
    assert by_split[1][0] == 100 and by_split[1][3] == logits[3].argmax().item()


def test_one_compile_serves_every_batch_size():
    """The split count varies with the batch; it must be a runtime value, or every new batch size would
    compile a kernel in the middle of serving (seen on the H200: 11 s of compiles in a timed run)."""
    from tinyvllm.kernels.sampling import sample_partial_kernel, sample_reduce_kernel

    def variants(kernel) -> int:
        cache = getattr(kernel, "device_caches", None) or getattr(kernel, "cache", None)
        if cache is None:
            pytest.skip("this Triton version keeps no inspectable compile cache")
        return sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in cache.values())

    kernels = (sample_partial_kernel, sample_reduce_kernel)
    before = [variants(k) for k in kernels]  # other tests of this process may have compiled other dtypes
    logits = torch.randn(40, 3000).to(DEV)
    for b, s in ((1, 1), (3, 2), (7, 5), (16, 16), (40, 17)):
        sample_greedy_or_gumbel(logits[:b], torch.zeros(b).to(DEV), torch.arange(b).to(DEV), splits=s)
    for kernel, n0 in zip(kernels, before):
        n = variants(kernel) - n0
        assert n <= 1, f"{kernel.fn.__name__} compiled {n} variants"


def test_host_out_gets_the_same_ids_as_the_device():
    """`host_out` (pinned on CUDA): the reduce kernel writes every row's id there too: greedy rows their
    argmax, sampled rows the token a call without it draws."""
    torch.manual_seed(5)
    logits = torch.randn(4, 5000).to(DEV)
    temperature = torch.tensor([0.0, 0.9, 0.0, 1.3]).to(DEV)
    seeds = torch.tensor([1, 2, 3, 4]).to(DEV)
    host = torch.full((4,), -7, dtype=torch.int64)
    if DEV == "cuda":
        host = host.pin_memory()
    ids = sample_greedy_or_gumbel(logits, temperature, seeds, host_out=host)
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert host.tolist() == ids.cpu().tolist() == sample_greedy_or_gumbel(logits, temperature, seeds).cpu().tolist()
    assert host[0] == logits[0].argmax() and host[2] == logits[2].argmax()
    with pytest.raises(ValueError, match="contiguous int64"):
        sample_greedy_or_gumbel(logits, temperature, seeds, host_out=host[:3])
