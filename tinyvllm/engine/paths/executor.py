"""Which path computes a step's hidden states and logits: chosen from the step's shape and the config.

| step                                      | hidden states                     | logits / sampled ids          |
|-------------------------------------------|-----------------------------------|-------------------------------|
| decode, one sequence, megakernel on       | paths/megakernel.py (one launch)  | LM head, fused product        |
| decode, 2–16 sequences, `rows_megakernel` | paths/rows_megakernel.py          | LM head, cuBLAS               |
| ≤ `fused_max_tokens` rows, `fused_gemv`   | paths/fused.py                    | LM head, fused product        |
| anything else                             | the model's layer loop            | LM head, cuBLAS               |

Batch-1 decode graph steps may sample through the pruned LM head instead (paths/lm_head.py). With `pdl`
(kernels/pdl.py) the fused path and the layer loop launch our kernels as programmatic dependents: in the
fused path every kernel, in the layer loop those that follow another of ours (the cache write → attention
→ its merge), since cuBLAS's kernels release no dependent early. Every path
computes the model's maths with the model's parameters; they differ only in the order of float32 sums.
With `batch_invariant` every step takes the layer loop over the ops table's batch-invariant ops: the
fused path, the megakernel and the pruned LM head are off (each has its own order of sums, chosen by the
step's shape).

FP8 (docs/fp8.md): with FP8 linear layers the megakernel and the fused path (Triton table) read the FP8
weights with their row scales and compute x · dequant(W) with the activations unquantized; the layer
loop's FP8 layers compute x_q · W_q with the activations quantized per token (both within FP8's error of
the unquantized model). The megakernel reads and writes an FP8 KV cache itself; the fused path's
attention is the model's own. With the torch table the fused path stays off for FP8 weights (its
reference product takes weights in the model's dtype).

| FP8                   | megakernel | fused path          | layer loop |
|-----------------------|------------|---------------------|------------|
| weights               | on         | on (Triton table)   | x_q · W_q  |
| KV cache              | on         | on                  | on         |
"""

from __future__ import annotations

import logging

import torch

from tinyvllm.config import RunnerConfig
from tinyvllm.distributed.group import TPGroup
from tinyvllm.engine.paths.fused import fused_forward
from tinyvllm.engine.paths.lm_head import LMHead
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.pdl import programmatic_launches
from tinyvllm.models.decoder import CausalLM, KVCache
from tinyvllm.quantization.linear import has_fp8_linear

logger = logging.getLogger(__name__)


def wants_megakernel(config: RunnerConfig, device_type: str, hidden_size: int, fp8_weights: bool = False) -> bool:
    """Whether to try the decode megakernel: only on CUDA; `decode_megakernel=None` means hidden sizes up
    to `megakernel_max_hidden`, and with FP8 weights (`fp8_weights`) powers of two only: the padded sizes
    were timed against the fused path in bf16 (faster), not yet with FP8 weights. The model may still be
    one it cannot serve (megakernel_unsupported)."""
    if device_type != "cuda" or config.decode_megakernel is False or config.batch_invariant:
        return False
    if config.decode_megakernel is True:
        return True
    if fp8_weights and hidden_size & (hidden_size - 1):
        return False
    return hidden_size <= config.megakernel_max_hidden


class ModelExecutor:
    """Runs a model by the path each step's shape calls for (module docstring).

    Build it after the weights are loaded: the megakernel restacks the layer weights and the pruned LM
    head copies the LM head's, so both happen here, before the runner profiles memory.

    Args:
        model: the loaded model.
        config: the runner's configuration (which paths are on, and their thresholds).
        device_type: "cuda" or "cpu"; the megakernel and the pruned LM head are CUDA paths.
        kv_cache_dtype: the KV cache's dtype (None: the model's); every path reads an FP8 cache.
        group: the tensor-parallel group of a sharded model, whose LM head gathers the logits' columns
            (the runner turns the paths that read whole weights off: model_runner.sharded_runner_config).
    """

    def __init__(
        self,
        model: CausalLM,
        config: RunnerConfig,
        device_type: str,
        kv_cache_dtype: torch.dtype | None = None,
        group: TPGroup | None = None,
    ) -> None:
        self.model = model
        self.ops = model.ops
        fp8_weights = has_fp8_linear(model)
        fp8_gemv = not fp8_weights or model.ops.name == "triton"  # paths/fused.py: our FP8 kernel
        fused = config.fused_gemv and model.ops.fused_gemv is not None and not config.batch_invariant and fp8_gemv
        if config.fused_gemv and not fp8_gemv:
            logger.info("fused matrix-vector path off: FP8 weights need the Triton kernels (the layer loop runs)")
        self.fused_max_tokens = config.fused_max_tokens if fused else 0
        self.pdl = config.pdl and device_type == "cuda" and model.ops.name == "triton"
        self.megakernel = None
        if wants_megakernel(config, device_type, model.config.hidden_size, fp8_weights):
            self.megakernel = self._build_megakernel()
        self.rows_megakernel = None
        if config.rows_megakernel and device_type == "cuda" and not config.batch_invariant:
            self.rows_megakernel = self._build_rows_megakernel()
        # The int8 copy serves only the batch-1 decode graphs that load their own inputs and sample inside
        # the LM head (engine/cuda_graphs.py).
        pruned = (
            config.pruned_lm_head
            and not config.batch_invariant
            and config.cuda_graphs
            and device_type == "cuda"
            and config.graph_io_max_rows == 1
            and config.sample_in_lm_head
            and model.config.hidden_size % 4 == 0
        )
        self.lm_head = LMHead(
            model.lm_head_weight, model.ops, self.fused_max_tokens, pruned=pruned, group=group, pdl=self.pdl
        )

    def _build_megakernel(self):
        from tinyvllm.engine.paths.megakernel import DecodeMegakernel, megakernel_unsupported

        reason = megakernel_unsupported(self.model)
        if reason is not None:
            logger.info("decode megakernel off: %s", reason)
            return None
        megakernel = DecodeMegakernel(self.model)
        torch.cuda.empty_cache()  # the restacking leaves the layers' old storage behind
        return megakernel

    def _build_rows_megakernel(self):
        from tinyvllm.engine.paths.megakernel import stack_weights
        from tinyvllm.engine.paths.rows_megakernel import RowsMegakernel, rows_unsupported

        reason = rows_unsupported(self.model)
        if reason is not None:
            logger.info("rows megakernel off: %s", reason)
            return None
        weights = self.megakernel.weights if self.megakernel is not None else stack_weights(self.model)
        torch.cuda.empty_cache()  # the restacking leaves the layers' old storage behind
        return RowsMegakernel(self.model, weights)

    def uses_fused_path(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` token rows runs the fused small-batch path."""
        return 0 < num_rows <= self.fused_max_tokens

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, H], by the step's path."""
        if self.megakernel is not None and input_ids.shape[0] == 1 and meta.num_decode_tokens == 1:
            from tinyvllm.engine.paths.megakernel import MegakernelDoesNotFit

            try:
                return self.megakernel(input_ids, positions, meta, kv_caches)
            except MegakernelDoesNotFit as e:  # raised before anything ran: the other paths from now on
                logger.warning("decode megakernel off: %s", e)
                self.megakernel = None
        if self.rows_megakernel is not None:
            from tinyvllm.engine.paths.megakernel import MegakernelDoesNotFit
            from tinyvllm.engine.paths.rows_megakernel import serves

            if serves(input_ids.shape[0], meta):
                try:
                    return self.rows_megakernel(input_ids, positions, meta, kv_caches)
                except MegakernelDoesNotFit as e:  # raised before anything ran: the other paths from now on
                    logger.warning("rows megakernel off: %s", e)
                    self.rows_megakernel = None
        with programmatic_launches(self.pdl):
            if self.uses_fused_path(input_ids.shape[0]):
                return fused_forward(self.model, input_ids, positions, meta, kv_caches, pdl=self.pdl)
            return self.model(input_ids, positions, meta, kv_caches)
