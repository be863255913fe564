"""Top-k / top-p / min-p sampling on the device (kernels/top_p_sampling/) against a float64 reference.

The reference is the sort-based definition the full sampler implements (sampling/sampler.py): over
l = z / T, top-k keeps l ≥ the k-th largest value, top-p (after top-k) drops the ascending prefix whose
softmax mass is ≤ 1 − p and keeps every token ≥ the smallest kept value (so a tie group at the boundary
is kept whole), min-p keeps l ≥ max l + log(min_p) (that sum in float32, as the sampler). The kernel's kept set is
read from its threshold (`truncation_thresholds`: kept iff z · (1 / T) > thr) and must equal the
reference's exactly on random rows; its draws must follow the renormalised truncated softmax
(chi-square) and be batch-independent.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tinyvllm.kernels.sampling import sample_greedy_or_gumbel
from tinyvllm.kernels.top_p_sampling import sample_top_k_top_p, truncation_plan, truncation_thresholds
from tinyvllm.kernels.top_p_sampling.plan import _NC
from tinyvllm.sampling.bitmask import pack_bitmask
from tinyvllm.sampling.sampler import apply_min_p, apply_top_k_top_p

# Upper 0.999 quantiles of chi-square with df = 1..7 degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def reference_kept(z: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """float64 kept mask [V] of one row of logits z (module docstring); 0 / 1.0 / 0 switch a filter off."""
    y = z.double() / temperature
    kept = torch.isfinite(y)
    asc = y.sort().values
    if 0 < top_k < y.numel():
        kept &= y >= asc[y.numel() - top_k]
    if top_p < 1.0:
        s = torch.where(kept, y, -math.inf).sort().values
        cum = torch.softmax(s, 0).cumsum(0)
        n_drop = int((cum <= 1.0 - top_p)[:-1].sum())  # a prefix; never the largest
        kept &= y >= s[n_drop]
    if min_p > 0.0:  # the threshold in float32, as the sampler computes it
        kept &= y >= float(y.max().float() + torch.log(torch.tensor(min_p, dtype=torch.float32)))
    return kept


def kernel_kept(z, temperature, top_k, top_p, min_p, bitmask=None, **search):
    """The kernel's kept masks [B, V]: z · (1 / T) > thr, the comparison its draw makes (`search`: the
    search's layout, `truncation_thresholds`' candidates, split_passes, chunk)."""
    thr, passes = truncation_thresholds(z, temperature, top_k, top_p, min_p, bitmask, **search)
    scaled = z.float() * (1.0 / temperature)[:, None]
    return scaled > thr[:, None], passes


def max_reads(nc: int) -> int:
    """The reads of a row the search may make without the precheck (module docstring, "The bound"): the
    statistics, then per search a first pass and at most ⌈32 / log2(NC / 2 + 1)⌉ passes of NC / 2 guards."""
    return 1 + 2 * (1 + math.ceil(32 / math.log2(nc // 2 + 1)))


def one_chunk(V: int) -> dict:
    """The default layout with its chunk cut to the row, rounded up to the statistics' block of 1,024: a
    row shorter than the default chunk (8,192) lies in one chunk either way, past it every value is −inf
    and adds exact zeros, so the sums and thresholds are the same bits (the edge rows check it), without
    the interpreter stepping through the empty rest of the default chunk."""
    return dict(chunk=1024 * math.ceil(V / 1024))


def params(rows, device):
    """(T, top_k, top_p, min_p) tensors from a list of (T, k, p, min_p) tuples."""
    t, k, p, m = zip(*rows)
    return (
        torch.tensor(t, dtype=torch.float32, device=device),
        torch.tensor(k, dtype=torch.int32, device=device),
        torch.tensor(p, dtype=torch.float32, device=device),
        torch.tensor(m, dtype=torch.float32, device=device),
    )


# (candidates, split_passes, chunk, block_e, skip): the default; every pass by the per-row programs;
# split passes over several chunks per row, ending in the per-row programs or not; 8 candidates per pass;
# 4 candidates over 16-lane iterations without the skip; 8 over 128-lane ones
LAYOUTS = [
    {},
    dict(split_passes=0, chunk=256),
    dict(split_passes=2, chunk=256),
    dict(candidates=8, chunk=128),
    dict(candidates=4, chunk=256, block_e=16, skip=False),
    dict(candidates=8, chunk=256, block_e=128, split_passes=3),
]


@pytest.mark.parametrize("search", LAYOUTS[1:])
def test_kept_set_equals_the_float64_reference_in_every_search_layout(device, search):
    """The search's launches (split over chunks or not, any number of split passes, NC) change where its
    sums are made, not the kept set."""
    test_kept_set_equals_the_float64_reference_on_random_rows(device, torch.bfloat16, search)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_set_equals_the_float64_reference_on_random_rows(device, dtype, search=None):
    """Assorted shapes of logits (flat, peaked, wide, with −inf) and every filter alone and combined (by
    default in the default layout, `one_chunk`)."""
    gen = torch.Generator().manual_seed(40)
    V = 700
    configs = [
        (0.7, 50, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (0.6, 50, 0.9, 0.0),
        (1.3, 0, 1.0, 0.1),
        (0.8, 20, 0.95, 0.05),
        (1.0, 1, 1.0, 0.0),
        (1.0, 699, 0.5, 0.0),
        (0.9, 0, 0.01, 0.0),
        (2.0, 300, 0.999, 0.0),
        (1.0, 0, 0.7, 0.3),
    ]
    rows, cfg = [], []
    for i, c in enumerate(configs):
        for shape in ("flat", "peaked", "wide"):
            z = torch.randn(V, generator=gen) * {"flat": 0.3, "peaked": 2.0, "wide": 8.0}[shape]
            if shape == "peaked":
                z[torch.randperm(V, generator=gen)[:5]] += torch.tensor([9.0, 8.0, 8.0, 6.0, 3.0])
            if i % 3 == 0:
                z[torch.randperm(V, generator=gen)[:100]] = -math.inf  # banned tokens
            rows.append(z)
            cfg.append(c)
    z = torch.stack(rows).to(dtype)
    search = one_chunk(V) if search is None else search
    kept, passes = kernel_kept(z.to(device), *params(cfg, device), **search)
    for b, (t, k, p, m) in enumerate(cfg):
        ref = reference_kept(z[b].float(), t, k, p, m)
        assert torch.equal(kept[b].cpu(), ref), (b, cfg[b], int(kept[b].sum()), int(ref.sum()))
    assert int(passes.max()) <= max_reads(search.get("candidates", _NC))


@pytest.mark.parametrize("search", LAYOUTS)
def test_edge_rows_keep_what_the_reference_keeps_in_every_layout(device, search):
    """All-equal rows (one tie group: kept whole by top-k and top-p), a tie at the top with k = 1, a tiny
    p, p = 1 with a huge k (nothing cut), k = 1, mostly −inf rows, min-p alone and with top-p, and a
    row whose values all lie within a few floats of each other. The default layout's thresholds are the
    same bits in a chunk of the rows' own length (`one_chunk`, which the other tests of the default
    layout use)."""
    gen = torch.Generator().manual_seed(11)
    V = 600
    rows, cfg = [], []

    def add(z, c):
        rows.append(z)
        cfg.append(c)

    add(torch.zeros(V), (1.0, 3, 1.0, 0.0))
    add(torch.full((V,), 2.5), (0.7, 0, 0.5, 0.0))
    z = torch.randn(V, generator=gen)
    z[[5, 99, 421]] = 9.0
    add(z, (1.0, 1, 1.0, 0.0))
    add(torch.randn(V, generator=gen) * 3, (0.9, 0, 1e-6, 0.0))
    add(torch.randn(V, generator=gen) * 3, (0.9, 10**6, 1.0, 0.0))
    add(torch.randn(V, generator=gen) * 3, (1.1, 1, 0.9, 0.1))
    z = torch.full((V,), -math.inf)
    z[[17, 555]] = torch.tensor([1.0, 0.5])
    add(z, (1.0, 0, 0.6, 0.0))
    add(torch.randn(V, generator=gen) * 2, (0.8, 0, 1.0, 0.3))
    add(torch.randn(V, generator=gen) * 2, (0.8, 0, 0.8, 0.05))
    add(1.0 + torch.randint(0, 4, (V,), generator=gen) * 2.0**-20, (1.0, 0, 0.5, 0.0))
    add(torch.randn(V, generator=gen) * 5, (1.0, 599, 0.999, 0.0))
    z = torch.stack(rows)
    zd = z.to(device)
    thr, _ = truncation_thresholds(zd, *params(cfg, device), **search)
    kept = zd.float() * (1.0 / params(cfg, device)[0])[:, None] > thr[:, None]  # as `kernel_kept`
    for b, (t, k, p, m) in enumerate(cfg):
        ref = reference_kept(z[b], t, k, p, m)
        assert torch.equal(kept[b].cpu(), ref), (b, cfg[b], int(kept[b].sum()), int(ref.sum()))
    if not search:  # the default chunk holds these rows whole: the same bits in a chunk of their own length
        assert truncation_thresholds(zd, *params(cfg, device), **one_chunk(V))[0].tolist() == thr.tolist()
    assert kept[0].all() and kept[1].all() and kept[2].nonzero().flatten().tolist() == [5, 99, 421]
    assert kept[6].nonzero().flatten().tolist() in ([17], [17, 555])


def test_thresholds_are_the_rows_own_whatever_the_batch(device):
    """Split over chunks, a row's threshold (its sums) is the same bits alone, first or last in a batch."""
    gen = torch.Generator().manual_seed(21)
    V, B = 1000, 4
    z = (torch.randn(B, V, generator=gen) * 2).to(device)
    cfg = [(0.8, 40, 0.9, 0.0), (1.0, 0, 0.8, 0.0), (0.6, 0, 1.0, 0.1), (1.2, 7, 0.95, 0.0)]
    search = dict(split_passes=2, chunk=256)
    thr, _ = truncation_thresholds(z, *params(cfg, device), **search)
    perm = [3, 1, 0, 2]
    again, _ = truncation_thresholds(z[perm], *params([cfg[i] for i in perm], device), **search)
    assert again.cpu().tolist() == thr[perm].cpu().tolist()
    for b in (0, 3):
        alone, _ = truncation_thresholds(z[b : b + 1], *params(cfg[b : b + 1], device), **search)
        assert float(alone) == float(thr[b])


@pytest.mark.parametrize("candidates", [4, 8, 16])
def test_skipping_and_unrolling_change_no_sum(device, candidates):
    """The skip only leaves out zeros and the unroll keeps each lane's order: the thresholds and passes
    are the same bits with and without either, for several lane counts, and the kept sets are the
    float64 reference's."""
    gen = torch.Generator().manual_seed(17 + candidates)
    V = 512  # two chunks per row
    z = torch.randn(6, V, generator=gen) * torch.tensor([0.3, 2.0, 8.0, 1.0, 3.0, 0.5])[:, None]
    z[3, 100:400] = -math.inf
    cfg = [(0.7, 50, 0.9, 0.0), (1.0, 0, 0.9, 0.0), (0.6, 20, 1.0, 0.0), (1.0, 0, 0.5, 0.1), (1.2, 300, 0.99, 0.0),
           (0.9, 0, 0.2, 0.0)]  # fmt: skip
    zd = z.to(device)
    for block_e in (32, 256):
        layout = dict(candidates=candidates, chunk=256, split_passes=2, block_e=block_e)
        thr, passes = truncation_thresholds(zd, *params(cfg, device), skip=True, **layout)
        thr_all, passes_all = truncation_thresholds(zd, *params(cfg, device), skip=False, **layout)
        thr_2, passes_2 = truncation_thresholds(zd, *params(cfg, device), skip=True, unroll=2, **layout)
        assert thr.cpu().tolist() == thr_all.cpu().tolist() == thr_2.cpu().tolist(), block_e
        assert passes.cpu().tolist() == passes_all.cpu().tolist() == passes_2.cpu().tolist(), block_e
        kept = z.float() * (1.0 / params(cfg, "cpu")[0])[:, None] > thr.cpu()[:, None]
        for b, c in enumerate(cfg):
            assert torch.equal(kept[b], reference_kept(z[b], *c)), (block_e, b, c)


def _adversarial_rows(gen, V):
    """Rows that defeat the placement's estimates (so the guards must do the work) or its arithmetic: many
    ties, every value equal, one logit holding the mass, heavy tails (Student t, 3 degrees of freedom), a
    large offset (the moments cancel), values over every binade of float32, two far clusters, mostly −inf,
    and random values for the bitmask (shape → row)."""
    chi2 = (torch.randn(3, V, generator=gen) ** 2).sum(0) / 3
    signs = torch.where(torch.rand(V, generator=gen) < 0.5, -1.0, 1.0)  # |l| up to e^40: l² stays finite
    bimodal = torch.randn(V, generator=gen) * 0.5 - 20.0
    bimodal[: V // 50] += 25.0
    mostly_inf = torch.randn(V, generator=gen) * 2
    mostly_inf[torch.rand(V, generator=gen) < 0.9] = -math.inf
    huge = torch.randn(V, generator=gen) * 2
    huge[7] = 60.0
    return {
        "ties": torch.randint(-8, 9, (V,), generator=gen).float() * 0.25,
        "equal": torch.full((V,), 1.5),
        "huge": huge,
        "heavy": torch.randn(V, generator=gen) / chi2.sqrt() * 2,
        "offset": 1000.0 + torch.randn(V, generator=gen) * 0.01,
        "binades": signs * torch.exp(torch.rand(V, generator=gen) * 80 - 40),
        "bimodal": bimodal,
        "mostly_inf": mostly_inf,
        "masked": torch.randn(V, generator=gen) * 2,
    }


ADVERSARIAL_CONFIGS = [
    (1.0, 0, 0.9, 0.0),
    (1.0, 20, 0.9, 0.0),
    (1.0, 20, 1.0, 0.0),
    (1.0, 5, 0.5, 0.05),
    (1.0, 0, 0.3, 0.0),
]


@pytest.mark.parametrize("search", [{}, dict(candidates=4, chunk=512), dict(candidates=16, chunk=512, split_passes=2)])
def test_adversarial_rows_keep_what_the_reference_keeps_within_the_bound(device, search):
    """Rows the placement's models get wrong or cannot represent, under every filter: the kept set is the
    reference's and the reads stay within the bound the guards prove (`max_reads`); a bitmask allowing one
    token in 8 on one shape, and a vocabulary of 37. The default layout holds a row in one chunk
    (`one_chunk`); the others cut it in two."""
    gen = torch.Generator().manual_seed(23)
    V = 1024
    search = search or one_chunk(V)
    shapes = _adversarial_rows(gen, V)
    rows, cfg = [], []
    for z in shapes.values():
        for c in ADVERSARIAL_CONFIGS:
            rows.append(z)
            cfg.append(c)
    z = torch.stack(rows)
    allowed = torch.ones(len(rows), V, dtype=torch.bool)
    masked = [b for b in range(len(rows)) if b // len(ADVERSARIAL_CONFIGS) == list(shapes).index("masked")]
    allowed[masked] = torch.rand(len(masked), V, generator=gen) < 0.125
    bitmask = torch.from_numpy(pack_bitmask(allowed.numpy())).to(device)
    kept, passes = kernel_kept(z.to(device), *params(cfg, device), bitmask=bitmask, **search)
    kept = kept.cpu() & allowed  # the draw also skips what the bitmask disallows
    for b, c in enumerate(cfg):
        ref = reference_kept(z[b].masked_fill(~allowed[b], -math.inf), *c)
        assert torch.equal(kept[b], ref), (list(shapes)[b // len(ADVERSARIAL_CONFIGS)], c)
    bound = max_reads(search.get("candidates", _NC))
    assert int(passes.max()) <= bound, passes.view(len(shapes), -1).tolist()
    tiny = torch.randn(len(ADVERSARIAL_CONFIGS), 37, generator=gen) * 2
    kept, passes = kernel_kept(tiny.to(device), *params(ADVERSARIAL_CONFIGS, device), **search)
    for b, c in enumerate(ADVERSARIAL_CONFIGS):
        assert torch.equal(kept[b].cpu(), reference_kept(tiny[b], *c)), c
    assert int(passes.max()) <= bound


def test_flat_rows_take_few_passes(device):
    """The candidates placed around the estimates of t* (module docstring, "Where the candidates go"):
    on flat rows (randn · 2 at T = 0.6, float32, V = 16,384) the mean reads per row stay well below what
    candidates spread evenly over the bracket (half over its values, half over its keys) need on these
    rows, about 7, 5 and 8, and the kept sets are the reference's."""
    gen = torch.Generator().manual_seed(2)
    B, V = 4, 16384
    z = torch.randn(B, V, generator=gen) * 2
    for c, most in (((0.6, 0, 0.9, 0.0), 5.5), ((0.6, 50, 1.0, 0.0), 4.0), ((0.6, 50, 0.9, 0.0), 5.5)):
        kept, passes = kernel_kept(z.to(device), *params([c] * B, device), chunk=4096)
        for b in range(B):
            assert torch.equal(kept[b].cpu(), reference_kept(z[b], *c)), (b, c)
        assert float(passes.float().mean()) <= most, (c, passes.tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_end_at_one_value_a_token_can_take(device, dtype):
    """bf16 and fp16 logits take a sparse subset of the float32 values, and l = z · (1 / T) is monotone in
    z: a search ends when (lo, hi] holds one value of that subset (`_is_done`). The same values as
    float32 logits (where the test is off) give the same kept sets, in more reads for bf16 (fp16's values
    lie 8× denser: at V = 3,000 they rarely tie); temperatures below and above 1, ties included."""
    gen = torch.Generator().manual_seed(19)
    V = 3000
    z = (torch.randn(6, V, generator=gen) * torch.tensor([2.0, 2.0, 4.0, 1.0, 3.0, 2.0])[:, None]).to(dtype)
    z[5, ::7] = z[5, 3]  # a large tie group
    cfg = [(0.6, 0, 0.9, 0.0), (1.7, 50, 0.9, 0.0), (0.37, 50, 1.0, 0.0), (1.0, 20, 0.5, 0.0), (2.9, 0, 0.6, 0.0),
           (0.8, 0, 0.95, 0.0)]  # fmt: skip
    half, passes_half = kernel_kept(z.to(device), *params(cfg, device), chunk=1024)
    full, passes_full = kernel_kept(z.float().to(device), *params(cfg, device), chunk=1024)
    for b, c in enumerate(cfg):
        ref = reference_kept(z[b].float(), *c)
        assert torch.equal(half[b].cpu(), ref) and torch.equal(full[b].cpu(), ref), (b, c)
    if dtype == torch.bfloat16:
        assert int(passes_half.sum()) < int(passes_full.sum()), (passes_half.tolist(), passes_full.tolist())
    assert int(passes_half.max()) <= max_reads(8)


def test_bad_search_layouts_raise():
    z, t = torch.zeros(1, 256), torch.ones(1)
    k, p, m = torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.zeros(1)
    with pytest.raises(ValueError, match="block_e"):
        truncation_thresholds(z, t, k, p, m, block_e=96)
    with pytest.raises(ValueError, match="unroll"):
        truncation_thresholds(z, t, k, p, m, unroll=3)
    with pytest.raises(ValueError, match="candidates"):
        truncation_thresholds(z, t, k, p, m, candidates=12)


def test_ties_at_the_threshold_keep_the_whole_tie_group_as_the_full_sampler_does(device):
    """Top-k: 3 tokens tied at the 2nd..4th largest value with k = 2: all three kept. Top-p: the
    boundary falls inside a tie group: the group is kept whole. Min-p: a tie at exactly the min-p
    value is kept (≥). The full sampler's own filters agree, which is the rule being matched."""
    neg = -30.0
    z = torch.full((4, 12), neg)
    z[0, [3, 7, 9, 11]] = torch.tensor([5.0, 4.0, 4.0, 4.0])  # top-k 2
    z[1, [0, 5, 6, 8]] = torch.tensor([2.0, 1.0, 1.0, 1.0])  # top-p 0.5: boundary inside the 1.0s
    at_min_p = float(torch.tensor(3.0) + torch.log(torch.tensor(0.25)))  # the sampler's float32 threshold
    z[2, [1, 2, 4]] = torch.tensor([3.0, at_min_p, at_min_p])  # min-p 0.25
    z[3, [2, 4, 10]] = torch.tensor([1.0, 1.0, 1.0])  # three-way tie at the top, top-k 1
    cfg = [(1.0, 2, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.25), (1.0, 1, 1.0, 0.0)]
    kept, _ = kernel_kept(z.to(device), *params(cfg, device), **one_chunk(12))
    expected = [[3, 7, 9, 11], [0, 5, 6, 8], [1, 2, 4], [2, 4, 10]]
    for b, (t, k, p, m) in enumerate(cfg):
        assert kept[b].nonzero().flatten().tolist() == expected[b], b
        ref = reference_kept(z[b], t, k, p, m)
        assert ref.nonzero().flatten().tolist() == expected[b], b
        full = z[b : b + 1].clone()
        apply_top_k_top_p(full, torch.tensor([k if k else 12]), torch.tensor([p]), max_top_k=k)
        if m:
            apply_min_p(full, torch.tensor([m]))
        assert (full[0] > -math.inf).nonzero().flatten().tolist() == expected[b], b


def test_draws_follow_the_truncated_distribution(device):
    """Many rows of the same logits with distinct seeds, for top-k, top-p, min-p and a combination (one
    batch): the empirical distribution of each block of rows matches the float64 truncated, renormalised
    softmax (chi-square at the 0.999 quantile); removed tokens never appear. Tokens sit at shuffled
    indices so the sorted order differs from the index order. With the precheck (each row's own plain
    draw decides whether it is searched) the ids are the same, on the first 25 rows of each block, where
    both routes occur for each configuration."""
    n = 200
    z = torch.tensor([1.0, -0.5, 0.3, 2.0, -2.0, 0.9, 1.6, 0.0])
    configs = [(1.0, 3, 1.0, 0.0), (0.8, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.2), (0.7, 5, 0.9, 0.05)]
    rows = len(configs) * n
    seeds = torch.arange(rows, dtype=torch.int64, device=device) * 7919 + 5
    t = torch.tensor([c[0] for c in configs], device=device).repeat_interleave(n)
    logits = z.expand(rows, -1).contiguous().to(device)
    # sample_top_k_top_p is this composition; without the precheck the threshold depends on the row alone,
    # so it is found once per configuration (the interpreter runs one program per row, slowly) and the
    # draw runs over n seeds.
    thr, _ = truncation_thresholds(z.expand(len(configs), -1).contiguous().to(device), *params(configs, device))
    ids = sample_greedy_or_gumbel(logits, t, seeds, thresholds=thr.repeat_interleave(n)).cpu()
    # each row's own plan with the precheck, on the first m rows of each block (one-program-per-row passes
    # over 8-logit chunks: fewer interpreted programs)
    m = 25
    sub = torch.tensor([j * n + i for j in range(len(configs)) for i in range(m)])
    t_rows, k_rows, p_rows, m_rows = params([configs[int(r) // n] for r in sub], device)
    sub_seeds, sub_logits = seeds[sub.to(device)], logits[sub.to(device)]
    thr, _, decided = truncation_plan(
        sub_logits, t_rows, sub_seeds, k_rows, p_rows, m_rows, chunk=8, split_passes=0, radix=False
    )
    prechecked = sample_greedy_or_gumbel(sub_logits, t_rows, sub_seeds, thresholds=thr, decided=decided).cpu()
    assert prechecked.tolist() == ids[sub].tolist()
    per_block = (decided.cpu() >= 0).view(len(configs), m).sum(1)
    assert ((per_block > 0) & (per_block < m)).all(), per_block.tolist()  # decided and searched rows, each
    for j, (temperature, top_k, top_p, min_p) in enumerate(configs):
        kept = reference_kept(z, temperature, top_k, top_p, min_p)
        p = torch.where(kept, torch.softmax(z.double() / temperature, 0), 0.0)
        p /= p.sum()
        counts = torch.bincount(ids[j * n : (j + 1) * n], minlength=8).double()
        assert counts[~kept].sum() == 0, (j, counts)
        expected = n * p[kept]
        chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
        df = int(kept.sum()) - 1
        assert df >= 1 and chi2 < CHI2_999[df], (j, chi2, counts.tolist(), expected.tolist())


def _with_seeds(cfg, seeds, device):
    t, k, p, m = params(cfg, device)
    return t, seeds.to(device), k, p, m


def test_same_seed_same_id_alone_and_anywhere_in_any_batch(device):
    gen = torch.Generator().manual_seed(3)
    V, B = 1200, 6
    z = torch.randn(B, V, generator=gen) * 2
    cfg = [(0.8, 40, 0.9, 0.0), (1.0, 0, 0.8, 0.0), (0.6, 0, 1.0, 0.1), (1.2, 7, 1.0, 0.0), (0.0, 5, 0.5, 0.0),
           (0.9, 100, 0.95, 0.02)]  # fmt: skip
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    ids = sample_top_k_top_p(z.to(device), *_with_seeds(cfg, seeds, device)).cpu()
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    again = sample_top_k_top_p(
        z[perm].to(device), *_with_seeds([cfg[i] for i in perm], seeds[perm], device), splits=2, radix=True
    )
    assert again.cpu().tolist() == ids[perm].tolist()
    for b in (0, 5):
        alone = sample_top_k_top_p(
            z[b : b + 1].to(device), *_with_seeds(cfg[b : b + 1], seeds[b : b + 1], device), radix=True
        )
        assert int(alone) == int(ids[b])
    assert int(ids[4]) == int(z[4].argmax())  # greedy rows ignore the filters
    for b in range(B):
        assert reference_kept(z[b], max(cfg[b][0], 1e-3), *cfg[b][1:])[ids[b]]


def test_nothing_truncated_draws_the_plain_fused_kernels_ids(device):
    """top_p 1, top_k 0 or ≥ V, min_p 0: the same noise over the same tokens, so the same ids, with and
    without a bitmask."""
    gen = torch.Generator().manual_seed(5)
    V, B = 5000, 5
    z = torch.randn(B, V, generator=gen) * 3
    z[1, :2000] = -math.inf
    cfg = [(0.7, 0, 1.0, 0.0), (1.0, V, 1.0, 0.0), (1.5, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.3, V + 9, 1.0, 0.0)]
    seeds = torch.arange(B, dtype=torch.int64) * 31 + 1
    t, s, k, p, m = _with_seeds(cfg, seeds, device)
    zd = z.to(device)
    assert sample_top_k_top_p(zd, t, s, k, p, m).tolist() == sample_greedy_or_gumbel(zd, t, s).tolist()
    allowed = torch.rand(B, V, generator=gen) < 0.1
    bitmask = torch.from_numpy(pack_bitmask(allowed.numpy())).to(device)
    ours = sample_top_k_top_p(zd, t, s, k, p, m, bitmask=bitmask)
    assert ours.tolist() == sample_greedy_or_gumbel(zd, t, s, bitmask=bitmask).tolist()


def test_edge_rows(device):
    """top_k 1 is the argmax; all mass on one token; a row without a finite logit gives index 0 (as the
    fused kernel); a bitmask restricts the kept set, then the filters apply to what it allows."""
    gen = torch.Generator().manual_seed(9)
    V = 1500
    z = torch.randn(5, V, generator=gen)
    z[1] = -1e4
    z[1, 1234] = 5.0  # all the mass
    z[2] = -math.inf
    cfg = [(1.0, 1, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 0.9, 0.1), (0.5, 0, 0.6, 0.0), (0.5, 3, 1.0, 0.0)]
    allowed = torch.ones(5, V, dtype=torch.bool)
    allowed[3:, ::3] = False
    bitmask = torch.from_numpy(pack_bitmask(allowed.numpy())).to(device)
    for seed in (1, 2, 3):
        seeds = torch.full((5,), seed, dtype=torch.int64)
        ids = sample_top_k_top_p(z.to(device), *_with_seeds(cfg, seeds, device), bitmask=bitmask).cpu()
        assert ids[:3].tolist() == [int(z[0].argmax()), 1234, 0]
        for b in (3, 4):
            masked = z[b].masked_fill(~allowed[b], -math.inf)
            assert reference_kept(masked, *cfg[b])[ids[b]], (b, int(ids[b]))
    kept, _ = kernel_kept(z.to(device), *params(cfg, device), bitmask=bitmask, **one_chunk(V))
    kept = kept.cpu() & allowed  # the draw also skips what the bitmask disallows
    for b in (3, 4):
        masked = z[b].masked_fill(~allowed[b], -math.inf)
        assert torch.equal(kept[b], reference_kept(masked, *cfg[b])), b
    assert int(kept[1].sum()) == 1 and int(kept[2].sum()) == 0


def test_bad_parameter_tensors_raise():
    z = torch.zeros(2, 10)
    t, s = torch.ones(2), torch.zeros(2, dtype=torch.int64)
    k, p, m = torch.zeros(2, dtype=torch.int32), torch.ones(2), torch.zeros(2)
    with pytest.raises(ValueError, match="top_k must be"):
        sample_top_k_top_p(z, t, s, k.long(), p, m)
    with pytest.raises(ValueError, match="top_p must be"):
        sample_top_k_top_p(z, t, s, k, p[:1], m)


# The precheck (`truncation_plan(precheck=True)`, `sample_top_k_top_p`'s default): the plain draw x1 is
# found with the statistics and kept where a check pass proves it kept; the ids must be the search's.
# These tests follow the precheck's routes, so the radix select (which takes the top-k rows first) is off.


def _plan_draw(z, cfg, seeds, bitmask=None, precheck=True, radix=False, **search):
    """`sample_top_k_top_p`'s composition with a chosen search layout: (ids, passes, decided ids or None)."""
    t, s, k, p, m = _with_seeds(cfg, seeds, z.device)
    thr, passes, decided = truncation_plan(z, t, s, k, p, m, bitmask, precheck=precheck, radix=radix, **search)
    ids = sample_greedy_or_gumbel(z, t, s, bitmask=bitmask, thresholds=thr, decided=decided)
    return ids.cpu(), passes.cpu(), None if decided is None else decided.cpu()


def _plain_ids(z, cfg, seeds, bitmask=None):
    """The fused sampler's thresholded draw over every token (threshold −inf: no truncation), on z's device:
    the draw x1 the precheck keeps or hands to the search (the draw over the kept set in its arithmetic)."""
    t, s = _with_seeds(cfg, seeds, z.device)[:2]
    everything = torch.full((z.shape[0],), float("-inf"), device=z.device)
    return sample_greedy_or_gumbel(z, t, s, bitmask=bitmask, thresholds=everything).cpu()


def _mixed_rows(gen, V, n_rows, configs):
    """Rows of assorted shapes (flat, peaked, wide, some with −inf) under a cycle of configurations."""
    rows, cfg = [], []
    for i in range(n_rows):
        shape = ("flat", "peaked", "wide")[i % 3]
        z = torch.randn(V, generator=gen) * {"flat": 0.5, "peaked": 2.0, "wide": 6.0}[shape]
        if shape == "peaked":
            z[torch.randperm(V, generator=gen)[:6]] += torch.tensor([9.0, 8.0, 8.0, 6.0, 4.0, 3.0])
        if i % 4 == 1:
            z[torch.randperm(V, generator=gen)[: V // 5]] = -math.inf
        rows.append(z)
        cfg.append(configs[i % len(configs)])
    return torch.stack(rows), cfg


PRECHECK_CONFIGS = [
    (0.8, 0, 0.9, 0.0),  # top-p alone
    (0.7, 30, 1.0, 0.0),  # top-k alone
    (0.6, 30, 0.9, 0.0),  # top-k + top-p
    (1.0, 0, 1.0, 0.1),  # min-p alone
    (0.9, 0, 0.8, 0.05),  # top-p + min-p
    (1.1, 8, 0.95, 0.02),  # all three
    (1.0, 3, 1.0, 0.0),  # a small k
    (0.8, 0, 0.5, 0.0),  # a small p
    (1.0, 0, 1.0, 0.0),  # no filter
    (0.0, 10, 0.5, 0.1),  # greedy: filters ignored
]


@functools.cache
def _routes_rows(device: torch.device):
    """The rows, configurations, seeds and plain ids of `test_precheck_draws_the_searchs_ids_by_both_routes`:
    the plain draw does not depend on the search's layout, so its layouts share one."""
    gen = torch.Generator().manual_seed(77)
    z, cfg = _mixed_rows(gen, 2500, 60, PRECHECK_CONFIGS)
    seeds = torch.arange(len(cfg), dtype=torch.int64) * 7919 + 3
    return z, cfg, seeds, _plain_ids(z.to(device), cfg, seeds)


@pytest.mark.parametrize("search", [dict(chunk=1024), dict(chunk=256, split_passes=2), dict(chunk=512, candidates=4)])
def test_precheck_draws_the_searchs_ids_by_both_routes(device, search):
    """Many rows and seeds: with the precheck the ids are the ones the search alone gives; rows whose x1
    is kept (decided) draw the plain kernel's id, and both routes (decided and searched) occur for each
    filter that cuts. Chunks of 1,024 (statistics in blocks of two quarters of the sampler's tile) and of
    256 and 512 (a block inside one quarter; several chunks whose bests combine in chunk order)."""
    z, cfg, seeds, plain = _routes_rows(device)
    zd = z.to(device)
    ids, passes, decided = _plan_draw(zd, cfg, seeds, **search)
    old, old_passes, _ = _plan_draw(zd, cfg, seeds, precheck=False, **search)
    assert ids.tolist() == old.tolist()
    routes = {}
    for b, c in enumerate(cfg):
        truncating = c[0] > 0 and (c[1] > 0 or c[2] < 1 or c[3] > 0)
        if not truncating:
            assert int(decided[b]) == -1 and int(passes[b]) == 0 and int(ids[b]) == int(plain[b]), b
            continue
        assert reference_kept(z[b], *c)[ids[b]], (b, c)
        if int(decided[b]) >= 0:
            assert int(decided[b]) == int(ids[b]) == int(plain[b]), (b, c)
            assert int(passes[b]) <= 2  # the statistics, and the check unless min-p alone decided
        else:
            assert int(passes[b]) >= 2 or c[1:3] == (0, 1.0), (b, c)  # min-p alone: no check, no search
        key = c[1:]
        routes.setdefault(key, [0, 0])[int(decided[b]) < 0] += 1
    for key in ((0, 0.9, 0.0), (30, 1.0, 0.0), (30, 0.9, 0.0), (0, 1.0, 0.1)):
        assert min(routes[key]) >= 1, (key, routes)  # decided and searched rows, each filter
    assert sum(r[0] for r in routes.values()) >= 10 and sum(r[1] for r in routes.values()) >= 10, routes
    assert float(passes.float().sum()) < float(old_passes.float().sum())


@pytest.mark.parametrize("search", [{}, dict(chunk=256, split_passes=0)])
def test_filters_that_cut_nothing_are_decided_by_the_statistics_with_the_plain_id(device, search):
    """A row with k ≥ V or min_p so small nothing is cut truncates nothing: the statistics' x1 is kept
    at once (one read) and must be the plain kernel's id bit for bit, for many seeds, with a bitmask too.
    The default layout (`one_chunk`: the split passes run, and skip every row) and chunks of 256 (a
    statistics block inside one quarter of the sampler's tile; no split passes, as no row is left)."""
    gen = torch.Generator().manual_seed(8)
    V, B = 3000, 24
    search = search or one_chunk(V)
    z = torch.randn(B, V, generator=gen) * 3
    z[::4, 1000:] = -math.inf
    cfg = [(0.3 + 0.1 * (b % 7), V + b if b % 2 else 0, 1.0, 0.0 if b % 2 else 1e-30) for b in range(B)]
    seeds = torch.arange(B, dtype=torch.int64) * 104729 + 11
    allowed = torch.rand(B, V, generator=gen) < 0.3
    bitmask = torch.from_numpy(pack_bitmask(allowed.numpy())).to(device)
    zd = z.to(device)
    for mask in (None, bitmask):
        ids, passes, decided = _plan_draw(zd, cfg, seeds, bitmask=mask, **search)
        plain = _plain_ids(zd, cfg, seeds, bitmask=mask)
        assert decided.tolist() == plain.tolist() == ids.tolist()
        assert passes.tolist() == [1] * B


def test_precheck_at_ties_on_the_boundary(device):
    """x1 in a tie group at the boundary (kept whole, so x1 is kept), and x1 just outside one: top-k with
    the k-th value tied, top-p whose boundary falls inside a tie group, top-k + top-p, min-p at exactly its
    value. Over many seeds each row's x1 falls in and out of the kept set; the ids are the search's and
    within the reference's kept set, and both routes occur."""
    neg = -30.0
    V = 16
    z = torch.full((6, V), neg)
    z[0, [3, 7, 9, 11]] = torch.tensor([1.0, 0.6, 0.6, 0.6])  # top-k 2: the three 0.6s are kept with the 1.0
    z[1, [3, 7, 9, 11, 12]] = torch.tensor([1.0, 1.0, 1.0, 0.4, 0.2])  # top-k 2: the tied top three kept
    z[2, [0, 5, 6, 8, 13]] = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0])  # top-p 0.5: boundary inside the 1.0s
    z[3, [1, 4, 6, 10]] = torch.tensor([1.5, 1.0, 1.0, 0.9])  # top-k 3 (ties at the 2nd) + top-p 0.8
    at_min_p = float(torch.tensor(3.0) + torch.log(torch.tensor(0.25)))
    z[4, [1, 2, 4, 5]] = torch.tensor([3.0, at_min_p, at_min_p, at_min_p - 0.01])  # min-p 0.25: ≥ is kept
    z[5, [0, 1, 2, 3]] = torch.tensor([0.5, 0.5, 0.5, 0.5])  # a four-way tie with top-k 1 and top-p 0.1
    base = [(1.0, 2, 1.0, 0.0), (1.0, 2, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (1.0, 3, 0.8, 0.0), (1.0, 0, 1.0, 0.25),
            (1.0, 1, 0.1, 0.0)]  # fmt: skip
    n = 8
    rows = z.repeat_interleave(n, 0)
    cfg = [c for c in base for _ in range(n)]
    seeds = torch.arange(len(cfg), dtype=torch.int64) * 31 + 7
    ids, _, decided = _plan_draw(rows.to(device), cfg, seeds, chunk=16)
    old, _, _ = _plan_draw(rows.to(device), cfg, seeds, precheck=False, chunk=16)
    assert ids.tolist() == old.tolist()
    for j, c in enumerate(base):
        kept = reference_kept(z[j], *c)
        got = ids[j * n : (j + 1) * n]
        assert kept[got].all(), (j, got.tolist())
        assert (decided[j * n : (j + 1) * n] >= 0).any(), j
    # a plain draw x1 inside the boundary's tie group is kept: decided by the precheck; one outside the
    # kept set is searched
    plain = _plain_ids(rows.to(device), cfg, seeds)
    tied = {0: [7, 9, 11], 1: [3, 7, 9], 2: [5, 6, 8], 3: [4, 6], 4: [2, 4], 5: [0, 1, 2, 3]}
    for j, group in tied.items():
        block = range(j * n, (j + 1) * n)
        hits = [b for b in block if int(plain[b]) in group]
        assert hits and all(int(decided[b]) == int(plain[b]) == int(ids[b]) for b in hits), (j, plain[j * n :])
        outside = [b for b in block if not reference_kept(z[j], *base[j])[plain[b]]]
        assert all(int(decided[b]) == -1 for b in outside), j
    assert (decided < 0).sum() >= 5


def test_precheck_ids_are_the_rows_own_whatever_the_batch(device):
    """Decided and searched rows alike: the same ids alone, and permuted in a batch with other rows."""
    gen = torch.Generator().manual_seed(12)
    V = 1500
    z, cfg = _mixed_rows(gen, V, 10, PRECHECK_CONFIGS)
    seeds = torch.arange(10, dtype=torch.int64) * 17 + 2
    ids, _, decided = _plan_draw(z.to(device), cfg, seeds, chunk=512)
    assert (decided >= 0).sum() >= 2 and (decided < 0).sum() >= 2
    perm = torch.tensor([7, 2, 9, 0, 5, 1, 8, 3, 6, 4])
    again, _, again_decided = _plan_draw(z[perm].to(device), [cfg[i] for i in perm], seeds[perm], chunk=512)
    assert again.tolist() == ids[perm].tolist() and again_decided.tolist() == decided[perm].tolist()
    for b in (0, 1, 2, 3):
        alone, _, _ = _plan_draw(z[b : b + 1].to(device), cfg[b : b + 1], seeds[b : b + 1], chunk=512)
        assert int(alone) == int(ids[b])
    full = sample_top_k_top_p(z.to(device), *_with_seeds(cfg, seeds, device)).cpu()
    assert full.tolist() == sample_top_k_top_p(z.to(device), *_with_seeds(cfg, seeds, device), precheck=False).tolist()


def test_precheck_needs_seeds():
    z, t = torch.zeros(1, 256), torch.ones(1)
    k, p, m = torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.zeros(1)
    with pytest.raises(ValueError, match="seeds"):
        truncation_plan(z, t, None, k, p, m)


def _open_top_p_rows(gen, V, n):
    """n rows each of two shapes for top-k + top-p, whose plain draw often lies in the top-k set without
    passing the check's top-p test (M(l_x1) ≥ p · Σ_{l ≥ l_x1}): 20 tokens stepping down by 0.05 from 3
    over a tail near −2, top-k 20, top-p 0.6 (x1 low in the top-k set is kept or not by Z_k); and
    2.0, 1.0 × 3, 0.0 × 3 over −30, top-k 5 (cut inside the 0.0s: the group kept whole), top-p 0.45
    (M(1.0) = e² lies between p · S and p · Z_k: the 1.0s are kept, the 0.0s not)."""
    rows, cfg = [], []
    for i in range(n):
        z = torch.randn(V, generator=gen) * 0.5 - 2.0
        z[torch.randperm(V, generator=gen)[:20]] = 3.0 - 0.05 * torch.arange(20.0)
        rows.append(z)
        cfg.append((1.0 if i % 2 else 0.9, 20, 0.6, 0.0))
        z = torch.full((V,), -30.0)
        z[torch.randperm(V, generator=gen)[:7]] = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
        rows.append(z)
        cfg.append((1.0, 5, 0.45, 0.0))
    return torch.stack(rows), cfg


def _open_routes(z, cfg, plain):
    """Per row, whether its plain draw x1 lies in the top-k set with the check's top-p test failed
    (float64), and whether the reference keeps it."""
    open_, kept = [], []
    for b, (t, k, p, m) in enumerate(cfg):
        y = z[b].double() / t
        x1 = int(plain[b])
        in_top_k = bool(reference_kept(z[b], t, k, 1.0, 0.0)[x1])
        e = torch.exp(y - y.max())
        open_.append(in_top_k and float(e[y > y[x1]].sum()) >= p * float(e[y >= y[x1]].sum()))
        kept.append(bool(reference_kept(z[b], t, k, p, m)[x1]))
    return open_, kept


@pytest.mark.parametrize("search", [dict(chunk=256), dict(chunk=256, split_passes=0), dict(chunk=512, split_passes=1)])
def test_precheck_decides_top_p_when_the_top_k_search_ends(device, search):
    """Top-k + top-p rows whose x1 passes top-k but not the check's sufficient top-p test: once the top-k
    search has Z_k, x1 is kept iff M(l_x1) < p · Z_k (decided there: no top-p search, no draw; its reads
    exceed the check's two), else the top-p search runs from lo = l_x1. Both happen, in each layout (the
    decision in the split reductions and in the per-row programs), with a tie group at the top-k cut and
    one at the top-p boundary; the ids are the search's without the precheck and in the reference's kept
    set."""
    gen = torch.Generator().manual_seed(31)
    V = 600  # chunks per row: 3 of 256, 2 of 512
    z, cfg = _open_top_p_rows(gen, V, 12)
    zd = z.to(device)
    seeds = torch.arange(len(cfg), dtype=torch.int64) * 7919 + 13
    ids, passes, decided = _plan_draw(zd, cfg, seeds, **search)
    old, _, _ = _plan_draw(zd, cfg, seeds, precheck=False, **search)
    assert ids.tolist() == old.tolist()
    plain = _plain_ids(zd, cfg, seeds)
    open_, kept = _open_routes(z, cfg, plain)
    after_top_k = {0: 0, 1: 0}  # rows decided when the top-k search ended, per shape
    narrowed = {0: 0, 1: 0}  # rows whose top-p search started from l_x1
    for b, c in enumerate(cfg):
        assert reference_kept(z[b], *c)[ids[b]], (b, c)
        if open_[b] and kept[b]:
            assert int(decided[b]) == int(plain[b]) == int(ids[b]) and int(passes[b]) > 2, (b, c)
            after_top_k[b % 2] += 1
        elif open_[b]:
            assert int(decided[b]) == -1, (b, c)
            narrowed[b % 2] += 1
        else:  # decided by the check (two reads) or searched from the precheck's bracket
            assert int(decided[b]) == -1 or int(passes[b]) <= 2, (b, c)
    assert min(after_top_k.values()) >= 2 and min(narrowed.values()) >= 2, (after_top_k, narrowed)
    # the ties: x1 in the 1.0s is kept whole with its group, in the 0.0s (kept by top-k) it is not
    for b in range(1, len(cfg), 2):
        if float(z[b, plain[b]]) == 1.0:
            assert int(decided[b]) == int(plain[b]), b
        if float(z[b, plain[b]]) == 0.0:
            assert int(decided[b]) == -1 and float(z[b, ids[b]]) >= 1.0, b


def test_precheck_decided_after_top_k_is_the_rows_own_whatever_the_batch(device):
    """Rows decided when their top-k search ends and rows searched from l_x1: the same ids, decisions and
    reads alone and permuted in a batch."""
    gen = torch.Generator().manual_seed(5)
    z, cfg = _open_top_p_rows(gen, 600, 6)
    seeds = torch.arange(len(cfg), dtype=torch.int64) * 104729 + 1
    ids, passes, decided = _plan_draw(z.to(device), cfg, seeds, chunk=256)
    plain = _plain_ids(z.to(device), cfg, seeds)
    open_, _ = _open_routes(z, cfg, plain)
    assert any(o and d >= 0 for o, d in zip(open_, decided.tolist())), (open_, decided)
    assert any(o and d < 0 for o, d in zip(open_, decided.tolist())), (open_, decided)
    perm = torch.randperm(len(cfg), generator=gen)
    again = _plan_draw(z[perm].to(device), [cfg[i] for i in perm], seeds[perm], chunk=256)
    assert [x.tolist() for x in again] == [ids[perm].tolist(), passes[perm].tolist(), decided[perm].tolist()]
    for b in range(4):
        alone = _plan_draw(z[b : b + 1].to(device), cfg[b : b + 1], seeds[b : b + 1], chunk=256)
        assert [int(x) for x in alone] == [int(ids[b]), int(passes[b]), int(decided[b])], b


# The radix select (`truncation_plan(radix=True)`, off by default until timed on the device): a top-k row's
# k-th value by two histogram passes over the logits' 16-bit buckets, its candidates gathered and sorted
# per row, top-p and min-p applied there and the id drawn from them. The ids must be the search's (with
# and without the precheck), the kept sets the float64 reference's.

RADIX_CONFIGS = [
    (0.7, 50, 1.0, 0.0),  # top-k alone
    (0.6, 50, 0.9, 0.0),  # top-k + top-p
    (1.0, 1, 1.0, 0.0),  # k = 1
    (0.9, 2, 1.0, 0.0),  # k = 2
    (0.8, 30, 1.0, 0.1),  # top-k + min-p
    (1.1, 20, 0.8, 0.05),  # all three
    (0.8, 0, 0.9, 0.0),  # top-p alone: the search's
    (1.0, 0, 1.0, 0.1),  # min-p alone: the search's
    (0.0, 10, 0.5, 0.1),  # greedy: filters ignored
    (1.0, 0, 1.0, 0.0),  # no filter
]


def _radix_plan(z, cfg, seeds, bitmask=None, precheck=False, radix=True, **layout):
    """`sample_top_k_top_p`'s composition: (ids, thr, passes, decided ids or None), on the CPU."""
    t, s, k, p, m = _with_seeds(cfg, seeds, z.device)
    thr, passes, decided = truncation_plan(z, t, s, k, p, m, bitmask, precheck=precheck, radix=radix, **layout)
    ids = sample_greedy_or_gumbel(z, t, s, bitmask=bitmask, thresholds=thr, decided=decided)
    return ids.cpu(), thr.cpu(), passes.cpu(), None if decided is None else decided.cpu()


def _check_radix(z, cfg, seeds, bitmask=None, allowed=None, cap=256, **layout):
    """The radix select's ids against the search's (precheck off and on) and its kept sets against the
    reference (every row's thr is its kept set with the precheck off); returns (passes, decided) of the
    radix select without the precheck, whose decided rows are the ones it drew."""
    ids, thr, passes, decided = _radix_plan(z, cfg, seeds, bitmask, cap=cap, **layout)
    search, _, _, _ = _radix_plan(z, cfg, seeds, bitmask, radix=False, **layout)
    both, _, _, _ = _radix_plan(z, cfg, seeds, bitmask, precheck=True, cap=cap, **layout)
    assert ids.tolist() == search.tolist() == both.tolist()
    inv_t = 1.0 / params(cfg, "cpu")[0]
    kept = z.cpu().float() * inv_t[:, None] > thr[:, None]
    for b, c in enumerate(cfg):
        if c[0] == 0.0:
            continue
        row = z[b].cpu().float()
        if allowed is not None:
            kept[b] &= allowed[b]
            row = row.masked_fill(~allowed[b], -math.inf)
        assert torch.equal(kept[b], reference_kept(row, *c)), (b, c, int(kept[b].sum()))
        assert reference_kept(row, *c)[ids[b]], (b, c)
        if int(decided[b]) >= 0:
            assert int(decided[b]) == int(ids[b]) and int(passes[b]) == 3, (b, c)
    return passes, decided


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_radix_ids_are_the_searchs_and_kept_sets_the_references(device, dtype):
    """Rows of assorted shapes (flat, peaked, wide, a fifth −inf) under every filter, mixed in one batch
    with top-p-only, min-p-only, greedy and plain rows, over three chunks: every top-k row is drawn by
    the radix select (three reads), the others are not, and the ids are the search's; a row with fewer
    finite tokens than k keeps them all before top-p."""
    gen = torch.Generator().manual_seed(41)
    V = 2500
    z, cfg = _mixed_rows(gen, V, 3 * len(RADIX_CONFIGS), RADIX_CONFIGS)
    few = torch.full((V,), -math.inf)
    few[torch.randperm(V, generator=gen)[:120]] = torch.randn(120, generator=gen) * 2
    z = torch.cat([z, few[None]]).to(dtype)
    cfg = [*cfg, (0.9, 200, 0.95, 0.0)]
    seeds = torch.arange(len(cfg), dtype=torch.int64) * 7919 + 5
    passes, decided = _check_radix(z.to(device), cfg, seeds, chunk=1024)
    for b, (t, k, _p, _m) in enumerate(cfg):
        radix = t > 0 and k > 0
        assert (int(decided[b]) >= 0) == radix, (b, cfg[b])
        if t == 0 or cfg[b][1:] == (0, 1.0, 0.0):
            assert int(passes[b]) == 0, (b, cfg[b])


def test_radix_draws_are_the_thresholded_draws_for_many_seeds(device):
    """A flat and a peaked row under top-k 50 + top-p 0.9 and under top-k 5, 16 seeds each: the id the radix
    select draws from its candidates is the thresholded draw's for every seed (the same noise and
    arithmetic, `best_thresholded`), and the draws spread over the kept set."""
    gen = torch.Generator().manual_seed(67)
    V, n = 2000, 16
    flat = torch.randn(V, generator=gen) * 2
    peaked = flat.clone()
    peaked[torch.randperm(V, generator=gen)[:6]] += torch.tensor([9.0, 8.0, 8.0, 6.0, 4.0, 3.0])
    configs = [(0.6, 50, 0.9, 0.0), (1.0, 5, 1.0, 0.0)]
    rows = [(z, c) for z in (flat, peaked) for c in configs for _ in range(n)]
    z = torch.stack([r[0] for r in rows]).to(torch.bfloat16)
    cfg = [r[1] for r in rows]
    seeds = torch.arange(len(cfg), dtype=torch.int64) * 104729 + 17
    ids, _, passes, decided = _radix_plan(z.to(device), cfg, seeds, chunk=1024)
    search, _, _, _ = _radix_plan(z.to(device), cfg, seeds, radix=False, chunk=1024)
    assert ids.tolist() == search.tolist() == decided.tolist() and (passes == 3).all()
    assert len(set(ids[:n].tolist())) >= 4 and len(set(ids[n : 2 * n].tolist())) >= 3


def _tied_rows(gen, V, dtype):
    """Rows whose k-th value (k = 50) lies in a tie group: 5 tokens at 3.0, 20 at 2.5 and n at 2.0 over a
    tail near −1, for n = 60 (85 candidates: the group kept whole), 400 (425: beyond the buffer) and ~V / 9
    (logits rounded to 9 distinct values)."""
    rows = []
    for n in (60, 400):
        z = torch.randn(V, generator=gen) * 0.5 - 1.0
        at = torch.randperm(V, generator=gen)
        z[at[:5]], z[at[5:25]], z[at[25 : 25 + n]] = 3.0, 2.5, 2.0
        rows.append(z)
    rows.append(torch.randint(-4, 5, (V,), generator=gen).float() * 0.5)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_radix_ties_at_the_kth_value(device, dtype):
    """A tie group at the k-th value is kept whole (top-k alone, with top-p, with min-p); when it holds more
    candidates than the buffer, a top-k + top-p row falls back to the search, and a top-k row alone is served
    by its bucket's value for bf16 logits (two reads, drawn by the draw), by the search for float32; a buffer
    of 16 makes the 85-token group overflow too. The ids are the search's, the kept sets the reference's."""
    gen = torch.Generator().manual_seed(43)
    V = 3000
    tied = _tied_rows(gen, V, dtype)
    configs = [(1.0, 50, 1.0, 0.0), (0.8, 50, 0.9, 0.0), (1.0, 50, 1.0, 0.5)]
    z = tied.repeat_interleave(len(configs), 0)
    cfg = configs * len(tied)
    seeds = torch.arange(len(cfg), dtype=torch.int64) * 31 + 3
    for cap in (256, 16):
        passes, decided = _check_radix(z.to(device), cfg, seeds, cap=cap, chunk=1024)
        for b, (_t, k, p, _m) in enumerate(cfg):
            fits = b < len(configs) and cap == 256  # the 85-token group
            assert (int(decided[b]) >= 0) == fits, (cap, b, cfg[b])
            if not fits and dtype == torch.bfloat16 and p == 1.0:
                assert int(passes[b]) == 2, (cap, b, cfg[b])  # R1, R2; the draw draws
            elif not fits and k <= cap:
                assert int(passes[b]) >= 3, (cap, b, cfg[b])  # R1, R2, the search (k > cap: the search alone)


def test_radix_with_a_bitmask_and_minus_inf(device):
    """A bitmask allowing a third of the tokens (and on some rows fewer allowed finite tokens than k), −inf
    logits, rows mixed with top-p-only and plain rows: the radix select counts, gathers and draws only
    what the bitmask allows; the ids are the search's, the kept sets the reference's over the allowed
    tokens."""
    gen = torch.Generator().manual_seed(47)
    V, B = 2000, 12
    z = torch.randn(B, V, generator=gen) * 2
    z[::3, :700] = -math.inf
    allowed = torch.rand(B, V, generator=gen) < 0.33
    allowed[4:6] = torch.rand(2, V, generator=gen) < 0.04  # ~80 allowed tokens, k = 100
    bitmask = torch.from_numpy(pack_bitmask(allowed.numpy())).to(device)
    configs = [(0.7, 50, 1.0, 0.0), (0.6, 50, 0.9, 0.0), (0.9, 0, 0.9, 0.0), (1.1, 100, 0.8, 0.05)]
    cfg = [configs[b % len(configs)] for b in range(B)]
    cfg[4], cfg[5] = (1.0, 100, 1.0, 0.0), (0.8, 100, 0.7, 0.0)
    seeds = torch.arange(B, dtype=torch.int64) * 13 + 1
    _, decided = _check_radix(z.to(device), cfg, seeds, bitmask=bitmask, allowed=allowed, chunk=512)
    assert [int(d) >= 0 for d in decided] == [c[1] > 0 for c in cfg], decided.tolist()


def test_radix_float32_values_tied_only_in_l(device):
    """float32 logits 1.9 + j · ulp (j < 64) at T = 1 / 1.1: z · (1 / T) crosses into the binade above, so
    neighbouring z's round to one l, and the k-th largest l (k = 30, 45) ties with values below the k-th
    largest z: the kept set is every l ≥ t_k in float32, as the search keeps, the ids are the search's."""
    gen = torch.Generator().manual_seed(53)
    V, B = 1500, 6
    z = torch.randn(B, V, generator=gen) - 3.0
    cluster = torch.full((64,), 1.9).view(torch.int32) + torch.arange(64, dtype=torch.int32)
    for b in range(B):
        z[b, torch.randperm(V, generator=gen)[:64]] = cluster.view(torch.float32)
    temperature = float(torch.tensor(1.0) / torch.tensor(1.1))
    cfg = [(temperature, 30, 1.0, 0.0), (temperature, 45, 0.9, 0.0), (temperature, 30, 1.0, 0.2)] * 2
    seeds = torch.arange(B, dtype=torch.int64) * 101 + 7
    zd = z.to(device)
    ids, thr, _, decided = _radix_plan(zd, cfg, seeds, chunk=512)
    search, thr_s, _, _ = _radix_plan(zd, cfg, seeds, radix=False, chunk=512)
    assert ids.tolist() == search.tolist() and (decided >= 0).all()
    sl = z * (1.0 / params(cfg, "cpu")[0])[:, None]  # float32, the kernels' l
    for b, (_t, k, _p, _m) in enumerate(cfg):
        kept, kept_s = sl[b] > thr[b], sl[b] > thr_s[b]
        assert torch.equal(kept, kept_s), b
        if cfg[b][2:] == (1.0, 0.0):
            t_k = sl[b].sort(descending=True).values[k - 1]
            assert torch.equal(kept, sl[b] >= t_k) and int(kept.sum()) > k, b  # ties in l beyond k


def test_radix_gather_beyond_the_buffer_by_ties_in_l_falls_back(device):
    """float32 logits: 10 tokens at 1.875 (a bucket's smallest float) and 300 one float below it (the bucket
    below), which z · (1 / T) at T = 1 / 1.1 rounds to the same l: R2 counts 10 candidates for k = 5, the
    gather finds 310 (every l ≥ t_e), more than the buffer, so the row goes to the search, which keeps the
    310 as top-k's tie group; the ids are the search's."""
    gen = torch.Generator().manual_seed(61)
    V, B = 1500, 3
    z = torch.randn(B, V, generator=gen) - 3.0
    f = torch.tensor(1.875)
    below = (f.view(torch.int32) - 1).view(torch.float32)
    for b in range(B):
        at = torch.randperm(V, generator=gen)
        z[b, at[:10]], z[b, at[10:310]] = f, below
    temperature = float(torch.tensor(1.0) / torch.tensor(1.1))
    cfg = [(temperature, 5, 1.0, 0.0), (temperature, 5, 0.9, 0.0), (temperature, 5, 1.0, 0.3)]
    seeds = torch.arange(B, dtype=torch.int64) * 11 + 3
    zd = z.to(device)
    ids, thr, passes, decided = _radix_plan(zd, cfg, seeds, chunk=512)
    search, thr_s, _, _ = _radix_plan(zd, cfg, seeds, radix=False, chunk=512)
    assert ids.tolist() == search.tolist() and (decided < 0).all() and (passes >= 4).all(), passes.tolist()
    sl = z * (1.0 / params(cfg, "cpu")[0])[:, None]
    assert torch.equal(sl > thr[:, None], sl > thr_s[:, None])
    assert int((sl[0] > thr[0]).sum()) == 310


def test_radix_ids_are_the_rows_own_whatever_the_batch(device):
    """Drawn by the radix select, by its bucket or by the search: the same id alone, and permuted in a
    batch with other rows, and the same draws with the radix select off."""
    gen = torch.Generator().manual_seed(59)
    V = 1500
    z, cfg = _mixed_rows(gen, V, 10, RADIX_CONFIGS)
    z = z.to(torch.bfloat16)
    z[9, :] = 0.0  # k = 1000 over one tie group: served by its bucket
    cfg[9] = (0.9, 1000, 1.0, 0.0)
    seeds = torch.arange(10, dtype=torch.int64) * 17 + 2
    t, s, k, p, m = _with_seeds(cfg, seeds, device)
    ids = sample_top_k_top_p(z.to(device), t, s, k, p, m, radix=True).cpu()
    assert ids.tolist() == sample_top_k_top_p(z.to(device), t, s, k, p, m, radix=False).cpu().tolist()
    perm = torch.tensor([7, 2, 9, 0, 5, 1, 8, 3, 6, 4])
    again = sample_top_k_top_p(
        z[perm].to(device), *_with_seeds([cfg[i] for i in perm], seeds[perm], device), splits=2, radix=True
    )
    assert again.cpu().tolist() == ids[perm].tolist()
    for b in (0, 1, 4, 9):
        alone = sample_top_k_top_p(
            z[b : b + 1].to(device), *_with_seeds(cfg[b : b + 1], seeds[b : b + 1], device), radix=True
        )
        assert int(alone) == int(ids[b]), b


def test_radix_cap_must_be_a_power_of_two():
    z, t, s = torch.zeros(1, 256), torch.ones(1), torch.zeros(1, dtype=torch.int64)
    k, p, m = torch.full((1,), 5, dtype=torch.int32), torch.ones(1), torch.zeros(1)
    with pytest.raises(ValueError, match="cap"):
        truncation_plan(z, t, s, k, p, m, cap=100)
