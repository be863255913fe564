"""The garbage collector paused around start-up work that only builds long-lived objects.

Importing torch and tinyvllm, and building an engine (the model, its weights, the kernel tables, the
block pool) create objects that live as long as the process: the collector's automatic passes during
that work free nothing, while each full pass walks the whole growing heap (measured on the development
CPU: ~0.17 s of `from tinyvllm import LLM`'s ~1.2 s). The engine ends its start-up with one full
collection and `gc.freeze()` (engine/llm_engine.py); the first import of an exported name ends with a
freeze (tinyvllm/__init__.py).

No torch import here: `tinyvllm/__init__.py` uses it before anything heavy is loaded.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """Automatic collection off inside the block; on leaving it, the collector is as it was before
    (a collector the caller had disabled stays disabled; nested blocks keep it off until the outer one
    ends). Explicit `gc.collect()` calls still run.

    freeze: on leaving, move every tracked object to the collector's permanent generation
        (`gc.freeze()`, no collection): else the objects made inside the block sit in the youngest
        generation, and the next automatic pass walks them all (~0.07 s after importing torch)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()
