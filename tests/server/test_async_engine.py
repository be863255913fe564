"""AsyncLLMEngine without HTTP: one bad request fails alone, aborts free blocks, shutdown fails what is left."""
from __future__ import annotations

import asyncio

import pytest

from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, RequestRejected
from tinyvllm.sampling_params import SamplingParams

from .conftest import ENGINE_DEFAULTS


@pytest.fixture
def engine(model_dir):
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(model_dir), **ENGINE_DEFAULTS))).start()
    yield eng
    eng.shutdown()


def test_a_bad_request_fails_only_its_caller(engine):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def good(i: int) -> int:
        outs = [o async for o in engine.generate(f"g{i}", f"prompt {i}", params)]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        return len(outs[-1].outputs[0].token_ids)

    async def bad() -> str:
        with pytest.raises(RequestRejected) as e:
            await engine.add_request("bad", [1, 2, 10 ** 6], params)
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
            if engine.stats["num_free_kv_blocks"] == engine.stats["num_kv_blocks"] and \
                    engine.stats["num_requests_running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_shutdown_fails_in_flight_and_later_requests(engine):
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
    assert engine.is_dead
