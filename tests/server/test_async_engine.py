"""Both engine clients without HTTP (the engine on a thread, and in a process of its own): one bad
request fails alone, aborts free blocks, a slow reader gets merged deltas, shutdown fails what is left
and leaves no process behind."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.helpers import assert_equal_up_to_rounding
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.async_llm import AsyncLLMEngine, EngineDeadError, RequestRejected
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.mp_client import EngineStartError, MPAsyncLLMEngine
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

from .conftest import ENGINE_DEFAULTS
from .faults import unbuildable_engine


def _start(mode: str, model_dir):
    args = EngineArgs(model=str(model_dir), **ENGINE_DEFAULTS)
    if mode == "thread":
        return AsyncLLMEngine(LLMEngine(args)).start()
    return MPAsyncLLMEngine(args).start(timeout=120)


@pytest.fixture(scope="module", params=["process", "thread"])
def engine(model_dir, request):
    eng = _start(request.param, model_dir)
    yield eng
    eng.shutdown()


def test_a_bad_request_fails_only_its_caller(engine):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def good(i: int) -> int:
        outs = [o async for o in engine.generate(f"g{i}", f"prompt {i}", params)]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert outs[-1].prompt_token_ids == engine.info.tokenizer.encode(f"prompt {i}")  # reported by the core
        return len(outs[-1].outputs[0].token_ids)  # cumulative: the stream accumulates the deltas

    async def bad() -> str:
        with pytest.raises(RequestRejected) as e:
            await engine.add_request("bad", [1, 2, 10**6], params)
        return str(e.value)

    async def main():
        return await asyncio.gather(good(0), bad(), good(1), good(2))

    results = asyncio.run(main())
    assert results[0] == results[2] == results[3] == 5 and "vocabulary" in results[1]
    assert not engine.is_dead


def test_abort_and_early_exit_free_the_blocks(engine):
    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True)

    async def main():
        stream = await engine.add_request("a", "hello", params)
        async for _ in stream:
            break
        stream.abort()
        async for _ in engine.generate("b", "hello", params):
            break  # leaving the generator aborts too
        for _ in range(200):
            if (
                engine.stats["num_free_kv_blocks"] == engine.stats["num_kv_blocks"]
                and engine.stats["num_requests_running"] == 0
            ):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_a_slow_reader_gets_merged_deltas(engine):
    """DELTA streams: a reader that falls behind gets fewer outputs, which together hold what a
    CUMULATIVE stream of the same (seeded) request ends with: the same tokens and text, and its
    logprobs up to rounding (the two runs are separate computations, see tests/helpers.py)."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, logprobs=2)

    async def main():
        whole = [o async for o in engine.generate("whole", "hello", params)][-1]
        deltas = []
        async for out in engine.generate("slow", "hello", params.replace(output_kind=RequestOutputKind.DELTA)):
            deltas.append(out)
            await asyncio.sleep(0.05)  # several steps pile up meanwhile
        return whole, deltas

    whole, deltas = asyncio.run(main())
    (w,) = whole.outputs
    assert len(w.token_ids) == 40 and len(deltas) < 40 and deltas[-1].finished
    assert "".join(d.outputs[0].text for d in deltas) == w.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == w.token_ids
    assert_equal_up_to_rounding([e for d in deltas for e in d.outputs[0].logprobs], w.logprobs)
    assert deltas[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_shutdown_fails_in_flight_and_later_requests(model_dir, mode):
    engine = _start(mode, model_dir)
    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True)

    async def main():
        stream = await engine.add_request("a", "hello", params)
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "hello", params)

    asyncio.run(main())
    assert engine.is_dead and not engine.is_running
    if mode == "process":
        with pytest.raises(ProcessLookupError):
            os.kill(engine.pid, 0)  # gone, and reaped


def test_an_engine_that_cannot_be_built_fails_start(model_dir):
    engine = MPAsyncLLMEngine(EngineArgs(model=str(model_dir)), engine_factory=unbuildable_engine)
    with pytest.raises(EngineStartError, match="no such checkpoint"):
        engine.start(timeout=60)
    assert not engine.is_running
