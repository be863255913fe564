"""The rows megakernel path: a decode step of 2–16 sequences as one kernel launch (kernels/rows_megakernel).

    hidden = rows(input_ids, positions, meta, kv_caches)    # [T, H], final norm applied

It reads the batch-1 megakernel's stacked weights (paths/megakernel.stack_weights; shared when both
paths are on). The result equals the layer loop's up to the order of the float32 sums.
"""

from __future__ import annotations

import torch
from triton.runtime.errors import OutOfResources

from tinyvllm.engine.paths.megakernel import MegakernelDoesNotFit, linear_layers, model_shape
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.decode_megakernel import StackedWeights
from tinyvllm.kernels.launch import num_sms
from tinyvllm.kernels.rows_megakernel import (
    MAX_ROWS,
    RowsConfig,
    RowsWorkspace,
    rows_megakernel_fwd,
    rows_unsupported_reason,
)
from tinyvllm.models.decoder import CausalLM
from tinyvllm.quantization.linear import Fp8Linear


def rows_unsupported(model: CausalLM, config: RowsConfig | None = None) -> str | None:
    """Why the rows megakernel cannot run this model (None: it can)."""
    if model.ops.name != "triton":
        return f"the {model.ops.name!r} kernel backend"
    if len({isinstance(m, Fp8Linear) for m in linear_layers(model)}) > 1:
        return "FP8 weights on some decoder linear layers only"
    return rows_unsupported_reason(model_shape(model), model.embed_tokens.weight.dtype, config or RowsConfig())


def serves(num_rows: int, meta: AttnMetadata) -> bool:
    """Whether a step of `num_rows` token rows is one the rows megakernel serves: 2 to MAX_ROWS decode
    tokens, no prefill."""
    return 2 <= num_rows <= MAX_ROWS and meta.num_decode_tokens == num_rows and meta.num_prefills == 0


class RowsMegakernel:
    """The rows megakernel over a model's stacked weights, with its workspace."""

    def __init__(self, model: CausalLM, weights: StackedWeights, config: RowsConfig | None = None) -> None:
        self.model = model
        self.weights = weights
        self.shape = model_shape(model)
        self.eps = model.config.rms_norm_eps
        self.scale = self.shape.head_dim**-0.5
        self.config = config or RowsConfig()
        device = weights.qkv.device
        programs = 1  # the interpreter runs programs one after another: one program does every unit
        if device.type == "cuda":
            programs = num_sms(device)
            if self.config.programs > 0:
                programs = min(programs, self.config.programs)
        self.workspace = RowsWorkspace(self.shape, weights.dtype, device, programs, self.config)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        trace: bool = False,
    ) -> torch.Tensor:
        """A decode step of T ≤ MAX_ROWS sequences (`serves`) → final hidden states [T, H]. `trace`: record
        the phase timer in workspace.trace (see rows_megakernel_fwd). Raises
        MegakernelDoesNotFit, before launching anything, where the compiled kernel needs more shared memory
        than the GPU has."""
        try:
            return rows_megakernel_fwd(
                input_ids,
                positions,
                meta.slot_mapping,
                meta.decode_seq_lens,
                meta.decode_block_tables,
                self.weights,
                self.model.cos_sin,
                kv_caches,
                self.shape,
                self.eps,
                self.scale,
                self.workspace,
                trace,
            )
        except OutOfResources as e:
            raise MegakernelDoesNotFit(f"{e} (RowsConfig {self.config})") from e
