"""Constrained requests through both engine clients (the core on a thread, and in a process of its own):
the API side rejects an invalid or unsatisfiable constraint before queueing it (RequestRejected, 400),
and a valid one's output validates, beside unconstrained requests."""

from __future__ import annotations

import asyncio
import json

import pytest

from tinyvllm import SamplingParams
from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.async_llm import AsyncLLMEngine, RequestRejected
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.mp_client import MPAsyncLLMEngine
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
    "required": ["ok", "n"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_dummy_checkpoint(path, make_config("tiny"), seed=5, init_std=0.1, dtype="float32")
    return path


@pytest.mark.parametrize("mode", ["thread", "process", "process-async"])
def test_engine_clients_validate_and_constrain(model_dir, mode):
    """process-async: the engine process with async scheduling, whose constrained steps send the in-flight
    step's outputs from inside their launch (`core_step`'s `early`)."""
    args = EngineArgs(
        model=str(model_dir), device="cpu", max_model_len=256, max_num_seqs=4, async_scheduling=mode == "process-async"
    )
    engine = AsyncLLMEngine(LLMEngine(args)).start() if mode == "thread" else MPAsyncLLMEngine(args).start(timeout=120)
    so = SO(json=SCHEMA, disable_any_whitespace=True)

    async def main():
        with pytest.raises(RequestRejected) as e:
            await engine.add_request("bad", "x", SamplingParams(structured_outputs=SO(regex="(")))
        assert e.value.status == 400 and e.value.param == "structured_outputs" and "regex" in str(e.value)
        with pytest.raises(RequestRejected, match="minimum greater than maximum"):
            await engine.add_request(
                "bad2", "x", SamplingParams(structured_outputs=SO(json={"type": "integer", "minimum": 2, "maximum": 1}))
            )

        async def run(rid, params):
            return [o async for o in engine.generate(rid, "hello", params)][-1].outputs[0]

        constrained = SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured_outputs=so)
        plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        return await asyncio.gather(
            run("c", constrained), run("p", plain), run("c2", constrained.replace(temperature=0))
        )

    try:
        c, p, c2 = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(p.token_ids) == 10
    for out in (c, c2):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
