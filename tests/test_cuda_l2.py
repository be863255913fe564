"""benchmarks/kernels/cuda_l2.py: the access-policy window over a weight's last rows (hand-computed cases),
and the driver helpers' answers without a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

MODULE = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "cuda_l2.py"


@pytest.fixture(scope="module")
def cuda_l2():
    spec = importlib.util.spec_from_file_location("cuda_l2", MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuda_l2"] = module
    spec.loader.exec_module(module)
    return module


def test_window_covers_the_last_whole_rows_that_fit(cuda_l2):
    w = torch.zeros(100, 64, dtype=torch.bfloat16)  # 128 B rows
    window = cuda_l2.lm_head_window(w, persisting_bytes=10 * 128 + 5, max_window_bytes=1 << 30)
    assert window == (w.data_ptr() + 90 * 128, 10 * 128, 1.0)
    # the shorter of the set-aside and the longest window decides
    assert cuda_l2.lm_head_window(w, 1 << 30, max_window_bytes=3 * 128 + 127).num_bytes == 3 * 128
    assert cuda_l2.lm_head_window(w, 1 << 30, 1 << 30) == (w.data_ptr(), 100 * 128, 1.0)


def test_window_needs_a_row_and_a_contiguous_matrix(cuda_l2):
    w = torch.zeros(100, 64, dtype=torch.bfloat16)
    assert cuda_l2.lm_head_window(w, 127, 1 << 30) is None
    with pytest.raises(ValueError):
        cuda_l2.lm_head_window(w.t(), 1 << 20, 1 << 30)


def test_no_limits_off_the_gpu(cuda_l2):
    assert cuda_l2.l2_limits(torch.device("cpu")) is None
