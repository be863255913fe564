"""Issue #34 on CUDA at the `llama-3.2-1b` shape in bf16: run-to-run identity by default, batch invariance
with `batch_invariant=True` (fingerprints: tokens, cumulative logprob and every returned logprob, ==).

  * default settings (megakernel, fused paths, CUDA graphs; prefix caching off, as the issue measures): the
    same 8 prompts, one at a time, 96 tokens each, greedy and seeded, through two fresh engines, and once
    more through the second after other traffic;
  * `batch_invariant=True` (prefix caching and chunked prefill on): the 8 prompts alone vs inside a
    256-request batch.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tinyvllm import LLM
from tinyvllm.bench import determinism as det
from tinyvllm.models.checkpoint import resolve_model

pytestmark = pytest.mark.gpu

NUM_PROMPTS, MAX_TOKENS = 8, 96


@pytest.fixture(scope="module")
def ckpt():
    return resolve_model("dummy:llama-3.2-1b")


def engine(ckpt, **kw) -> LLM:
    return LLM(model=str(ckpt), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=8 << 30, **kw)


def _free(llm: LLM) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_default_engine_is_reproducible_run_to_run(ckpt, kind):
    first = engine(ckpt, enable_prefix_caching=False)
    ps = det.prompts(NUM_PROMPTS, first.llm_engine.model_config.vocab_size)
    a = det.run_alone(first, ps, kind, MAX_TOKENS)
    _free(first)
    second = engine(ckpt, enable_prefix_caching=False)
    b = det.run_alone(second, ps, kind, MAX_TOKENS)
    det.other_traffic(second, 64, 32)
    c = det.run_alone(second, ps, kind, MAX_TOKENS)
    _free(second)
    assert det.compare(a, b).identical == NUM_PROMPTS, det.compare(a, b)
    assert det.compare(a, c).identical == NUM_PROMPTS, det.compare(a, c)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_batch_invariant_alone_equals_in_a_256_request_batch(ckpt, kind):
    llm = engine(ckpt, batch_invariant=True)
    ps = det.prompts(NUM_PROMPTS, llm.llm_engine.model_config.vocab_size)
    alone = det.run_alone(llm, ps, kind, MAX_TOKENS)
    batched = det.run_in_batch(llm, ps, kind, MAX_TOKENS, batch_size=256)
    _free(llm)
    result = det.compare(alone, batched)
    assert result.identical == NUM_PROMPTS, result
