"""A constrained batch-1 decode step keeps the pruned LM head (engine/cuda_graphs.py `replay_io_hidden`,
kernels/lm_head_bounds.py with a bitmask): the forward's graph, the bitmask filled while it runs, then
the pruned head under it (its own graph, reading the mask from a static buffer). On the CPU the
"graphs" run eagerly (a CPU has no CUDA graphs) with the Triton interpreter; the tokens equal the eager
engine's, whose constrained rows sample from the full logits under the same bitmask, and every output
matches its constraint."""

from __future__ import annotations

import os
import re

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.engine.cuda_graphs import DecodeGraphs
from tinyvllm.engine.paths.lm_head import LMHead
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")

PATTERN = r"(ab|c)[0-9]{1,3}-(x|yz)"


class _EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose "replay" runs the captured function eagerly; records each replay's head. Every
    bucket counts as captured from the start (as with graph_capture="eager"), so every step replays."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heads: list[str] = []
        self.captured = set(self.batch_sizes)

    def _replay(self, key):
        self.heads.append(key[3])
        self._outputs[key] = self._run(*key)  # the "masked" head reads the "hidden" one's output
        return self._outputs[key]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_pruned")
    write_dummy_checkpoint(path, make_config("tiny"), seed=3, init_std=0.1, dtype="float32")
    return path


def _llm(model_dir, graphs: bool) -> tuple[LLM, _EagerGraphs | None]:
    llm = LLM(
        model=str(model_dir), device="cpu", max_model_len=64, kernel_backend="triton", max_num_seqs=2, block_size=4
    )
    runner = llm.llm_engine.runner
    if not graphs:
        return llm, None
    lm_head = runner.executor.lm_head
    runner.executor.lm_head = LMHead(lm_head.weight, lm_head.ops, lm_head.fused_max_rows, pruned=True)
    runner.graphs = _EagerGraphs(
        runner.executor,
        runner.kv_caches,
        batch_sizes=[1, 2],
        max_blocks_per_seq=runner.builder.tables.max_blocks_per_seq,
        max_seq_len=64,
        device=runner.device,
        resolve_placeholders=runner.ops.resolve_placeholders,
        max_num_seqs=2,
        sample_in_graph=True,
        io_max_rows=1,
        pruned_lm_head=True,
    )
    assert runner.graphs.pruned_lm_head
    return llm, runner.graphs


def test_constrained_batch_one_steps_sample_through_the_pruned_head(model_dir):
    params = [
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=SO(regex=PATTERN)),
        SamplingParams(temperature=1.3, seed=7, max_tokens=12, structured_outputs=SO(regex=PATTERN)),
        SamplingParams(temperature=0.9, seed=4, max_tokens=3, ignore_eos=True),
    ]
    results = {}
    for graphs in (False, True):
        llm, fake = _llm(model_dir, graphs)
        results[graphs] = []
        for prompt, sp in zip(["a", "b", "c"], params):
            out = llm.generate([prompt], [sp], use_tqdm=False)[0].outputs[0]
            results[graphs].append(out.token_ids)
            if sp.structured_outputs is not None:
                assert out.finish_reason == "stop" and re.fullmatch(PATTERN, out.text), out
            if fake is not None:
                want = {"hidden", "masked"} if sp.structured_outputs is not None else {"pruned"}
                assert fake.heads and set(fake.heads) == want, fake.heads
                fake.heads.clear()
    assert results[True] == results[False]
