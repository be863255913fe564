"""Top-k / top-p / min-p sampling on the device without a sort: a per-row threshold, then the fused draw.

Row b samples from softmax(l) restricted to a kept set K_b, where l_i = z_i · (1 / T_b) (the fused
kernel's arithmetic, kernels/sampling.py) and, as in the full sampler (sampling/sampler.py), with
C(x) = #{j : l_j > x} and M(x) = Σ_{l_j > x} exp(l_j − max l):

* top-k keeps l_i ≥ t_k, the k-th largest value (every token tied with it is kept): the tokens with
  C(l_i) < k;
* top-p, after top-k, keeps the smallest set of largest values whose mass reaches p (ties with the
  smallest kept value are kept): the top-k tokens with M(l_i) < p · Z_k, Z_k = M over the top-k set;
  equivalently, the sorted-ascending cumulative mass of the tokens up to l_i exceeds (1 − p) · Z_k,
  which is the full sampler's rule (drop the ascending prefix whose mass is ≤ 1 − p, never the top);
* min-p keeps l_i ≥ max l + log(min_p).

Each rule keeps {l_i ≥ t*} for the smallest value t* it accepts: C and M only change at the row's own
values, so the accepted values form an upper set. The kept set is written as one strict threshold
per row, K = {i : l_i > thr}, with thr any value in [the largest value below t*, t*).

The modules, in the order a call runs them:

- draw.py: `sample_top_k_top_p`: each row's threshold, then the fused Gumbel-max draw over its kept set;
- plan.py: the launches (`truncation_plan`, `truncation_thresholds`) and their defaults, `RADIX` among
  them (read there at each call: set `plan.RADIX`, not an attribute of this package);
- radix.py: the radix select, which serves the top-k rows first;
- search.py: finding thr for the other rows: the threshold search's kernels (the statistics, the precheck
  of the plain draw, the split search passes and their per-row reductions, the per-row finish) and a
  row's search state;
- chunks.py: what one program computes over a chunk of a row (the statistics; C and M at a search
  pass's candidates), and what the search costs;
- placement.py: where a search pass's candidates go, and the bound on a search's passes;
- bracket.py: how a pass's counts and masses move the bracket (lo, hi] and the search's phase;
- row.py: what all of them read of a row the same way (the floats' order keys, l = z · (1 / T), a row's
  parameters, min-p's threshold).

A helper one module shares with another is public where it is defined and imported under its private
name where kernels call it (`from ...row import key as _key`), so that the kernels read as one module did.
"""

from tinyvllm.kernels.top_p_sampling.draw import sample_top_k_top_p
from tinyvllm.kernels.top_p_sampling.plan import (
    SEARCH_LAYOUTS,
    truncation_plan,
    truncation_thresholds,
)
from tinyvllm.kernels.top_p_sampling.radix import (
    radix_finish_kernel,
    radix_gather_kernel,
    radix_hist_kernel,
    radix_select,
    radix_select_kernel,
)
from tinyvllm.kernels.top_p_sampling.search import (
    threshold_begin_kernel,
    threshold_check_kernel,
    threshold_check_reduce_kernel,
    threshold_finish_kernel,
    threshold_pass_kernel,
    threshold_reduce_kernel,
    threshold_stats_kernel,
)

__all__ = [
    "SEARCH_LAYOUTS",
    "radix_finish_kernel",
    "radix_gather_kernel",
    "radix_hist_kernel",
    "radix_select",
    "radix_select_kernel",
    "sample_top_k_top_p",
    "threshold_begin_kernel",
    "threshold_check_kernel",
    "threshold_check_reduce_kernel",
    "threshold_finish_kernel",
    "threshold_pass_kernel",
    "threshold_reduce_kernel",
    "threshold_stats_kernel",
    "truncation_plan",
    "truncation_thresholds",
]
