"""`read_tensors` (models/loader.py): a sharded checkpoint read on a thread pool gives every tensor of every
file, in file and key order, bit for bit what safetensors' own `load_file` reads: through safetensors'
memory map (the CPU default) and through positional reads in chunks (`direct`, the CUDA default)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.models.loader import ReadStats, read_tensors, safetensors_files
from tinyvllm.models.safetensors_reader import read_header


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


@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize("chunk_bytes", [1000, 1 << 20])
def test_direct_reads_match_safetensors(tmp_path, num_threads, chunk_bytes):
    """Positional reads in chunks (the CUDA path's, here straight into CPU tensors): every tensor bit for
    bit, in key order, chunks that split elements included (1000 bytes is no multiple of 8)."""
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=3, dtype="bfloat16", max_shard_bytes=60_000)
    files = safetensors_files(tmp_path)
    want = {name: t for path in files for name, t in load_file(str(path)).items()}
    want_order = list(read_tensors(files, torch.device("cpu"), num_threads=1, direct=False))
    stats = ReadStats()
    got = list(
        read_tensors(
            files, torch.device("cpu"), num_threads=num_threads, direct=True, chunk_bytes=chunk_bytes, stats=stats
        )
    )
    assert [(n, p) for n, p, _ in got] == [(n, p) for n, p, _ in want_order]
    for name, _, tensor in got:
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    assert stats.tensors == len(want)
    assert stats.bytes == sum(t.nbytes for t in want.values())


def test_direct_reads_every_dtype_and_slices(tmp_path):
    """Every dtype safetensors stores for torch, a scalar and an empty tensor, byte for byte; a sliced
    name (a tensor-parallel rank's part) comes as safetensors' slice."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(37, 11, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(5, 3, 2, generator=gen).to(torch.float16),
        "f32": torch.randn(129, generator=gen),
        "f64": torch.randn(3, 7, generator=gen, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (17,), generator=gen),
        "i32": torch.randint(-(2**30), 2**30, (4, 4), generator=gen, dtype=torch.int32),
        "i16": torch.randint(-(2**14), 2**14, (9,), generator=gen, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (33,), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 255, (31,), generator=gen, dtype=torch.uint8),
        "bool": torch.rand(23, generator=gen) > 0.5,
        "fp8": torch.randn(8, 16, generator=gen).to(torch.float8_e4m3fn),
        "fp8e5": torch.randn(6, generator=gen).to(torch.float8_e5m2),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "sliced": torch.arange(60, dtype=torch.float32).reshape(6, 10),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    got = {
        name: t
        for name, _, t in read_tensors(
            [path], torch.device("cpu"), {"sliced": (1, 2, 5)}, num_threads=3, direct=True, chunk_bytes=7
        )
    }
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        if name == "sliced":
            want = want[:, 2:7]
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def test_read_header_rejects_a_truncated_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(100)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(ValueError, match="outside the file"):
        read_header(path)
    path.write_bytes(data[:4])
    with pytest.raises(ValueError, match="too short"):
        read_header(path)


def test_materialize_gives_meta_tensors_storage_and_keeps_sharing():
    """`materialize` is `Module.to_empty` without its meta-tensor `empty_like`: every parameter and
    buffer gets storage of its shape and dtype on the device, a tensor shared by two modules stays one
    tensor, and a parameter keeps its class, requires_grad and attributes."""
    from tinyvllm.models.loader import materialize

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight  # tied
        model.register_buffer("table", torch.zeros(3, 2, dtype=torch.int64))
        model[0].weight.shard_dim = 0
        frozen = torch.nn.Linear(2, 2, dtype=torch.bfloat16).requires_grad_(False)
    model.append(frozen)
    materialize(model, "cpu")
    assert model[0].weight is model[1].weight
    assert model[0].weight.device.type == "cpu" and model[0].weight.shape == (10, 4)
    assert isinstance(model[0].weight, torch.nn.Parameter) and model[0].weight.shard_dim == 0
    assert model.table.shape == (3, 2) and model.table.dtype == torch.int64 and model.table.device.type == "cpu"
    assert model[2].weight.dtype == torch.bfloat16 and not model[2].weight.requires_grad
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
