"""Engines that fail on purpose, built by a picklable factory (it runs in the engine process too)."""
from __future__ import annotations

from typing import Any


def failing_engine(args: Any, after_steps: int = 5) -> Any:
    """An LLMEngine whose step() raises RuntimeError("injected device failure") after `after_steps` steps."""
    from tinyvllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    real_step = engine.step
    calls = 0

    def step():
        nonlocal calls
        calls += 1
        if calls > after_steps:
            raise RuntimeError("injected device failure")
        return real_step()

    engine.step = step
    return engine


def unbuildable_engine(args: Any) -> Any:
    raise ValueError("no such checkpoint (injected)")
