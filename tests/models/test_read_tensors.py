"""`read_tensors` (models/loader.py): a sharded checkpoint read on a thread pool gives every tensor of every
file, in file and key order, bit for bit what safetensors' own `load_file` reads."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.models.loader import read_tensors, safetensors_files


@pytest.mark.parametrize("num_threads", [1, 3])
def test_read_tensors_matches_safetensors(tmp_path, num_threads):
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=2, dtype="float32", max_shard_bytes=60_000)
    files = safetensors_files(tmp_path)
    assert len(files) > 2  # sharded: several files, each with several tensors
    order = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            order += [(name, path) for name in list(f.keys())]  # safe_open cannot be iterated
    want = {name: t for path in files for name, t in load_file(str(path)).items()}
    got = list(read_tensors(files, torch.device("cpu"), num_threads=num_threads))
    assert [(name, path) for name, path, _ in got] == order
    for name, _, tensor in got:
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
