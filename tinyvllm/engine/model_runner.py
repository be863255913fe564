"""Runs scheduled steps on the device: inputs → forward → logits → sampled ids.

Owns the model, the KV cache tensors, the step-input staging, the decode CUDA graphs and the step's
sampling. Which path computes a step (layer loop, fused small batch, megakernel, pruned LM head) is the
runner's choice, made through `ModelExecutor` (engine/paths/) from the step's shape and `RunnerConfig`.
`launch(step)` only enqueues work and returns a handle; `handle.result()` waits for that step's sampled
ids, one small device-to-host copy. The engine can therefore schedule and launch step N+1 before it
reads step N's tokens: a decode input that is still on the device (PLACEHOLDER) is gathered there from
the previous step's sampled ids (by an index copy on eager steps, inside the graph on decode graph steps).

A decode graph step's stream work outside its graph: the one host-to-device copy of its input arena
(cuda_graphs.py), the replay, the copy of the sampled ids to the host and an event (both copies are
kernels for steps of at most `kernel_copy_max_rows` rows, kernels/host_copy.py); plus one device
copy of the previous step's sampled ids when the step has placeholder inputs and no graph's sampler
left those ids in `DecodeGraphs.last_sampled` (the previous step was eager, or partly full-sampled).
Buckets of at most `graph_io_max_rows` rows do both copies inside their graph: their steps' stream work
is the replay and an event. With `pruned_lm_head` (the engine's default on CUDA) those buckets' steps whose
every row the fused sampler serves replay graphs that sample from an int8 copy of the LM head and the rows
it cannot rule out, without logits (kernels/lm_head_bounds.py: the same ids).

Tensor parallelism (`group`): the runner holds its rank's shard of the model and of the KV cache (its
KV heads of every block: the driver's block ids mean the same blocks on every rank) and runs the same
steps as every other rank, in the same order, so their collectives pair up. The paths that read whole
weights are off (the fused matrix-vector path, the megakernel, the pruned LM head; decode graphs do not
sample inside the graph); the LM head gathers the full logits on every rank, and after sampling rank 0's
ids are broadcast, so every rank feeds the same ids to its next step (rank 0 alone applies the grammars'
bitmasks and computes logprobs for its caller).

Rows of requests that asked for prompt logprobs (prompt chunks, never graph steps) are scored after the
forward, eagerly: their hidden states go through the LM head in slices of at most
`PROMPT_LOGPROBS_MAX_ROWS` rows (sampling/prompt_logprobs.py); steps without such rows skip it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinyvllm.config import CacheConfig, ModelConfig, RunnerConfig
from tinyvllm.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from tinyvllm.distributed.group import TPGroup
from tinyvllm.distributed.shard import ModelShard
from tinyvllm.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tinyvllm.engine.input_arena import InputArena
from tinyvllm.engine.kv_cache_size import (
    KVCacheSize,
    format_bytes,
    size_for_work,
    size_from_blocks,
    size_from_bytes,
    total_memory_bytes,
)
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.engine.startup_timing import StartupTimer
from tinyvllm.engine.step_inputs import StepInputBuilder, StepInputs
from tinyvllm.kernels import get_ops
from tinyvllm.kernels.attention_metadata import CASCADE_ALIGN, AttnMetadata
from tinyvllm.models.decoder import FP8_KV_DTYPE, KVCache
from tinyvllm.models.loader import build_model
from tinyvllm.quantization.config import QuantizationConfig
from tinyvllm.sampling.bitmask import bitmask_width
from tinyvllm.sampling.fused_plan import FusedSamplingPlan
from tinyvllm.sampling.logits_processors import apply_to_bitmask
from tinyvllm.sampling.prompt_logprobs import StepPromptLogprobs, may_score_prompts, prompt_spans, step_prompt_logprobs
from tinyvllm.sampling.sampler import LogprobsTensors
from tinyvllm.sampling.step_sampler import StepSampler

if TYPE_CHECKING:
    from tinyvllm.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# The most prompt rows whose logits exist at once when scoring prompt tokens (also at most max_num_seqs,
# the logits rows the memory profile counts): [512, V] float32 is 256 MiB at V = 128k.
PROMPT_LOGPROBS_MAX_ROWS = 512


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: the model's for "auto", float8_e4m3fn for "fp8" / "fp8_e4m3"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; expected auto, fp8 or fp8_e4m3")


@dataclass
class StepHandle:
    """A launched step. `result()` blocks until its sampled ids are on the host."""

    sampled_host: torch.Tensor | None  # [N] int64, filled asynchronously
    event: torch.cuda.Event | None
    sample_order: list[int]
    logprobs: LogprobsTensors | None
    num_logprobs: list[int | None]  # per row of `logprobs`
    logprob_rows: list[int] | None = None  # the sampled rows that `logprobs` covers (None: all)
    prompt_logprobs: StepPromptLogprobs | None = None  # of the step's rows that score prompt tokens

    def result(self) -> ModelRunnerOutput:
        if self.sampled_host is None:
            prompt = None if self.prompt_logprobs is None else self.prompt_logprobs.to_host()
            return ModelRunnerOutput(sampled_token_ids=[], prompt_logprobs=prompt)
        if self.event is not None:
            self.event.synchronize()
        ids = self.sampled_host.tolist()
        logprobs = None
        if self.logprobs is not None:
            rows = self.logprobs.to_lists(self.num_logprobs)
            per_row = [
                None if r is None else [(tok, lp, r[2] if k == 0 else k) for k, (tok, lp) in enumerate(zip(r[0], r[1]))]
                for r in rows
            ]
            if self.logprob_rows is not None:
                covered = per_row
                per_row = [None] * len(ids)
                for i, entry in zip(self.logprob_rows, covered):
                    per_row[i] = entry
            logprobs = [per_row[j] for j in self.sample_order]
        prompt = None if self.prompt_logprobs is None else self.prompt_logprobs.to_host()
        return ModelRunnerOutput(
            sampled_token_ids=[ids[j] for j in self.sample_order], logprobs=logprobs, prompt_logprobs=prompt
        )


class ModelRunner:
    """Builds the model and runs the engine's steps on the device (module docstring).

    Args:
        model_config: the model's shape.
        runner_config: which execution paths are on (EngineArgs.runner_config()).
        model_dir: the checkpoint's directory.
        device, dtype: where and in what the model runs.
        kernel_backend: "triton" or "torch" (kernels/__init__.py).
        load_format: "auto"/"safetensors", or "dummy" for random weights.
        quantization: FP8 linear layers (quantization/), or None: the model's dtype.
        kv_cache_dtype: "auto" (the model's dtype) or "fp8"/"fp8_e4m3" (float8_e4m3fn: half the bytes).
        seed: seeds dummy weights and the sampler's random state.
        eos_token_ids: banned while a request is shorter than its min_tokens.
        show_progress: show the weight-loading progress bar.
        group: this rank's tensor-parallel group (None: one rank holds the whole model).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        runner_config: RunnerConfig,
        *,
        model_dir: str,
        device: torch.device,
        dtype: torch.dtype,
        kernel_backend: str,
        load_format: str = "auto",
        seed: int = 0,
        eos_token_ids: Sequence[int] = (),
        show_progress: bool = False,
        quantization: QuantizationConfig | None = None,
        kv_cache_dtype: str = "auto",
        group: TPGroup | None = None,
    ) -> None:
        self.group = group if group is not None and group.world_size > 1 else None
        if self.group is not None:
            self.shard = ModelShard.for_rank(model_config, group.rank, group.world_size)
            runner_config = sharded_runner_config(runner_config)
        else:
            self.shard = ModelShard.whole(model_config)
        self.model_config = model_config
        self.config = runner_config
        self.device = device
        self.dtype = dtype
        self.kernel_backend = kernel_backend
        self.kv_cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        # Start-up phases inside the runner's construction, by name (engine/startup_timing.py); the engine
        # moves them out of its own "weights" phase.
        timer = StartupTimer(device)
        with timer.phase("kernels_import"):
            self.ops = get_ops(kernel_backend, batch_invariant=runner_config.batch_invariant)
        self.model = build_model(
            model_config,
            self.ops,
            model_dir=model_dir,
            device=device,
            dtype=dtype,
            max_positions=model_config.max_position_embeddings,
            load_format=load_format,
            seed=seed,
            show_progress=show_progress,
            quant=quantization,
            shard=self.shard,
            group=self.group,
            timer=timer,
        )
        # Built before the memory profile, which then counts the megakernel's workspace and the pruned LM
        # head's int8 copy.
        with timer.phase("derived_weights"):
            self.executor = ModelExecutor(
                self.model, runner_config, device.type, kv_cache_dtype=self.kv_cache_dtype, group=self.group
            )
        triton = kernel_backend == "triton"
        with timer.phase("sampler_init"):
            self.sampler = StepSampler(model_config.vocab_size, device, seed, eos_token_ids, fused_kernel=triton)
        self.startup_times: dict[str, float] = timer.times
        self.kv_caches: list[KVCache] = []
        self.block_size = 0
        self.builder: StepInputBuilder | None = None
        self.graphs: DecodeGraphs | None = None
        self._prev_sampled: torch.Tensor | None = None  # last launched step's sampled ids (device)
        self._prev_index: dict[str, int] = {}
        # Host staging written at launch and copied asynchronously: two of each, used alternately, since
        # the engine reads step N's results only after launching step N+1.
        self._host_bufs: list[dict[str, torch.Tensor]] = []
        self._before_mask: Callable[[], None] | None = None  # launch()'s, for _grammar_bitmask
        # Inside a launch's `before_mask` window: that step's row index (what the next step's placeholder
        # inputs point into); `prepare` packs the next step then, and `launch` takes the packing over.
        self._window_index: dict[str, int] | None = None
        self._packed: _PackedStep | None = None
        self._bitmask_bufs: list[torch.Tensor] = []  # constrained steps' host bitmasks (two, alternating)
        self.builder_rows = 0  # the most rows a step samples (max_num_seqs), set by initialize()
        self._num_launched = 0
        self._prompt_rows = PROMPT_LOGPROBS_MAX_ROWS

    # ------------------------------------------------------------------ KV cache and set-up
    def bytes_per_block(self, block_size: int) -> int:
        c = self.model_config
        elem = self.kv_cache_dtype.itemsize  # FP8: one byte per value, so twice the tokens fit
        return 2 * c.num_hidden_layers * self.shard.num_kv_heads * block_size * c.head_dim * elem

    def determine_num_blocks(
        self, cache: CacheConfig, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
    ) -> KVCacheSize:
        """`_num_blocks`, the smallest over the tensor-parallel ranks (each holds every block)."""
        size = self._num_blocks(cache, max_num_batched_tokens, max_num_seqs, max_model_len)
        if self.group is None:
            return size
        num_blocks = self.group.min_int(size.num_blocks)
        if num_blocks == size.num_blocks:
            return size
        return dataclasses.replace(size, num_blocks=num_blocks, reason=f"{size.reason}; the smallest of the ranks")

    def _num_blocks(
        self, cache: CacheConfig, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
    ) -> KVCacheSize:
        """How many blocks, and why (`tinyvllm.engine.kv_cache_size`): the override if given, else
        `kv_cache_memory_bytes` if given; on CUDA, what `gpu_memory_utilization` of the card leaves
        after weights, a profiling forward of `max_num_batched_tokens` tokens and the sampler's
        workspace; on the CPU, what `max_num_seqs` sequences of `max_model_len` tokens need, at most
        `cpu_max_memory_fraction` of the machine's memory."""
        per_block = self.bytes_per_block(cache.block_size)
        if cache.num_gpu_blocks_override is not None:
            return size_from_blocks(cache.num_gpu_blocks_override, per_block)
        if cache.kv_cache_memory_bytes is not None:
            return size_from_bytes(cache.kv_cache_memory_bytes, per_block)
        if self.device.type != "cuda":
            return size_for_work(
                bytes_per_block=per_block,
                block_size=cache.block_size,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                memory_bytes=total_memory_bytes(),
                max_memory_fraction=cache.cpu_max_memory_fraction,
            )
        peak = self._profile_peak_memory(max_num_batched_tokens, max_num_seqs, cache.block_size)
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_for_cache = int(total * cache.gpu_memory_utilization) - peak
        if free_for_cache < per_block:
            raise ValueError(
                f"no memory left for the KV cache: weights and activations take {peak / 2**30:.1f} GiB "
                f"of the {total * cache.gpu_memory_utilization / 2**30:.1f} GiB allowed by "
                f"gpu_memory_utilization={cache.gpu_memory_utilization}; raise it or lower "
                f"max_num_batched_tokens"
            )
        reason = (
            f"gpu_memory_utilization {cache.gpu_memory_utilization:g} of {format_bytes(total)}, "
            f"less {format_bytes(peak)} of weights and activations"
        )
        return KVCacheSize(int(free_for_cache // per_block), per_block, reason)

    @torch.no_grad()
    def _profile_peak_memory(self, num_tokens: int, max_num_seqs: int, block_size: int) -> int:
        """Peak memory of one prompt of `num_tokens` tokens (the largest step) plus logits and sampling
        temporaries for `max_num_seqs` rows and the decode graphs' logits buffer. The cache is one
        block that every page of the block table points at; nothing is written to it."""
        # Start-up runs with automatic collection off (gc_pause.py): free any device memory that only
        # unreachable cycles still hold before the peak is measured, so that it never counts as in use.
        gc.collect()
        self.allocate_kv_cache(1, block_size)
        dev, i32 = self.device, torch.int32
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        pages = -(-num_tokens // block_size)
        meta = AttnMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            num_decode_tokens=0,
            decode_seq_lens=torch.zeros(0, dtype=i32, device=dev),
            decode_block_tables=torch.zeros(0, 1, dtype=i32, device=dev),
            max_decode_seq_len=0,
            num_prefills=1,
            prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=i32, device=dev),
            prefill_seq_lens=torch.tensor([num_tokens], dtype=i32, device=dev),
            prefill_block_tables=torch.zeros(1, pages, dtype=i32, device=dev),
            max_prefill_q_len=num_tokens,
            max_prefill_seq_len=num_tokens,
        )
        positions = torch.arange(num_tokens, device=dev) % self.model.max_positions
        hidden = self.executor.hidden_states(ids, positions, meta, self.kv_caches)
        logits = self.executor.lm_head.logits(hidden[:1].expand(max_num_seqs, -1).contiguous())
        graph_logits = torch.empty_like(logits)  # the decode graphs keep their own logits buffer
        probs = torch.softmax(logits, -1)  # the torch sampler's largest temporaries
        del probs, graph_logits, logits, hidden
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One K and one V tensor per layer, [num_blocks, Hk, block_size, D], carved from one buffer."""
        c = self.model_config
        self.block_size = block_size
        shape = (c.num_hidden_layers, 2, num_blocks, self.shard.num_kv_heads, block_size, c.head_dim)
        buffer = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        self.kv_caches = [(buffer[i, 0], buffer[i, 1]) for i in range(c.num_hidden_layers)]

    def initialize(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        """Allocate the cache and the input staging; capture the decode graphs (CUDA only)."""
        self.allocate_kv_cache(num_blocks, block_size)
        max_blocks = -(-max_model_len // block_size)
        cfg = self.config
        triton = self.kernel_backend == "triton"
        # Under batch_invariant the attention ops ignore a cascade prefix (it is chosen by the batch).
        cascade_on = triton and not cfg.batch_invariant
        cascade = (cfg.cascade_min_batch, cfg.cascade_min_prefix, CASCADE_ALIGN) if cascade_on else None
        if cascade is not None and self.model_config.has_sliding_window:
            # The shared prefix is attended once for all rows, but each row sees only its own window of it.
            logger.info("cascade attention off: the model has sliding-window layers")
            cascade = None
        self.builder = StepInputBuilder(
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=max_blocks,
            device=self.device,
            cascade=cascade,
        )
        self._prompt_rows = max(1, min(PROMPT_LOGPROBS_MAX_ROWS, max_num_seqs))
        pin = self.device.type == "cuda"
        self.builder_rows = max_num_seqs
        self._host_bufs = [
            {
                "ids": torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin),
                "temps": torch.zeros(max_num_seqs, dtype=torch.float32, pin_memory=pin),
                "seeds": torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin),
                "rows": torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin),
            }
            for _ in range(2)
        ]
        if self.config.cuda_graphs and self.device.type == "cuda":
            sizes = graph_batch_sizes(max_num_seqs)
            self.graphs = DecodeGraphs(
                self.executor,
                self.kv_caches,
                batch_sizes=sizes,
                max_blocks_per_seq=max_blocks,
                max_seq_len=max_model_len,
                device=self.device,
                resolve_placeholders=self.ops.resolve_placeholders,
                max_num_seqs=max_num_seqs,
                cascade_batch_sizes=[b for b in sizes if b >= cfg.cascade_min_batch] if cascade else [],
                sample_in_graph=self.kernel_backend == "triton" and self.group is None,
                io_max_rows=cfg.graph_io_max_rows if triton else 0,
                sample_in_lm_head=cfg.sample_in_lm_head,
                pruned_lm_head=self.executor.lm_head.rows is not None,
            )
            if cfg.graph_capture == "eager":
                self.graphs.capture()
        if triton and self.device.type == "cuda" and self.group is None:
            self._warm_truncating_sampler()

    def _warm_truncating_sampler(self) -> None:
        """Compile the truncating sampler's kernels (kernels/top_p_sampling/) for logits in the LM head's
        dtype, the decode graphs' logits, at start-up rather than at the first step or capture that needs
        them: one launch over two rows of zeros."""
        from tinyvllm.kernels.top_p_sampling import sample_top_k_top_p

        weight = self.executor.lm_head.weight
        logits = torch.zeros(2, weight.shape[0], dtype=weight.dtype, device=self.device)
        ones = torch.ones(2, dtype=torch.float32, device=self.device)
        seeds = torch.zeros(2, dtype=torch.int64, device=self.device)
        top_k = torch.full((2,), 50, dtype=torch.int32, device=self.device)
        sample_top_k_top_p(logits, ones, seeds, top_k, ones * 0.9, ones * 0.0)
        torch.cuda.synchronize(self.device)

    def next_graph_capture(self, idle: bool = False) -> int | None:
        """The decode graph bucket to capture next (`DecodeGraphs.next_capture`); None: none now, or no
        graphs. `idle`: no request is running, so any bucket not captured yet may be."""
        return None if self.graphs is None else self.graphs.next_capture(idle)

    def capture_graph(self, bucket: int) -> None:
        """Capture one bucket's decode graphs; between steps, with no launched step left unread
        (`DecodeGraphs.capture_bucket`)."""
        assert self.graphs is not None
        self.graphs.capture_bucket(bucket)

    def shutdown(self) -> None:
        """Nothing to stop: a one-rank runner has no processes (distributed/driver.py's has)."""

    def check_health(self) -> None:
        """Nothing to check: a one-rank runner has no other processes (distributed/driver.py's has)."""

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def launch(
        self,
        sched: SchedulerOutput,
        structured: StructuredOutputManager | None = None,
        before_mask: Callable[[], None] | None = None,
    ) -> StepHandle:
        """Enqueue one step (inputs, forward, sampling, the copy of the sampled ids) and return.
        `structured`: the engine's grammars, whose token bitmask the step's constrained rows sample under.
        `before_mask`: called, when the step has constrained rows, after its forward is enqueued and before
        their bitmask is filled (the engine brings the grammars up to date with the in-flight step there)."""
        assert self.builder is not None, "initialize() first"
        if structured is not None and not structured.grammars:
            structured = None
        self._before_mask = before_mask
        packed, self._packed = self._packed, None
        if packed is not None and packed.sched is not sched:  # a failed step left it: nothing runs now
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # its arena twin is free only once the device is
            packed = None
        if packed is not None:
            return self._launch_graph_step(packed, structured)
        bucket = self._graph_bucket(sched)
        if bucket is not None:
            return self._launch_graph_step(self._pack_graph_step(sched, bucket, self._prev_index), structured)
        inputs = self.builder.build(sched, prev_sample_index=self._prev_index)
        if inputs.placeholder_rows is not None:
            inputs.input_ids[inputs.placeholder_rows] = self._prev_sampled[inputs.placeholder_src]
        if not inputs.sampled:
            hidden = self.executor.hidden_states(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
            self._prev_sampled, self._prev_index = None, {}
            return StepHandle(None, None, [], None, [], prompt_logprobs=self._score_prompts(sched, inputs, hidden))
        bufs = self._next_host_bufs()
        seqs = inputs.sampled
        plan = self.sampler.plan(sched, seqs)
        fused = self.sampler.fused_rows(plan, seqs)
        seeds = None
        if self.sampler.needs_seeds(plan, seqs):
            seeds = bufs["seeds"][: len(seqs)]
            self.sampler.draw_seeds(plan, seqs, seeds.numpy())
        hidden = self.executor.hidden_states(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        prompt_logprobs = self._score_prompts(sched, inputs, hidden)
        logits = self.executor.lm_head.logits(hidden[inputs.logits_indices], dtype=None)
        bitmask = self._step_bitmask(seqs, plan, structured)  # filled while the device runs the forward
        sampled, logprobs, logprob_rows = self.sampler.sample(logits, seqs, plan, fused, seeds, None, bufs, bitmask)
        handle = self._finish(seqs, inputs.sample_order, plan, sampled, logprobs, logprob_rows, bufs)
        handle.prompt_logprobs = prompt_logprobs
        return handle

    def _score_prompts(
        self, sched: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor
    ) -> StepPromptLogprobs | None:
        """The prompt logprobs of the step's rows that want them (sampling/prompt_logprobs.py), eagerly
        through the LM head in slices; None, at the cost of one comparison, for a step without a prompt
        chunk or a sequence that does not sample (no row of it can want them). Graph steps are decode
        steps whose every row samples: they never have such rows."""
        if not may_score_prompts(len(sched.sequences), sched.num_batched_tokens, len(inputs.sampled)):
            return None
        spans = prompt_spans(inputs.ordered)
        if not spans:
            return None
        return step_prompt_logprobs(hidden, spans, self.executor.lm_head.logits, self._prompt_rows)

    def _graph_bucket(self, sched: SchedulerOutput) -> int | None:
        """The decode graph bucket that runs this step: only decode-only steps (one token per row) whose
        every row samples (the graph's logits rows are the sampled rows) and that fit a captured bucket."""
        if self.graphs is None or sched.num_batched_tokens != len(sched.sequences):
            return None
        if not all(s.sample for s in sched.sequences):
            return None
        bucket = self.graphs.bucket(len(sched.sequences))
        if bucket is not None and not self.graphs.is_captured(bucket):
            self.graphs.want(bucket)  # this step runs eagerly; the engine captures the bucket before the next
            return None
        return bucket

    def prepare(self, sched: SchedulerOutput) -> None:
        """Pack `sched`, the step the engine launches next, now: called from inside the current launch's
        `before_mask` (the device still runs this step's forward), so that after this step's sampling is
        enqueued the next step's launch has only its enqueues left. Host work only: the packing of a graph
        decode step (`_pack_graph_step`) into the host arena twin that the step after this one would take,
        with this step's row index for its placeholder inputs. A step that is not a graph step is left to
        `launch`. The next `launch` must be of `sched`."""
        if self._window_index is None or sched.is_empty or self._packed is not None:
            return
        bucket = self._graph_bucket(sched)
        if bucket is not None:
            self._packed = self._pack_graph_step(sched, bucket, self._window_index)

    def _pack_graph_step(self, sched: SchedulerOutput, bucket: int, prev_index: dict[str, int]) -> _PackedStep:
        """A graph decode step's host work before its first enqueue: its inputs (with the sampler's
        temperatures, seeds and filters) packed into the next host twin of the graphs' input arena
        (`prev_index`: the row index of the step whose sampled ids its placeholder inputs read)."""
        graphs = self.graphs
        host, device = graphs.next_arenas(bucket)
        inputs = self.builder.build(
            sched, pad_decodes_to=bucket, prev_sample_index=prev_index, host_arena=host, device_arena=device
        )
        seqs = inputs.sampled
        n = len(seqs)
        plan = self.sampler.plan(sched, seqs)
        fused = self.sampler.fused_rows(plan, seqs)
        truncating = self.sampler.truncating_rows(plan, seqs) if graphs.sample_in_graph else []
        seeds = None
        if self.sampler.needs_seeds(plan, seqs):
            seeds = host.seeds[:n]
            self.sampler.draw_seeds(plan, seqs, host.arrays.seeds)
            host.arrays.temperatures[:n] = plan.host_temperatures
        if truncating:  # the graphs' truncating sampler reads every row's filters; padding rows: greedy
            arrays = host.arrays
            arrays.temperatures[n:bucket] = 0.0
            for region, values in zip((arrays.top_k, arrays.top_p, arrays.min_p), plan.host_filters):
                region[:n] = values
        return _PackedStep(sched, bucket, host, inputs, plan, fused, truncating, seeds)

    def _launch_graph_step(self, packed: _PackedStep, structured: StructuredOutputManager | None = None) -> StepHandle:
        """A decode step replayed as the graph of `bucket` rows, its inputs packed (`_pack_graph_step`):
        make the previous step's
        sampled ids readable by the graph's placeholder gather when the step needs them, copy the arena
        over in one copy, replay, then sample the rows the in-graph sampler does not serve (a step with rows
        for the truncating sampler replays its graph after the forward's, `DecodeGraphs.replay_truncating`,
        which then serves the plain fused rows as well). A step with constrained rows (a grammar,
        allowed_token_ids or bad_words) samples every row after the replay, from the graph's logits, under
        the bitmask filled while the graph runs; with the pruned LM head (batch 1, every row the fused
        sampler's), it replays the graph that stops at the hidden states and samples through the pruned
        head under the bitmask (`DecodeGraphs.replay_io_hidden`)."""
        graphs = self.graphs
        bucket, host, inputs, plan = packed.bucket, packed.host, packed.inputs, packed.plan
        fused, truncating, seeds = packed.fused, packed.truncating, packed.seeds
        bufs = self._next_host_bufs()
        seqs = inputs.sampled
        n = len(seqs)
        if inputs.num_placeholders:
            graphs.feed_previous_samples(self._prev_sampled)
        graph_ids = None
        constrained = bool(plan.masked_rows) or (
            structured is not None and structured.any_constrained([s.request_id for s in seqs])
        )
        if constrained and len(fused) == n and graphs.pruned_lm_head and graphs.runs_io(bucket):
            # the forward's graph, the bitmask filled while it runs, then the pruned LM head under it
            cascade = inputs.prefix_len > 0
            hidden, temperatures, dev_seeds, host_ids = graphs.replay_io_hidden(
                bucket, cascade, host, inputs.arena_bytes
            )
            bitmask = self._step_bitmask(seqs, plan, structured, on_device=False)
            ids = graphs.last_sampled[:bucket]
            if bitmask is None:  # no row removes a token after all
                self.executor.lm_head.sample_pruned(hidden, temperatures, dev_seeds, ids, host_ids)
            else:
                graphs.replay_masked_head(bucket, cascade, host, bitmask)
            return self._finish(seqs, inputs.sample_order, plan, ids[:n], None, None, bufs, host_ids[:n])
        cascade = inputs.prefix_len > 0
        io = graphs.runs_io(bucket)
        if io:
            # every row served by the in-graph sampler: no logits needed, the pruned LM head's graph if any
            logits, presampled, graph_ids = graphs.replay_io(
                bucket, cascade, host, inputs.arena_bytes, pruned=len(fused) == n and not constrained
            )
        else:
            graphs.load_inputs(host, inputs.arena_bytes, by_kernel=self._copies_by_kernel(n))
            logits, presampled = graphs.replay(bucket, cascade=cascade)
        if truncating and not constrained:  # the truncating sampler's graph serves the fused rows too
            presampled = graphs.replay_truncating(bucket, cascade, host if io else None)
            fused = fused + truncating
        else:
            truncating = []
        logits = None if logits is None else logits[:n]
        bitmask = self._step_bitmask(seqs, plan, structured) if constrained else None
        presampled = presampled[:n] if fused and graphs.sample_in_graph and bitmask is None else None
        sampled, logprobs, logprob_rows = self.sampler.sample(
            logits, seqs, plan, fused, seeds, presampled, bufs, bitmask, truncated_in=bool(truncating)
        )
        # The graph's own copy of the ids holds the step's tokens when its samplers served every row.
        graph_ids = graph_ids[:n] if graph_ids is not None and len(fused) == n and bitmask is None else None
        return self._finish(seqs, inputs.sample_order, plan, sampled, logprobs, logprob_rows, bufs, graph_ids)

    def _step_bitmask(
        self,
        seqs: list[ScheduledSequence],
        plan: FusedSamplingPlan,
        structured: StructuredOutputManager | None,
        on_device: bool = True,
    ) -> torch.Tensor | None:
        """The step's token bitmask [N, ceil(V / 32)] int32 on the device, in the sampled rows' order: the
        grammars' masks ANDed with allowed_token_ids and bad-word bans (sampling/logits_processors.py),
        all ones for other rows; None when no row removes tokens. Filled on the host into one of two
        pinned buffers (alternating, as the other host staging) and copied asynchronously (`on_device`
        False: that host buffer itself, for the caller's copy); with `before_mask`, the constrained rows'
        fill overlaps the acceptance of the in-flight step's tokens."""
        rids = [s.request_id for s in seqs]
        n = len(seqs)
        host = self._next_bitmask_buf(n, structured)
        if self._before_mask is not None and structured is not None and structured.has_grammar(rids):
            # the in-flight step's tokens are accepted inside before_mask; each row's mask is filled on the
            # manager's worker thread as soon as its token is in (StructuredOutputManager.begin_fill)
            structured.begin_fill(rids, host)
            self._window_index = plan.index
            try:
                self._before_mask()
            finally:
                self._window_index = None
                rows = structured.finish_fill()
        else:
            rows = structured.constrained_rows(rids) if structured is not None else []
            if rows:
                structured.fill(rids, rows, host)
        if not rows and not plan.masked_rows:
            return None
        if not rows:
            host.fill_(-1)
        apply_to_bitmask(seqs, plan.masked_rows, host.numpy(), self.sampler.vocab_size)
        if not on_device or self.device.type != "cuda":
            return host
        return host.to(self.device, non_blocking=True)

    def _next_bitmask_buf(self, n: int, structured: StructuredOutputManager | None = None) -> torch.Tensor:
        """This step's host bitmask [n, ceil(V / 32)] int32: one of two pinned buffers, alternating as the
        other host staging does (a buffer is rewritten only after its copy has run). With a grammar
        manager, its buffers (shared with its grammar workers, if any)."""
        bufs = self._bitmask_bufs
        if not bufs or bufs[0].shape[0] < n or (structured is not None and not structured.fills_into(bufs[0])):
            rows = max(self.builder_rows, n)
            pin = self.device.type == "cuda"
            if structured is not None:
                self._bitmask_bufs = structured.host_masks(rows, pin)
            else:
                shape = (rows, bitmask_width(self.sampler.vocab_size))
                self._bitmask_bufs = [torch.empty(shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        return self._bitmask_bufs[self._num_launched % 2][:n]

    def _next_host_bufs(self) -> dict[str, torch.Tensor]:
        """This step's set of the runner's host staging (the two alternate between sampled steps)."""
        bufs = self._host_bufs[self._num_launched % 2]
        self._num_launched += 1
        return bufs

    def _finish(
        self,
        seqs: list[ScheduledSequence],
        sample_order: list[int],
        plan: FusedSamplingPlan,
        sampled: torch.Tensor,
        logprobs: LogprobsTensors | None,
        logprob_rows: list[int] | None,
        bufs: dict[str, torch.Tensor],
        graph_ids: torch.Tensor | None = None,
    ) -> StepHandle:
        """Keep this step's sampled ids for the next step's placeholders, enqueue their copy to the host
        (and an event after it, on CUDA), and return the step's handle. `graph_ids`: the same ids, already
        being written into pinned host memory by the step's graph (no copy)."""
        if self.group is not None:  # rank 0's ids (its grammars' masks applied) are every rank's
            sampled = self.group.broadcast_(sampled if sampled.is_contiguous() else sampled.contiguous())
            graph_ids = None
        self._prev_sampled = sampled
        self._prev_index = plan.index
        event = None
        if self.device.type == "cuda":
            host = graph_ids
            if host is None:
                host = bufs["ids"][: sampled.shape[0]]
                if self._copies_by_kernel(sampled.shape[0]) and sampled.dtype == host.dtype and sampled.is_contiguous():
                    from tinyvllm.kernels.host_copy import kernel_copy_

                    kernel_copy_(host, sampled)
                else:
                    host.copy_(sampled, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # already on the host; but a graph's ids are static buffers that later steps rewrite
            host = sampled if self.graphs is None else (sampled if graph_ids is None else graph_ids).clone()
        num_logprobs = []
        if logprobs is not None:
            covered = seqs if logprob_rows is None else [seqs[i] for i in logprob_rows]
            num_logprobs = [s.sampling_params.logprobs for s in covered]
        return StepHandle(host, event, sample_order, logprobs, num_logprobs, logprob_rows)

    def _copies_by_kernel(self, rows: int) -> bool:
        """Whether a step of `rows` sampled rows moves its inputs and ids by kernels (`kernel_copy_max_rows`)."""
        triton_on_cuda = self.kernel_backend == "triton" and self.device.type == "cuda"
        return triton_on_cuda and rows <= self.config.kernel_copy_max_rows


@dataclass
class _PackedStep:
    """A graph decode step packed on the host, not yet enqueued (ModelRunner._pack_graph_step)."""

    sched: SchedulerOutput
    bucket: int
    host: InputArena  # the host twin its inputs are in
    inputs: StepInputs
    plan: FusedSamplingPlan
    fused: list[int]  # rows of the fused greedy/Gumbel sampler
    truncating: list[int]  # rows of the graphs' truncating sampler
    seeds: torch.Tensor | None  # the fused samplers' seeds ([n] of the twin), when one serves a row


def sharded_runner_config(config: RunnerConfig) -> RunnerConfig:
    """`config` with the paths that read whole weights, or sample inside a graph, off (module docstring)."""
    return dataclasses.replace(
        config,
        fused_gemv=False,
        decode_megakernel=False,
        rows_megakernel=False,
        pruned_lm_head=False,
        graph_io_max_rows=0,
        sample_in_lm_head=False,
    )
