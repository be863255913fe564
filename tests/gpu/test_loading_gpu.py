"""Weights to the GPU through the loader's threads (models/loader.py `read_tensors`): every tensor of a
real sharded checkpoint arrives on CUDA bit for bit what safetensors reads, from 8 threads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.models.loader import read_tensors, safetensors_files

pytestmark = pytest.mark.gpu


def test_read_tensors_to_cuda_is_bitwise(tmp_path):
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=5, dtype="bfloat16", max_shard_bytes=60_000)
    files = safetensors_files(tmp_path)
    want = {name: t for path in files for name, t in load_file(str(path)).items()}
    got = list(read_tensors(files, torch.device("cuda"), num_threads=8))
    assert len(got) == len(want)
    for name, _, tensor in got:
        assert tensor.is_cuda and torch.equal(tensor.cpu(), want[name]), name
