"""Weights to the GPU through the loader's pinned staging (models/staging.py, models/loader.py): every
tensor of a real sharded checkpoint arrives on CUDA bit for bit what safetensors reads, from 8 threads
with chunks smaller than most tensors; and `PinnedStaging` alone, for sizes around its chunk."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.models.loader import read_tensors, safetensors_files
from tinyvllm.models.staging import PinnedStaging

pytestmark = pytest.mark.gpu


def test_read_tensors_to_cuda_is_bitwise(tmp_path):
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=5, dtype="bfloat16", max_shard_bytes=60_000)
    files = safetensors_files(tmp_path)
    want = {name: t for path in files for name, t in load_file(str(path)).items()}
    got = list(read_tensors(files, torch.device("cuda"), num_threads=8))
    assert len(got) == len(want)
    for name, _, tensor in got:
        assert tensor.is_cuda and torch.equal(tensor.cpu(), want[name]), name


def test_pinned_staging_chunks_around_the_buffer_size():
    chunk = 1 << 20
    staging = PinnedStaging(torch.device("cuda"), chunk_bytes=chunk)
    g = torch.Generator().manual_seed(1)
    sizes = [1, chunk // 4 - 1, chunk // 4, chunk // 4 + 1, 3 * chunk // 4 + 5, 5 * chunk]  # float32 elements
    tensors = [torch.randn(n, generator=g) for n in sizes] * 4
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(staging.to_device, tensors))
    for src, out in zip(tensors, got):
        assert out.is_cuda and torch.equal(out.cpu(), src)
