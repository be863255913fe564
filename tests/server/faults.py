"""Engines that fail on purpose, built by a picklable factory (it runs in the engine process too)."""

from __future__ import annotations

from typing import Any


def failing_engine(args: Any, after_steps: int = 5) -> Any:
    """An LLMEngine whose step() and core_step() raise RuntimeError("injected device failure") after
    `after_steps` steps (of both together)."""
    from tinyvllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    calls = 0

    def failing(real_step: Any) -> Any:
        def step(*args: Any) -> Any:  # core_step's `early`, when given
            nonlocal calls
            calls += 1
            if calls > after_steps:
                raise RuntimeError("injected device failure")
            return real_step(*args)

        return step

    engine.step = failing(engine.step)
    engine.core_step = failing(engine.core_step)
    return engine


def unbuildable_engine(args: Any) -> Any:
    raise ValueError("no such checkpoint (injected)")


def hanging_engine(args: Any, after_steps: int = 5) -> Any:
    """An LLMEngine whose core_step() never returns after `after_steps` steps (a core stuck in a
    collective or on a device that stopped answering: alive, silent)."""
    import time

    from tinyvllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    real_step = engine.core_step
    calls = 0

    def core_step(*args: Any) -> Any:  # its `early`, when given
        nonlocal calls
        calls += 1
        if calls > after_steps:
            time.sleep(3600)
        return real_step(*args)

    engine.core_step = core_step
    return engine
