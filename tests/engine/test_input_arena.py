"""The decode graphs' input arena (engine/input_arena.py) and the graph step that fills it.

The CUDA graphs themselves need a GPU; what can run here is (1) the arena's layout, (2) the builder's
arena packing against its ordinary packing of the same scheduler outputs (ids, positions, slots,
lengths, table rows, placeholder sources, padding rows, cascade prefix), over consecutive steps so that
stale rows are in the way, and (3) the runner's graph step with each "graph" run eagerly on the CPU
(`_EagerGraphs`): the same inputs arena, one copy, placeholder gather, in-graph sampler and
`last_sampled` hand-over, against the runner's eager path. (3) with the Triton backend needs the
interpreter (the engine runs on the CPU here); on a GPU host the same property is checked on CUDA by
tests/gpu/test_engine_gpu.py::test_decode_graphs_with_async_placeholders_equal_eager_fp32."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import assert_equal_up_to_rounding, assert_greedy_is_decided, record_cascade_prefixes
from tinyvllm import LLM, SamplingParams
from tinyvllm.core.outputs import PLACEHOLDER, ScheduledSequence, SchedulerOutput
from tinyvllm.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tinyvllm.engine.input_arena import InputArena
from tinyvllm.engine.step_inputs import StepInputBuilder
from tinyvllm.kernels import reference
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

BS = 4
CPU = torch.device("cpu")
# The CPU engine's Triton kernels run only in the interpreter (set by tests/conftest.py without CUDA).
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CPU engine with Triton kernels needs TRITON_INTERPRET=1; on CUDA see tests/gpu/test_engine_gpu.py",
)


def seq(rid: str, token: int, computed: int, blocks: list[int]) -> ScheduledSequence:
    return ScheduledSequence(rid, [token], computed, blocks, True, False)


def test_layout_is_aligned_and_starts_as_padding():
    arena = InputArena(5, 3, CPU)
    tensors = [
        arena.input_ids,
        arena.positions,
        arena.slot_mapping,
        arena.placeholder_src,
        arena.seeds,
        arena.temperatures,
        arena.seq_lens,
        arena.prefix_len,
        arena.block_tables,
        arena.row_index,
    ]
    for t in [*tensors, arena.copy_words, arena.sampled_ids]:
        assert t.data_ptr() % 16 == 0 and t.untyped_storage().data_ptr() == arena.buffer.data_ptr()
    assert [t.dtype for t in tensors] == [torch.int64] * 5 + [
        torch.float32,
        torch.int32,
        torch.int32,
        torch.int32,
        torch.int64,
    ]
    assert arena.block_tables.shape == (5, 3) and arena.prefix_len.shape == (1,)
    assert arena.slot_mapping.tolist() == [-1] * 5 and arena.placeholder_src.tolist() == [-1] * 5
    assert arena.row_index.tolist() == list(range(5))
    # The block tables come after every per-row region; the row index after them, never copied.
    table_start = arena.block_tables.data_ptr() - arena.buffer.data_ptr()
    assert all(t.data_ptr() < arena.block_tables.data_ptr() for t in tensors[:8])
    assert arena.bytes_through(1, 1) == table_start + 4
    assert arena.bytes_through(2, 2) == table_start + (3 + 2) * 4
    assert arena.bytes_through(5, 3) == table_start + 15 * 4 <= arena.row_index.data_ptr() - arena.buffer.data_ptr()
    assert arena.arrays.block_tables.shape == (5, 3)
    arena.arrays.seeds[2] = 7
    assert arena.seeds[2] == 7  # numpy views share the buffer
    # The copy length leads (whole words, everything but the row index and sampled ids at first); the
    # sampled ids come last, never copied in.
    assert arena.copy_words.data_ptr() == arena.buffer.data_ptr() and arena.copy_words.dtype == torch.int32
    assert int(arena.copy_words[0]) * 4 == arena.bytes_through(5, 3)
    arena.set_copy_words(arena.bytes_through(1, 1) + 2)
    assert int(arena.copy_words[0]) == (table_start + 4 + 2 + 3) // 4
    assert arena.sampled_ids.data_ptr() > arena.row_index.data_ptr() and arena.sampled_ids.dtype == torch.int64
    with pytest.raises(ValueError):
        arena.set_copy_words(arena.nbytes + 1)


def _steps() -> list[tuple[SchedulerOutput, dict[str, int] | None, int]]:
    """(scheduler output, previous step's sample index, bucket) of consecutive decode-only steps: rows
    join, leave and grow blocks; placeholders; a shared prefix of 3 blocks (cascade at >= 2 rows);
    fewer rows after more, so the arena's padding rows hold the previous step's values."""
    shared = [50, 51, 52]
    a = seq("a", PLACEHOLDER, 13, [*shared, 60])
    b = seq("b", 9, 14, [*shared, 61])
    c = seq("c", PLACEHOLDER, 12, [*shared, 62])
    d = seq("d", 4, 2, [70])
    e = seq("e", PLACEHOLDER, 5, [80, 81])
    return [
        (SchedulerOutput([a, b, c, d, e], 5), {"a": 3, "c": 0, "e": 4, "x": 1}, 8),
        (
            SchedulerOutput([seq("a", PLACEHOLDER, 14, [*shared, 60]), seq("c", 8, 13, [*shared, 62])], 2),
            {"a": 1, "c": 0},
            2,
        ),  # both rows share 3 blocks: cascade
        (
            SchedulerOutput(
                [seq("e", PLACEHOLDER, 6, [80, 81]), seq("d", 3, 3, [70])],
                2,
                released_request_ids=frozenset({"a", "b", "c"}),
            ),
            {"e": 0},
            4,
        ),
        (SchedulerOutput([seq("d", PLACEHOLDER, 4, [70, 71])], 1), {"d": 1}, 1),
    ]


def _builder() -> StepInputBuilder:
    return StepInputBuilder(
        block_size=BS, max_num_batched_tokens=32, max_num_seqs=8, max_blocks_per_seq=6, device=CPU, cascade=(2, 4, 4)
    )


def test_arena_packing_equals_the_ordinary_packing():
    """Each step packed both ways: the host arena's rows, and the device arena's views after copying
    only `arena_bytes` over garbage, equal the ordinary padded build (placeholders resolved the same
    way too); padding rows are exactly padding, and only the table columns in use are compared."""
    ordinary, packer = _builder(), _builder()
    hosts = [InputArena(8, 6, CPU) for _ in range(2)]
    device = InputArena(8, 6, CPU)
    prefixes = []
    for step, (sched, prev_index, bucket) in enumerate(_steps()):
        want = ordinary.build(sched, pad_decodes_to=bucket, prev_sample_index=prev_index)
        host = hosts[step % 2]
        device.buffer.fill_(0xA5)  # garbage: whatever the step needs must come from its one copy
        device.row_index.copy_(torch.arange(8))
        got = packer.build(
            sched, pad_decodes_to=bucket, prev_sample_index=prev_index, host_arena=host, device_arena=device
        )
        device.buffer[: got.arena_bytes].copy_(host.buffer[: got.arena_bytes])
        D = len(sched.sequences)
        m, wm = got.meta, want.meta
        assert got.num_decodes == want.num_decodes == D and m.num_decode_tokens == bucket
        for t in (got.input_ids, got.positions, m.slot_mapping, m.decode_seq_lens, m.decode_block_tables):
            assert t.data_ptr() % 16 == 0
        assert got.input_ids.tolist() == want.input_ids.tolist()  # PLACEHOLDER still in, padding ids 0
        assert got.positions.tolist() == want.positions.tolist()
        assert m.slot_mapping.tolist() == wm.slot_mapping.tolist()
        assert m.decode_seq_lens.tolist() == wm.decode_seq_lens.tolist()
        pad = bucket - D
        assert m.slot_mapping.tolist()[D:] == [-1] * pad and m.decode_seq_lens.tolist()[D:] == [0] * pad
        width = wm.decode_block_tables.shape[1]
        assert m.decode_block_tables.shape == (bucket, 6)
        assert m.decode_block_tables[:D, :width].tolist() == wm.decode_block_tables.tolist()
        assert m.max_decode_seq_len == wm.max_decode_seq_len
        assert got.logits_indices.tolist() == want.logits_indices.tolist() == list(range(D))
        assert got.sample_order == want.sample_order and [s.request_id for s in got.sampled] == [
            s.request_id for s in want.sampled
        ]
        # Placeholder sources: a dense column (−1 elsewhere) instead of (rows, sources).
        src = [-1] * bucket
        if want.placeholder_rows is not None:
            for r, s in zip(want.placeholder_rows.tolist(), want.placeholder_src.tolist()):
                src[r] = s
        assert device.placeholder_src[:bucket].tolist() == src
        assert got.placeholder_rows is None and got.num_placeholders == want.num_placeholders == sum(
            s >= 0 for s in src
        )
        # Cascade prefix: the same length, in the arena and as the host value.
        want_prefix = 0 if wm.decode_prefix_len is None else int(wm.decode_prefix_len)
        assert got.prefix_len == want.prefix_len == want_prefix
        assert (m.decode_prefix_len is None) == (want_prefix == 0)
        if want_prefix:
            assert int(m.decode_prefix_len) == want_prefix == 12
        # The graph's gather resolves placeholders as the eager step's index copy does.
        prev_sampled = torch.arange(1000, 1008)
        resolved = want.input_ids.clone()
        if want.placeholder_rows is not None:
            resolved[want.placeholder_rows] = prev_sampled[want.placeholder_src]
        reference.resolve_placeholders(got.input_ids, device.placeholder_src[:bucket], prev_sampled)
        assert got.input_ids.tolist() == resolved.tolist()
        assert PLACEHOLDER not in got.input_ids.tolist()
        prefixes.append(int(host.arrays.prefix_len[0]))
    assert prefixes == [0, 12, 0, 0]  # written every step (0 without cascade): the twins alternate


def test_graph_step_rejects_what_the_graph_cannot_run():
    builder = _builder()
    host = device = InputArena(8, 6, CPU)
    prefill = ScheduledSequence("p", [1, 2, 3], 0, [1], True, True)
    with pytest.raises(ValueError):
        builder.build(SchedulerOutput([prefill], 3), pad_decodes_to=4, host_arena=host, device_arena=device)
    unsampled = ScheduledSequence("q", [1], 0, [2], False, True)
    with pytest.raises(ValueError):
        builder.build(SchedulerOutput([unsampled], 1), pad_decodes_to=1, host_arena=host, device_arena=device)


# ---------------------------------------------------------------------------------------------------
class _EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose "replay" runs the captured function eagerly (a CPU has no CUDA graphs);
    records each replay and whether each placeholder step found the previous ids in `last_sampled`, and
    the replays of the truncating sampler's graphs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replays: list[tuple[int, bool]] = []
        self.io_replays = 0  # replays of graphs that load their own inputs and write their own ids
        self.feeds: list[bool] = []  # True: the ids were already in last_sampled (no copy)
        self.truncating_replays: list[tuple[int, bool]] = []

    def _synchronize(self) -> None:
        pass

    def _capture_keys(self, keys) -> float:
        for key in keys:
            self.graphs[key] = None  # "captured": `_replay` runs the step's function instead
        return 0.0

    def _replay(self, key):
        assert key in self.graphs, f"replay of graph {key}, which was not captured"
        self.replays.append(key[:2])
        self.io_replays += key[2] is not None
        self._outputs[key] = self._run(*key)  # the buffers the truncating sampler reads
        return self._outputs[key]

    def _replay_truncating(self, key):
        assert self.sample_in_graph and key in self.graphs and key[3] == "logits", key
        self.truncating_replays.append(key[:2])
        return self._truncate(key)

    def feed_previous_samples(self, prev_sampled: torch.Tensor) -> None:
        self.feeds.append(self.holds_previous_samples(prev_sampled))
        super().feed_previous_samples(prev_sampled)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_arena")
    write_dummy_checkpoint(path, make_config("tiny"), seed=3, init_std=0.1, dtype="float32")
    return path


@pytest.fixture(scope="module")
def reference_llm(model_dir):
    """The torch backend's eager engine: where greedy choices are checked to be no near-ties."""
    return LLM(model=str(model_dir), device="cpu", max_model_len=96, block_size=4)


def _llm(
    model_dir,
    backend: str,
    graphs: bool,
    max_model_len: int = 64,
    max_num_batched_tokens: int = 16,
    io_max_rows: int = 0,
    sample_in_lm_head: bool = True,
) -> tuple[LLM, _EagerGraphs | None]:
    llm = LLM(
        model=str(model_dir),
        device="cpu",
        max_model_len=max_model_len,
        block_size=4,
        kernel_backend=backend,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        async_scheduling=True,
    )
    runner = llm.llm_engine.runner
    if not graphs:
        return llm, None
    sizes = graph_batch_sizes(8)
    runner.graphs = _EagerGraphs(
        runner.executor,
        runner.kv_caches,
        batch_sizes=sizes,
        max_blocks_per_seq=runner.builder.tables.max_blocks_per_seq,
        max_seq_len=max_model_len,
        device=CPU,
        resolve_placeholders=runner.ops.resolve_placeholders,
        max_num_seqs=8,
        cascade_batch_sizes=sizes,
        sample_in_graph=backend == "triton",
        io_max_rows=io_max_rows,
        sample_in_lm_head=sample_in_lm_head,
    )
    runner.graphs.capture()
    return llm, runner.graphs


@pytest.mark.parametrize(
    "backend,io,lm_head",
    [
        pytest.param("triton", 0, True, marks=needs_interpreter),
        pytest.param("triton", 8, True, marks=needs_interpreter),
        pytest.param("triton", 8, False, marks=needs_interpreter),
        ("torch", 0, True),
    ],
)
def test_graph_steps_equal_eager_steps(model_dir, reference_llm, backend, io, lm_head):
    """Async scheduling (placeholder inputs every decode): batch-1 greedy, then a mixed batch (greedy,
    seeded temperature, a seeded top-p row, a logprobs row for the full sampler), through the graph step
    and through the eager path: the same tokens and logprobs. With the Triton kernels the top-p row is
    drawn by the truncating sampler's graph, replayed after the forward graph of its steps. With the
    in-graph sampler serving every row (triton, batch 1) the previous ids are found in `last_sampled`
    after the first decode; otherwise each placeholder step copies them there. `io`: graphs of up to
    that many rows load their own inputs from the host twin and write the ids back there (the batch-1
    steps' tokens come from that write; the mixed batch's logprobs row sends its step through the full
    sampler and the runner's copy). `lm_head`: the graphs' sampler inside the LM head's product (else
    its own kernels after it).

    The two engines pad batches differently (a graph step runs its bucket's row count), so their logits
    may differ by rounding: logprobs are compared up to it, and greedy tokens exactly because no greedy
    choice here is near a tie (checked; a seeded draw changes only at one, see tests/helpers.py)."""
    alone = ([3, 14, 15, 92, 65], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    mixed = [
        alone,
        ([9, 8, 7], SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True)),
        ([1, 2], SamplingParams(temperature=1.0, top_p=0.7, seed=11, max_tokens=4, ignore_eos=True)),
        ([5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, logprobs=2, max_tokens=3, ignore_eos=True)),
    ]
    assert_greedy_is_decided(reference_llm, [{"prompt_token_ids": alone[0]}, {"prompt_token_ids": mixed[3][0]}], 5)
    results = {}
    for graphs in (False, True):
        llm, fake = _llm(model_dir, backend, graphs, io_max_rows=io, sample_in_lm_head=lm_head)
        one = llm.generate([{"prompt_token_ids": alone[0]}], [alone[1]], use_tqdm=False)[0].outputs[0]
        if fake is not None:
            assert len(fake.replays) == 4 and all(r == (1, False) for r in fake.replays)
            assert fake.io_replays == (4 if io else 0)
            # the first decode reads the prefill's ids (an eager step's): one copy; then the graph's own
            assert fake.feeds == ([False] + [True] * 3 if backend == "triton" else [False] * 4)
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in mixed], [s for _, s in mixed], use_tqdm=False)
        if fake is not None:
            assert any(bs == 4 for bs, _ in fake.replays[4:])  # the mixed batch ran as padded graph steps
            assert fake.io_replays == (len(fake.replays) if io else 0)
            # the top-p row's decode steps replay the truncating sampler's graph after the forward's
            if backend == "triton":
                assert len(fake.truncating_replays) == 3 and set(fake.truncating_replays) <= set(fake.replays[4:])
            else:
                assert fake.truncating_replays == []
        results[graphs] = (one.token_ids, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert_equal_up_to_rounding(results[True], results[False])
    assert results[True][1][0][0] == results[True][0]  # the greedy row ignores its batch


@needs_interpreter
@pytest.mark.parametrize("io", [0, 8])
def test_cascade_graph_step_equals_eager(model_dir, reference_llm, io):
    """Rows sharing cached prefix blocks replay the cascade "graph" (thresholds lowered), reading the
    prefix length from the arena: the same greedy tokens as the eager path (`io`: with the graphs
    loading their own inputs), none of them decided by rounding (checked)."""
    shared = [(7 * i) % 200 + 3 for i in range(66)]  # 16 full blocks of 4: 64 keys, one CASCADE_ALIGN
    prompts = [{"prompt_token_ids": [*shared, 11 + j]} for j in range(3)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert_greedy_is_decided(reference_llm, prompts, 3)
    results = {}
    for graphs in (False, True):
        llm, fake = _llm(model_dir, "triton", graphs, max_model_len=96, max_num_batched_tokens=256, io_max_rows=io)
        llm.llm_engine.runner.builder.cascade = (2, 64, 64)
        used = record_cascade_prefixes(llm.llm_engine.runner.builder)
        results[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert 64 in used, used
        if fake is not None:
            assert (4, True) in fake.replays, fake.replays
    assert results[True] == results[False]
