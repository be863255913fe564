"""The megakernel path: a decode step of one sequence as one kernel launch (kernels/decode_megakernel).

`DecodeMegakernel(model)` restacks the layers' weights into one [L, ...] tensor per kind (the
layers' parameters become views of it, so no second copy stays), allocates the kernel's workspace, and
is then called in place of the layer loop for a decode step of one sequence:

    hidden = megakernel(input_ids, positions, meta, kv_caches)    # [1, H], final norm applied

The result equals the fused small-batch path (paths/fused.py) up to the order of the float32 sums. With
FP8 weights both compute x · dequant(W) with the activations unquantized (docs/fp8.md); with an FP8 KV
cache the kernel writes and reads it with each layer's k_scale and v_scale.
"""

from __future__ import annotations

import copy

import torch
from triton.runtime.errors import OutOfResources

from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.decode_megakernel import (
    MegakernelConfig,
    ModelShape,
    StackedWeights,
    Workspace,
    decode_megakernel_fwd,
    max_programs,
    unsupported_reason,
)
from tinyvllm.models.decoder import CausalLM
from tinyvllm.quantization.linear import Fp8Linear


class MegakernelDoesNotFit(RuntimeError):
    """The compiled decode megakernel needs more of an SM (shared memory) than this GPU gives one program."""


def model_shape(model: CausalLM) -> ModelShape:
    c = model.config
    return ModelShape(
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        qkv_bias=c.qkv_bias,
        qk_norm=c.qk_norm,
        window=c.sliding_window if c.has_sliding_window else None,
        all_windowed=c.all_layers_sliding,
    )


def linear_layers(model: CausalLM) -> list[torch.nn.Module]:
    """Every decoder layer's four linear layers."""
    out = []
    for layer in model.layers:
        out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return out


def megakernel_unsupported(model: CausalLM) -> str | None:
    """Why the megakernel cannot run this model (None: it can). FP8 weights are served where every decoder
    linear layer is FP8 (a checkpoint that leaves some of them unquantized runs the other paths)."""
    if model.ops.name != "triton":
        return f"the {model.ops.name!r} kernel backend"
    fp8 = {isinstance(m, Fp8Linear) for m in linear_layers(model)}
    if len(fp8) > 1:
        return "FP8 weights on some decoder linear layers only"
    return unsupported_reason(model_shape(model), model.embed_tokens.weight.dtype)


def _stack(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One [L, ...] tensor holding `params`, which become views of it (one layer's copy in flight)."""
    first = params[0]
    stacked = torch.empty((len(params), *first.shape), dtype=first.dtype, device=first.device)
    for i, p in enumerate(params):
        stacked[i].copy_(p.data)
        p.data = stacked[i]
    return stacked


def stack_weights(model: CausalLM) -> StackedWeights:
    """Every layer's weights of one kind restacked into one [L, ...] tensor (the layers' parameters become
    views of it), with the family tensors the model's config calls for: the layout both megakernels
    read."""
    layers = model.layers
    attn = [layer.self_attn for layer in layers]
    mlp = [layer.mlp for layer in layers]
    c = model.config
    with torch.no_grad():
        family = {}
        if c.qkv_bias:
            family["qkv_bias"] = _stack([a.qkv_proj.bias for a in attn])
        if c.qk_norm:
            family["q_norm"] = _stack([a.q_norm.weight for a in attn])
            family["k_norm"] = _stack([a.k_norm.weight for a in attn])
        device = model.embed_tokens.weight.device
        if c.has_sliding_window:
            windowed = [c.attention_window(i) is not None for i in range(c.num_hidden_layers)]
            family["sliding"] = torch.tensor(windowed, dtype=torch.int32, device=device)
        if isinstance(attn[0].qkv_proj, Fp8Linear):  # every layer's, by megakernel_unsupported
            family["qkv_scale"] = _stack([a.qkv_proj.weight_scale for a in attn])
            family["o_scale"] = _stack([a.o_proj.weight_scale for a in attn])
            family["gate_up_scale"] = _stack([m.gate_up_proj.weight_scale for m in mlp])
            family["down_scale"] = _stack([m.down_proj.weight_scale for m in mlp])
        # an FP8 cache's scales (read only when the cache is FP8): fixed once the weights are loaded
        kv = [[a.k_scale, a.v_scale] for a in attn]
        family["kv_scales"] = torch.tensor(kv, dtype=torch.float32, device=device)
        return StackedWeights(
            embed=model.embed_tokens.weight,
            qkv=_stack([a.qkv_proj.weight for a in attn]),
            o=_stack([a.o_proj.weight for a in attn]),
            gate_up=_stack([m.gate_up_proj.weight for m in mlp]),
            down=_stack([m.down_proj.weight for m in mlp]),
            norm1=_stack([layer.input_layernorm.weight for layer in layers]),
            norm2=_stack([layer.post_attention_layernorm.weight for layer in layers]),
            norm_final=model.norm.weight,
            **family,
        )


class DecodeMegakernel:
    def __init__(
        self, model: CausalLM, config: MegakernelConfig | None = None, weights: StackedWeights | None = None
    ) -> None:
        """`weights`: the model's stacks where another path made them already (`stack_weights`)."""
        config = config or MegakernelConfig()
        self.weights = weights if weights is not None else stack_weights(model)
        self.model = model
        self.shape = model_shape(model)
        self.eps = model.config.rms_norm_eps
        self.scale = self.shape.head_dim**-0.5
        self.config = config
        device = self.weights.qkv.device
        self.workspace = Workspace(self.shape, self.weights.dtype, device, max_programs(device, config))

    def variant(self, config: MegakernelConfig, num_splits: int | None = None) -> DecodeMegakernel:
        """The same stacked weights under another launch configuration (benchmarks), own workspace
        (`num_splits` context splits per KV head; None: the default)."""
        other = copy.copy(self)
        other.config = config
        device = self.weights.qkv.device
        other.workspace = Workspace(self.shape, self.weights.dtype, device, max_programs(device, config), num_splits)
        return other

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        trace: bool = False,
    ) -> torch.Tensor:
        """A decode step of one sequence (meta.num_decode_tokens == 1) → final hidden state [1, H].
        `trace`: record the phase timer in workspace.trace (see decode_megakernel_fwd). Raises
        MegakernelDoesNotFit, before launching anything, where the compiled kernel needs more shared memory
        than the GPU has (Triton checks at the first launch; the runner then runs the layers one by one)."""
        try:
            return decode_megakernel_fwd(
                input_ids,
                positions,
                meta.slot_mapping,
                meta.decode_seq_lens,
                meta.decode_block_tables[0],
                self.weights,
                self.model.cos_sin,
                kv_caches,
                self.shape,
                self.eps,
                self.scale,
                self.workspace,
                self.config,
                trace,
            )
        except OutOfResources as e:
            raise MegakernelDoesNotFit(f"{e} (MegakernelConfig {self.config})") from e
