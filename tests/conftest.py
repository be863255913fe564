"""Test-wide set-up: without a GPU, Triton kernels run in the interpreter; `gpu` tests are skipped."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers share few cores: OpenMP threads spinning against each other cost more than they give.
    torch.set_num_threads(1)
if not HAS_CUDA:
    # Must be set before any @triton.jit function is defined, i.e. before kernel modules are imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
