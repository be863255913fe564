"""Weights to the GPU through the loader's threads (models/loader.py `read_tensors`): every tensor of a
real sharded checkpoint arrives on CUDA bit for bit what safetensors reads, from 8 threads, by both of its
paths (positional reads through pinned staging, and safetensors' memory map)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.models.loader import ReadStats, read_tensors, safetensors_files

pytestmark = pytest.mark.gpu


def test_read_tensors_to_cuda_is_bitwise(tmp_path):
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=5, dtype="bfloat16", max_shard_bytes=60_000)
    files = safetensors_files(tmp_path)
    want = {name: t for path in files for name, t in load_file(str(path)).items()}
    got = list(read_tensors(files, torch.device("cuda"), num_threads=8))
    assert len(got) == len(want)
    for name, _, tensor in got:
        assert tensor.is_cuda and torch.equal(tensor.cpu(), want[name]), name


def test_direct_chunked_reads_to_cuda_are_bitwise(tmp_path):
    """Positional reads through each thread's pinned staging and stream, in chunks that split tensors
    (and elements) across threads: bit for bit safetensors' tensors; the read-through path agrees."""
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=6, dtype="bfloat16", max_shard_bytes=60_000)
    files = safetensors_files(tmp_path)
    want = {name: t for path in files for name, t in load_file(str(path)).items()}
    stats = ReadStats()
    got = list(read_tensors(files, torch.device("cuda"), num_threads=8, direct=True, chunk_bytes=999, stats=stats))
    mapped = list(read_tensors(files, torch.device("cuda"), num_threads=8, direct=False))
    assert [n for n, _, _ in got] == [n for n, _, _ in mapped] and len(got) == len(want)
    assert stats.bytes == sum(t.nbytes for t in want.values())
    for (name, _, tensor), (_, _, other) in zip(got, mapped):
        assert tensor.is_cuda and torch.equal(tensor.cpu(), want[name]) and torch.equal(tensor, other), name
