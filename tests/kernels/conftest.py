"""Fixtures for the kernel tests: the device they run on, and NaN-poisoned allocations."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    """CUDA when present; else the CPU under TRITON_INTERPRET=1; else the test is skipped."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Every `torch.empty` made during a kernel test is filled with NaN (floating dtypes), so an
    output element a kernel forgets to write shows up as NaN instead of as stale memory."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
