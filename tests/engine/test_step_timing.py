"""The engine's step timing: one record per step with the batch it launched; the summary's arithmetic."""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.step_timing import StepRecord, summarize
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint


def test_summary_by_step_kind_hand_computed():
    log = [
        StepRecord(300, 2, 0.001, 0.002, 0.003, 0.0),  # prefill tokens: host 6 ms, no wait
        StepRecord(4, 4, 0.001, 0.001, 0.001, 0.002),  # decode: host 3 ms, wait 2 ms
        StepRecord(4, 4, 0.001, 0.001, 0.002, 0.0),  # decode: host 4 ms, host-bound
        StepRecord(0, 0, 0.0, 0.0, 0.001, 0.001),
    ]  # launched nothing
    s = summarize(log)
    assert s["prefill"]["steps"] == 1 and s["prefill"]["mean_ms"]["host"] == pytest.approx(6.0)
    d = s["decode"]
    assert d["steps"] == 2 and d["mean_batch"] == 4
    assert d["mean_ms"]["host"] == pytest.approx(3.5) and d["mean_ms"]["wait"] == pytest.approx(1.0)
    assert d["total_s"]["wall"] == pytest.approx(0.009) and d["host_bound_fraction"] == 0.5
    assert s["idle"]["steps"] == 1


def test_engine_records_every_launched_batch(tmp_path):
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=3, dtype="float32")
    llm = LLM(model=str(tmp_path), device="cpu", max_model_len=128, max_num_batched_tokens=32)
    timer = llm.llm_engine.step_timer
    timer.reset(keep_log=True)
    prompts = [{"prompt_token_ids": list(range(1, 41))}, {"prompt_token_ids": list(range(5, 15))}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    launched = [r for r in timer.log if r.num_seqs]
    # 50 prompt tokens in chunks of at most 32, then decodes; 12 sampled tokens in all.
    assert sum(r.num_tokens for r in launched) == 50 + 2 * 6 - 2
    assert all(r.num_tokens <= 32 for r in launched)
    assert all(r.schedule_s >= 0 and r.launch_s > 0 and r.process_s >= 0 and r.wait_s >= 0 for r in timer.log)
    timer.reset(keep_log=False)
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert timer.log == []
