"""A decode graph's own input load (kernels/arena_load.py): the leading words the pinned host arena's
header names reach the device arena exactly, nothing past them is written, and the placeholder rows then
take the previous step's sampled ids, against a hand-built expectation. On CUDA the source is pinned
host memory read through its mapped address."""

import pytest
import torch

from tinyvllm.kernels.arena_load import FIRST_READ_WORDS, REST_WORDS, load_arena

# room for copies that need two rounds of the loop after the first read
ARENA_WORDS = FIRST_READ_WORDS + 2 * REST_WORDS + 40


def _arena(device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(host source, device destination) of ARENA_WORDS words: random source bytes, a 0xA5 destination."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (4 * ARENA_WORDS,), dtype=torch.uint8, generator=g)
    if device.type == "cuda":
        src = src.pin_memory()
    return src, torch.full((4 * ARENA_WORDS,), 0xA5, dtype=torch.uint8, device=device)


@pytest.mark.parametrize("block", [16, FIRST_READ_WORDS])
@pytest.mark.parametrize("words", [1, 37, FIRST_READ_WORDS, FIRST_READ_WORDS + 1, ARENA_WORDS])
def test_exactly_the_named_words_arrive(device, words, block):
    """n = the header word (word 0, counted in n); words n.. of the destination keep their old bytes.
    No placeholder rows (every source −1), so the copy is all that happens; a first read of `block`
    words, the rest in the loop."""
    src, dst = _arena(device, words)
    src.view(torch.int32)[0] = words
    ids_off, rows = 4, 3  # int64 views at byte 16 and 16 + 8·rows: inside the copy only when n covers them
    src.view(torch.int64)[ids_off // 2 + rows : ids_off // 2 + 2 * rows] = -1  # placeholder sources −1
    d64 = dst.view(torch.int64)
    ids, ph_src = d64[ids_off // 2 : ids_off // 2 + rows], d64[ids_off // 2 + rows : ids_off // 2 + 2 * rows]
    if words * 4 < 16 + 16 * rows:  # the sources are not copied: make the destination's say "keep"
        ph_src.fill_(-1)
    before = dst.cpu().clone()
    load_arena(dst, src, ids, ph_src, torch.zeros(4, dtype=torch.int64, device=device), block=block)
    got = dst.cpu()
    assert torch.equal(got[: 4 * words], src.cpu()[: 4 * words])
    assert torch.equal(got[4 * words :], before[4 * words :])


def test_placeholder_rows_take_the_previous_samples(device):
    """Five rows, three of them placeholders pointing anywhere in the previous step's ids; the other
    rows keep the ids the copy brought, padding rows included."""
    src, dst = _arena(device, 7)
    s64 = src.view(torch.int64)
    rows = 5
    ids_host, ph_host = s64[2 : 2 + rows], s64[2 + rows : 2 + 2 * rows]
    ids_host.copy_(torch.tensor([-1, 11, -1, 13, 0]))  # −1: PLACEHOLDER, resolved on the device
    ph_host.copy_(torch.tensor([4, -1, 0, -1, -1]))
    used = 16 + 16 * rows + 24
    src.view(torch.int32)[0] = used // 4
    d64 = dst.view(torch.int64)
    sampled = torch.tensor([900, 901, 902, 903, 904, 905], dtype=torch.int64, device=device)
    load_arena(dst, src, d64[2 : 2 + rows], d64[2 + rows : 2 + 2 * rows], sampled)
    assert d64[2 : 2 + rows].tolist() == [904, 11, 900, 13, 0]
    assert d64[2 + rows : 2 + 2 * rows].tolist() == [4, -1, 0, -1, -1]  # the sources themselves as copied
    assert torch.equal(dst.cpu()[2 * 8 + 16 * rows : used], src.cpu()[2 * 8 + 16 * rows : used])
    # No rows: the copy alone, the placeholder ids left as copied.
    load_arena(dst, src, d64[2:2], d64[2:2], sampled)
    assert d64[2 : 2 + rows].tolist() == [-1, 11, -1, 13, 0]


@pytest.mark.parametrize("rows", [1, 8])
def test_engine_arena_layout(device, rows):
    """The engine's layout (engine/input_arena.py) at the shared arena's size, 256 rows, serving a few:
    the placeholder sources kilobytes past the first read, long block tables (the loop's round trips);
    the step's bytes arrive and its placeholder rows take the previous samples."""
    from tinyvllm.engine.input_arena import InputArena

    host = InputArena(256, 300, torch.device("cpu"), pin_memory=device.type == "cuda")
    dev = InputArena(256, 300, device)
    a = host.arrays
    a.input_ids[:rows] = [-1 if i % 2 == 0 else 50 + i for i in range(rows)]
    a.placeholder_src[:rows] = [(3 * i) % 8 if i % 2 == 0 else -1 for i in range(rows)]
    a.positions[:rows] = range(7, 7 + rows)
    a.block_tables[:rows, :300] = torch.arange(rows * 300).view(rows, 300).numpy()
    nbytes = host.bytes_through(rows, 300)
    host.set_copy_words(nbytes)
    sampled = torch.arange(900, 908, device=device)
    load_arena(dev.buffer, host.buffer, dev.input_ids[:rows], dev.placeholder_src[:rows], sampled)
    want_ids = [900 + (3 * i) % 8 if i % 2 == 0 else 50 + i for i in range(rows)]
    assert dev.input_ids[:rows].tolist() == want_ids
    assert dev.positions[:rows].tolist() == list(range(7, 7 + rows))
    assert dev.block_tables[:rows].cpu().tolist() == host.block_tables[:rows].tolist()
    assert torch.equal(
        dev.buffer[dev.positions.data_ptr() - dev.buffer.data_ptr() : nbytes].cpu(),
        host.buffer[host.positions.data_ptr() - host.buffer.data_ptr() : nbytes],
    )


def test_bad_arguments_are_refused(device):
    src, dst = _arena(device, 1)
    d64 = dst.view(torch.int64)
    ids, ph = d64[2:4], d64[4:6]
    sampled = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="one size"):
        load_arena(dst[:-4], src, ids, ph, sampled)
    with pytest.raises(ValueError, match="rows"):
        load_arena(dst, src, ids, d64[4:7], sampled)
    with pytest.raises(TypeError):
        load_arena(dst, src, ids, ph, sampled.float())
    with pytest.raises(ValueError, match="power of two"):
        load_arena(dst, src, ids, ph, sampled, block=100)
    with pytest.raises(ValueError, match="view of the destination"):
        load_arena(dst, src, ids, sampled, sampled)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="pinned"):
            load_arena(dst, src.clone(), ids, ph, sampled)  # pageable
        with pytest.raises(ValueError, match="pinned"):
            load_arena(dst, dst.clone(), ids, ph, sampled)  # on the device
