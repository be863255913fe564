"""Weights to the GPU through the loader's threads (models/loader.py `read_tensors`): every tensor of a
real sharded checkpoint arrives on CUDA bit for bit what safetensors reads, from 8 threads, by both of its
paths (positional reads through pinned staging, and safetensors' memory map)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tinyvllm.config import ModelConfig
from tinyvllm.engine.startup_timing import StartupTimer
from tinyvllm.kernels import get_ops
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.models.loader import ReadStats, build_model, read_tensors, safetensors_files

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


def test_model_loaded_on_cuda_equals_the_cpu_load(tmp_path):
    """The whole load (direct reads, then placement into the fused QKV and gate/up rows, with temporaries
    freed and reallocated while copies are in flight): every parameter on CUDA bit for bit the CPU
    load's (safetensors' memory map), and the engine's phase split is filled in."""
    config = make_config("tiny", num_hidden_layers=4)
    write_dummy_checkpoint(tmp_path, config, seed=7, dtype="bfloat16", max_shard_bytes=200_000)
    model_config = ModelConfig.from_dir(tmp_path)
    models = {}
    timer = StartupTimer(torch.device("cuda"))
    for device, ops, t in (("cuda", get_ops("triton"), timer), ("cpu", get_ops("torch"), None)):
        models[device] = build_model(
            model_config,
            ops,
            model_dir=tmp_path,
            device=torch.device(device),
            dtype=torch.bfloat16,
            max_positions=model_config.max_position_embeddings,
            timer=t,
        )
    cpu = dict(models["cpu"].named_parameters())
    for name, param in models["cuda"].named_parameters():
        assert param.is_cuda and torch.equal(param.cpu(), cpu[name]), name
    assert {"model_init", "weights", "weights_read"} <= set(timer.times)
