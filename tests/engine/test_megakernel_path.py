"""The one-launch batch-1 decode (kernels/decode_megakernel/) against the torch reference forward of
the same weights: hidden state, logits and the K/V it writes into the paged cache.

On the CPU the interpreter runs the kernel with one program (the barriers then pass at once), so every
unit of every phase runs in that program; the unit sizes (`tile`), the pipeline depths and the number
of context splits are varied so that the unit loops (pipelined or not), both schemes of phase D, the
multi-tile attention loop and the split merge (runs of 4 and 16 slots; by phase C's programs with
`split_o`, the default, and by the last split's ticket without) all run. On a GPU the same tests run one
program per SM (more programs than most phases have units); tests/gpu/test_megakernel_gpu.py checks the
real shape.

Tolerances as in test_fused_path.py (float32: order of the sums only; bfloat16: 8-bit roundings of
every product output, 4e-2 with 3× margin, against 0.27–1.1 for a skipped norm or residual).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.engine.test_fused_path import backends, build, device_for
from tinyvllm.config import RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.engine.paths.megakernel import DecodeMegakernel
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.decode_megakernel import (
    PIPELINE_BYTES,
    MegakernelConfig,
    Workspace,
    max_programs,
    phase_d_chunks,
    unit_rows,
    unit_tile,
)
from tinyvllm.models.decoder import CausalLM

BLOCK = 4
NUM_BLOCKS = 80
CPU = torch.device("cpu")


def kv_buffer(model, dtype: torch.dtype) -> torch.Tensor:
    c = model.config
    shape = (c.num_hidden_layers, 2, NUM_BLOCKS, c.num_key_value_heads, BLOCK, c.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)


def step(seq_len: int, slot_valid: bool = True, device: torch.device = CPU):
    """A decode step of one sequence whose context (incl. the new token) is seq_len tokens, its pages
    a shuffled set of the cache's blocks."""
    pages = -(-seq_len // BLOCK)
    table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seq_len))[:pages].to(torch.int32)
    pos = seq_len - 1
    slot = int(table[pos // BLOCK]) * BLOCK + pos % BLOCK if slot_valid else -1
    meta = AttnMetadata(
        slot_mapping=torch.tensor([slot]),
        num_decode_tokens=1,
        decode_seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        decode_block_tables=table[None, :],
        max_decode_seq_len=seq_len,
        num_prefills=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=table[None, :0],
        max_prefill_q_len=0,
        max_prefill_seq_len=0,
    )
    for name in (
        "slot_mapping",
        "decode_seq_lens",
        "decode_block_tables",
        "prefill_cu_seqlens_q",
        "prefill_seq_lens",
        "prefill_block_tables",
    ):
        setattr(meta, name, getattr(meta, name).to(device))
    return torch.tensor([seq_len * 7 % 512], device=device), torch.tensor([pos], device=device), meta


def views(buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(buffer[i, 0], buffer[i, 1]) for i in range(buffer.shape[0])]


def paths_of(model: CausalLM) -> ModelExecutor:
    """The runner's paths over `model` without the megakernel (the reference's, and the fallback's)."""
    return ModelExecutor(
        model, RunnerConfig(decode_megakernel=False, pruned_lm_head=False), model.embed_tokens.weight.device.type
    )


def with_megakernel(model: CausalLM, config: MegakernelConfig | None = None) -> ModelExecutor:
    """The runner's paths over `model` with the decode megakernel on (the runner itself turns it on only
    on CUDA; here the CPU interpreter runs it too)."""
    paths = paths_of(model)
    paths.megakernel = DecodeMegakernel(model, config)
    return paths


def forward(paths: ModelExecutor | CausalLM, ids, positions, meta, buffer):
    """(final hidden state, float32 logits) of one decode step through `paths` (a model: its own paths)."""
    if isinstance(paths, CausalLM):
        paths = paths_of(paths)
    with torch.no_grad():
        hidden = paths.hidden_states(ids, positions, meta, views(buffer))
        return hidden, paths.lm_head.logits(hidden, dtype=torch.float32)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_step(h, logits, h_ref, l_ref, buf, buf_ref, meta, num_layers: int, tol: float) -> None:
    """A decode step against the reference's: hidden states and logits within tol, the new token's K/V in
    every layer within tol, the rest of the cache untouched."""
    assert rel(h, h_ref) <= tol and rel(logits, l_ref) <= tol, (rel(h, h_ref), rel(logits, l_ref))
    slot = int(meta.slot_mapping[0])
    blk, off = slot // BLOCK, slot % BLOCK
    for layer in range(num_layers):
        for kv in (0, 1):
            assert rel(buf[layer, kv, blk, :, off], buf_ref[layer, kv, blk, :, off]) <= tol
    buf[:, :, blk, :, off] = buf_ref[:, :, blk, :, off]
    assert torch.equal(buf, buf_ref)


WIDE = {"hidden_size": 512, "intermediate_size": 256}  # phase D's tensor-core tile: 2 (bf16) / 4 chunks a row


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "seq_len,splits,tile,stages,ace_stages,overrides",
    [
        (1, 1, 16384, 3, 3, {}),
        (13, 1, 256, 3, 3, {}),
        (300, 3, 256, 4, 2, {}),
        (150, 2, 16384, 3, 3, {}),
        (300, 11, 256, 3, 3, {}),
        (64, 1, 256, 3, 3, {}),
        (65, 2, 256, 3, 3, {}),
        (13, 1, 256, 1, 1, {}),
        (300, 3, 256, 1, 1, {}),
        # phase D's two schemes: thread sums (tiles below 1024 elements) and the tensor cores (tiles of
        # 1–4 chunks a row)
        (13, 1, 1024, 3, 3, {}),
        (40, 2, 16384, 3, 3, WIDE),
        (40, 2, 16384, 1, 1, WIDE),
    ],
)
def test_megakernel_equals_reference_forward(dtype, seq_len, splits, tile, stages, ace_stages, overrides):
    device = device_for("triton")
    ref = build("torch", dtype, device, max_positions=512, **overrides)
    model = build("triton", dtype, device, max_positions=512, **overrides)
    paths = with_megakernel(
        model, MegakernelConfig(tile=tile, stages=stages, ace_stages=ace_stages, e_stages=ace_stages)
    )
    mk = paths.megakernel
    mk.workspace = Workspace(mk.shape, dtype, device, programs=max_programs(device), num_splits=splits)
    assert model.layers[1].mlp.down_proj.weight.data_ptr() == mk.weights.down[1].data_ptr()  # views, no copy
    rg = unit_rows(mk.shape, unit_tile(mk.config, dtype.itemsize))[2]
    assert phase_d_chunks(mk.shape, rg, dtype.itemsize)[1] == (tile >= 1024)  # tensor-core phase D possible

    ids, positions, meta = step(seq_len, device=device)
    buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    assert h.shape == h_ref.shape and h.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    check_step(h, logits, h_ref, l_ref, buf, buf_ref, meta, ref.config.num_hidden_layers, tol)


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "seq_len,splits,tile,stages,overrides",
    [
        (300, 11, 256, 3, {}),
        (65, 2, 256, 3, {"num_hidden_layers": 5}),
        (13, 1, 16384, 1, {}),
        (40, 2, 16384, 3, WIDE),
    ],
)
def test_megakernel_split_o_equals_reference(dtype, seq_len, splits, tile, stages, overrides):
    """Phase C split by KV group (`split_o`): each unit merges its group's attention partials itself
    (runs of 16 and 4 slots) and adds its products to float32 sums by atomics; phase D adds them to the
    residual and phase E reads the copy of it that phase D stored. On the CPU's one program every unit's
    group changes along its run (a merge per group). Five layers reuse each layer's sums twice within a
    launch; after the launch they are zero again, as the next launch needs them."""
    device = device_for("triton")
    ref = build("torch", dtype, device, max_positions=512, **overrides)
    model = build("triton", dtype, device, max_positions=512, **overrides)
    paths = with_megakernel(
        model, MegakernelConfig(tile=tile, stages=stages, ace_stages=stages, e_stages=stages, split_o=True)
    )
    mk = paths.megakernel
    mk.workspace = Workspace(mk.shape, dtype, device, programs=max_programs(device), num_splits=splits)
    ids, positions, meta = step(seq_len, device=device)
    buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    for _ in range(2):  # the second launch finds the sums zeroed by the first
        h, logits = forward(paths, ids, positions, meta, buf)
        tol = 1e-5 if dtype == torch.float32 else 4e-2
        assert rel(h, h_ref) <= tol and rel(logits, l_ref) <= tol, (rel(h, h_ref), rel(logits, l_ref))
        assert int(torch.count_nonzero(mk.workspace.o_sums)) == 0
        assert int(mk.workspace.barrier.abs().sum()) == 0


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("seq_len,splits", [(300, 11), (65, 2), (13, 1), (1, 3)])
def test_megakernel_split_merge_equals_reference(dtype, seq_len, splits):
    """The attention partials' merge by the last split's ticket (`split_o` off: phase C unsplit; split-minor
    runs of 4 or 16 slots, the slots beyond the split count masked): the same forward as the reference
    with 5 splits in runs of 16, 1–2 splits in runs of 4, and a context of one key."""
    device = device_for("triton")
    ref = build("torch", dtype, device, max_positions=512)
    model = build("triton", dtype, device, max_positions=512)
    paths = with_megakernel(model, MegakernelConfig(tile=256, split_o=False))
    mk = paths.megakernel
    mk.workspace = Workspace(mk.shape, dtype, device, programs=max_programs(device), num_splits=splits)
    ids, positions, meta = step(seq_len, device=device)
    buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    assert rel(h, h_ref) <= tol and rel(logits, l_ref) <= tol, (rel(h, h_ref), rel(logits, l_ref))


QWEN3_WINDOWED = {"use_sliding_window": True, "sliding_window": 70, "max_window_layers": 1}
GROUP_OF_3 = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "preset,dtype,seq_len,splits,split_o,overrides",
    [
        # Qwen3: q/k RMSNorm before RoPE, query width 4 × 32 = 128 ≠ hidden 64
        ("tiny-qwen3", torch.float32, 130, 3, True, {}),
        ("tiny-qwen3", torch.bfloat16, 130, 3, False, {}),
        ("tiny-qwen3", torch.float32, 1, 1, True, {}),  # the new key is the whole context
        ("tiny-qwen3", torch.float32, 65, 2, False, {}),  # ... and the whole of the last split
        # Qwen2: q/k/v biases; a window of 40 keys on layer 1 only
        ("tiny-qwen2", torch.float32, 130, 3, True, {}),
        ("tiny-qwen2", torch.bfloat16, 104, 2, False, {}),  # the window starts on a tile boundary
        # Mistral: the window on every layer
        ("tiny-mistral", torch.float32, 130, 3, True, {}),
        ("tiny-mistral", torch.bfloat16, 130, 2, False, {}),
        ("tiny-mistral", torch.float32, 30, 1, True, {}),  # context within the window
        ("tiny-mistral", torch.float32, 13, 1, False, {"sliding_window": 1}),  # the new key alone
        # q/k norm and a window on some layers together
        ("tiny-qwen3", torch.float32, 200, 3, True, QWEN3_WINDOWED),
        # three query heads per KV head (Llama 3.2 3B's 24 / 8, Qwen2.5-1.5B's 12 / 2): padded to four
        ("tiny", torch.float32, 130, 3, True, GROUP_OF_3),
        ("tiny", torch.bfloat16, 130, 2, False, GROUP_OF_3),
        ("tiny-qwen2", torch.float32, 130, 3, True, GROUP_OF_3),
        ("tiny-qwen3", torch.float32, 65, 2, False, {**GROUP_OF_3, "head_dim": 32}),
    ],
)
def test_megakernel_serves_every_family(preset, dtype, seq_len, splits, split_o, overrides):
    """Every family through the one launch against the torch reference's layer loop of the same weights:
    hidden state, logits and the K/V written (only the new token's slot). Contexts past the window (40
    keys; 70 in the last case), so a window applied wrongly or not at all shows (a window of 41 instead of
    40 gives 0.19, none at all 1.3, Qwen2's on both layers 0.9, against 1e-5); on the CPU's one program
    KV head 0's first unit takes the preloaded first tile and KV head 1's loads its own."""
    device = device_for("triton")
    ref = build("torch", dtype, device, max_positions=512, preset=preset, **overrides)
    model = build("triton", dtype, device, max_positions=512, preset=preset, **overrides)
    paths = with_megakernel(model, MegakernelConfig(tile=16384, split_o=split_o))
    mk = paths.megakernel
    mk.workspace = Workspace(mk.shape, dtype, device, programs=max_programs(device), num_splits=splits)
    c = model.config
    assert (mk.shape.qkv_bias, mk.shape.qk_norm) == (c.qkv_bias, c.qk_norm)
    assert mk.shape.window == (c.sliding_window if c.has_sliding_window else None)
    ids, positions, meta = step(seq_len, device=device)
    buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    check_step(h, logits, h_ref, l_ref, buf, buf_ref, meta, c.num_hidden_layers, tol)
    assert int(mk.workspace.barrier.abs().sum()) == 0 and int(torch.count_nonzero(mk.workspace.o_sums)) == 0


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_megakernel_window_never_reads_keys_before_it():
    """Keys before a layer's window may sit in blocks freed and handed to another sequence: the launch
    must not read them. Their block-table entries point at a block of NaNs here (any read of it would
    poison the output), and the result still equals the reference with the same poisoned table."""
    device = device_for("triton")
    dtype = torch.float32
    ref = build("torch", dtype, device, max_positions=512, preset="tiny-mistral")
    model = build("triton", dtype, device, max_positions=512, preset="tiny-mistral")
    paths = with_megakernel(model, MegakernelConfig(tile=16384))
    mk = paths.megakernel
    mk.workspace = Workspace(mk.shape, dtype, device, programs=max_programs(device), num_splits=2)
    seq_len = 130  # keys 90..129 visible; blocks 0..21 hold only keys before the window
    ids, positions, meta = step(seq_len, device=device)
    buf = kv_buffer(ref, dtype).to(device)
    used = set(meta.decode_block_tables[0].tolist())
    freed = next(b for b in range(NUM_BLOCKS) if b not in used)
    buf[:, :, freed] = float("nan")
    meta.decode_block_tables[0, : (seq_len - 40) // BLOCK] = freed
    buf_ref = buf.clone()
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    assert torch.isfinite(h_ref).all() and torch.isfinite(h).all()
    assert rel(h, h_ref) <= 1e-5 and rel(logits, l_ref) <= 1e-5


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_megakernel_padded_slot_writes_nothing_and_relaunches(preset):
    """Slot −1 writes no K/V; a second launch on the same workspace (counters reset by the kernel)
    gives the same result."""
    device = device_for("triton")
    model = build("triton", torch.float32, device, preset=preset)
    paths = with_megakernel(
        model,
    )
    ids, positions, meta = step(9, slot_valid=False, device=device)
    buf = kv_buffer(model, torch.float32).to(device)
    before = buf.clone()
    h1, _ = forward(paths, ids, positions, meta, buf)
    assert torch.equal(buf, before)
    assert int(paths.megakernel.workspace.barrier.abs().sum()) == 0
    assert int(paths.megakernel.workspace.tickets.abs().sum()) == 0
    h2, _ = forward(paths, ids, positions, meta, buf)
    assert torch.equal(h1, h2)


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-mistral"])
def test_megakernel_row_without_context_equals_reference(preset):
    """A CUDA graph's warm-up and padded rows launch with context 0 and slot −1: the kernel must attend
    to nothing, as the reference does (its split count once came from a division by zero)."""
    device = device_for("triton")
    ref = build("torch", torch.float32, device, max_positions=512, preset=preset)
    model = build("triton", torch.float32, device, max_positions=512, preset=preset)
    paths = with_megakernel(
        model,
    )
    ids, positions, meta = step(1, slot_valid=False, device=device)
    meta.decode_seq_lens.zero_()
    buf = kv_buffer(ref, torch.float32).to(device)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf.clone())
    h, logits = forward(paths, ids, positions, meta, buf)
    assert rel(h, h_ref) <= 1e-5 and rel(logits, l_ref) <= 1e-5


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_megakernel_that_does_not_fit_falls_back_to_the_layers(monkeypatch, caplog):
    """Triton refuses the first launch of a kernel that needs more shared memory than the GPU gives a program
    (OutOfResources, raised before anything runs; phase E's 4 stages take 98 KB): the runner's paths log why,
    drop the megakernel and run the layers one by one, giving the reference's forward."""
    from triton.runtime.errors import OutOfResources

    import tinyvllm.engine.paths.megakernel as megakernel_path

    def refuse(*args, **kwargs):
        raise OutOfResources(98368, 65536, "shared memory")

    device = device_for("triton")
    ref = build("torch", torch.float32, device, max_positions=512)
    model = build("triton", torch.float32, device, max_positions=512)
    paths = with_megakernel(
        model,
    )
    monkeypatch.setattr(megakernel_path, "decode_megakernel_fwd", refuse)
    ids, positions, meta = step(65, device=device)
    buf_ref, buf = kv_buffer(ref, torch.float32).to(device), kv_buffer(ref, torch.float32).to(device)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    with caplog.at_level(logging.WARNING, logger="tinyvllm.engine.paths.executor"):
        h, logits = forward(paths, ids, positions, meta, buf)
    assert paths.megakernel is None
    assert "decode megakernel off" in caplog.text and "shared memory" in caplog.text
    assert rel(h, h_ref) <= 1e-5 and rel(logits, l_ref) <= 1e-5


def test_megakernel_errors_other_than_resources_propagate(monkeypatch):
    """Only a kernel that does not fit the GPU falls back; any other error reaches the caller, megakernel kept."""
    import tinyvllm.engine.paths.megakernel as megakernel_path

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    model = build("triton", torch.float32, torch.device("cpu"))
    paths = with_megakernel(
        model,
    )
    monkeypatch.setattr(megakernel_path, "decode_megakernel_fwd", broken)
    ids, positions, meta = step(5)
    with pytest.raises(ValueError, match="a bug"):
        forward(paths, ids, positions, meta, kv_buffer(model, torch.float32))
    assert paths.megakernel is not None


def test_megakernel_needs_one_kv_buffer():
    model = build("triton", torch.float32, torch.device("cpu"))
    paths = with_megakernel(
        model,
    )
    ids, positions, meta = step(5)
    buf = kv_buffer(model, torch.float32)
    swapped = [(buf[0, 0], buf[0, 1]), (buf[1, 1], buf[1, 0])]  # layer 1's V before its K: no fixed offset
    with pytest.raises(ValueError, match="one buffer"):
        paths.megakernel(ids, positions, meta, swapped)


def test_unit_tile_fits_the_pipeline_in_shared_memory():
    """Phase D's pipeline keeps stages − 1 tiles in shared memory: the tile halves until they fit."""
    assert PIPELINE_BYTES == 160 << 10
    assert unit_tile(MegakernelConfig(tile=16384, stages=4), 2) == 16384  # 3 × 32 KB = 96 KB
    assert unit_tile(MegakernelConfig(tile=16384, stages=4), 4) == 8192  # 3 × 64 KB = 192 KB > 160 KB
    assert unit_tile(MegakernelConfig(tile=16384, stages=8), 2) == 8192  # 7 × 32 KB = 224 KB > 160 KB
    assert unit_tile(MegakernelConfig(tile=16384, stages=3, ace_stages=8), 2) == 8192  # the deeper counts
    assert unit_tile(MegakernelConfig(tile=16384, e_stages=8), 2) == 8192
    assert unit_tile(MegakernelConfig(tile=16384, stages=1, ace_stages=1, e_stages=1), 4) == 16384  # no pipeline


def test_max_programs_fills_the_sms_unless_capped(monkeypatch):
    """The grid: one program per multiprocessor on CUDA, at most `programs` where that is set and smaller;
    one program on the CPU interpreter whatever the config."""
    import tinyvllm.kernels.decode_megakernel.launch as launch

    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert max_programs(cuda, MegakernelConfig()) == 132
    assert max_programs(cuda, MegakernelConfig(programs=128)) == 128
    assert max_programs(cuda, MegakernelConfig(programs=300)) == 132
    assert max_programs(torch.device("cpu"), MegakernelConfig(programs=128)) == 1


@pytest.mark.parametrize("config", [MegakernelConfig(stages=0), MegakernelConfig(e_stages=0)], ids=["d", "e"])
def test_megakernel_rejects_a_config_without_a_pipeline_stage(config):
    model = build("triton", torch.float32, torch.device("cpu"))
    paths = with_megakernel(model, config)
    ids, positions, meta = step(5)
    with pytest.raises(ValueError, match="stages"):
        paths.megakernel(ids, positions, meta, views(kv_buffer(model, torch.float32)))


def test_megakernel_refuses_what_it_cannot_serve_in_one_log_line(caplog):
    """A head dim that is not a power of two is the one family shape the megakernel refuses (a group of 3
    query heads per KV head is served, padded): the runner's paths say why once and run the fused path;
    every tiny family preset is served."""
    from tinyvllm.engine.paths.megakernel import megakernel_unsupported

    for preset in ("tiny", "tiny-qwen3", "tiny-qwen2", "tiny-mistral"):
        assert megakernel_unsupported(build("triton", torch.float32, CPU, preset=preset)) is None
    assert megakernel_unsupported(build("triton", torch.float32, CPU, preset="tiny-qwen2", **GROUP_OF_3)) is None
    model = build(
        "triton", torch.float32, CPU, preset="tiny-qwen2", hidden_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    with caplog.at_level(logging.INFO, logger="tinyvllm.engine.paths.executor"):
        paths = ModelExecutor(model, RunnerConfig(decode_megakernel=True, pruned_lm_head=False), "cuda")
    assert paths.megakernel is None and paths.uses_fused_path(1)
    line = "decode megakernel off: head_dim 24 (needs a power of two) or query heads not a multiple of KV heads"
    assert caplog.text.count(line) == 1, caplog.text


@pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "preset,dtype,seq_len,splits,padded",
    [
        ("tiny", torch.bfloat16, 300, 3, False),
        ("tiny-qwen3", torch.float32, 130, 3, False),  # phase B writes the new key through the hinted pointers
        ("tiny-mistral", torch.float32, 130, 2, False),  # a window: first tiles loaded below it
        ("tiny", torch.float32, 65, 2, True),  # a layer stride of 8 elements past a multiple of 16: no hint
    ],
)
def test_megakernel_kv_align_equals_reference(preset, dtype, seq_len, splits, padded, monkeypatch):
    """`kv_align`: the K/V base pointers carry a 16-element alignment hint (16-byte vector loads on the GPU;
    tests/kernels/test_megakernel_codegen.py checks the code), the same forward and cache writes as the
    reference. The launcher sets the hint only where the layer stride and the V offset are multiples of 16
    elements: a buffer whose layers are 8 elements apart gets none."""
    from tinyvllm.kernels.decode_megakernel import launch

    seen = []
    real = launch._constexprs
    monkeypatch.setattr(launch, "_constexprs", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    device = device_for("triton")
    ref = build("torch", dtype, device, max_positions=512, preset=preset)
    model = build("triton", dtype, device, max_positions=512, preset=preset)
    paths = with_megakernel(model, MegakernelConfig(tile=16384, kv_align=True))
    mk = paths.megakernel
    mk.workspace = Workspace(mk.shape, dtype, device, programs=max_programs(device), num_splits=splits)
    ids, positions, meta = step(seq_len, device=device)
    buf_ref, buf = kv_buffer(ref, dtype).to(device), kv_buffer(ref, dtype).to(device)
    if padded:  # the same values, each layer 8 elements further on
        layers, per_layer = buf.shape[0], buf[0].numel()
        pad = torch.zeros(layers, per_layer + 8, dtype=dtype, device=device)
        pad[:, :per_layer] = buf.reshape(layers, per_layer)
        buf = pad[:, :per_layer].view(buf.shape)
    h_ref, l_ref = forward(ref, ids, positions, meta, buf_ref)
    h, logits = forward(paths, ids, positions, meta, buf)
    assert [s["KV_ALIGN"] for s in seen] == [not padded]
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    check_step(h, logits, h_ref, l_ref, buf, buf_ref, meta, ref.config.num_hidden_layers, tol)
