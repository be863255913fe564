"""Two "machines" on loopback: the engine launched with nnodes=2, node_rank=0 and the headless launcher
with node_rank=1, one rank each, meet at master_addr:master_port (torchrun's flags) and generate the
same greedy tokens as one rank; when the engine shuts down the other machine's launcher exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

from tinyvllm import LLM, SamplingParams
from tinyvllm.distributed.group import free_port
from tinyvllm.models.checkpoint import write_dummy_checkpoint
from tinyvllm.models.presets import make_config


def test_two_machines_on_loopback(tmp_path):
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=5, init_std=0.1, dtype="float32")
    port = free_port()
    flags = ["--model", str(tmp_path), "--device", "cpu", "-tp", "2", "--nnodes", "2", "--master-port", str(port)]
    # Both "machines" share this one's cores: one thread for the other's rank, so the ranks do not spin
    # against each other's thread pools.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    other = subprocess.Popen(
        [sys.executable, "-m", "tinyvllm.distributed.headless", *flags, "--node-rank", "1"], env=env
    )
    try:
        prompts = [{"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}, {"prompt_token_ids": [2, 7, 1, 8]}]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        llm = LLM(
            model=str(tmp_path),
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
        )
        assert llm.llm_engine.runner.workers == {}, "machine 0 hosts rank 0 only"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.shutdown()
        assert other.wait(timeout=60) == 0
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    one = LLM(model=str(tmp_path), device="cpu", dtype="float32")
    assert got == [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
