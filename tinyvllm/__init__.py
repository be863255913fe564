"""tinyvllm: a small, fast, readable LLM inference engine for Llama 3.x.

    from tinyvllm import LLM, SamplingParams
    llm = LLM(model="path/to/hf/checkpoint")
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)

The names are imported lazily, so that `tinyvllm.core` (the scheduler and the block manager) loads
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "tinyvllm.llm",
    "SamplingParams": "tinyvllm.sampling_params",
    "StructuredOutputsParams": "tinyvllm.sampling_params",
    "RequestOutput": "tinyvllm.outputs",
    "CompletionOutput": "tinyvllm.outputs",
    "Logprob": "tinyvllm.outputs",
}

if TYPE_CHECKING:
    from tinyvllm.llm import LLM
    from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput
    from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        from tinyvllm.gc_pause import gc_paused

        with gc_paused(freeze=True):  # the first such import loads torch: long-lived objects only
            module = importlib.import_module(_EXPORTS[name])
        return getattr(module, name)
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
