"""The FP8 linear layer, and the factory by which the decoder's layers learn their quantization.

`Fp8Linear` holds W as float8_e4m3fn [N, K] with one float32 scale per output row (per-tensor checkpoint
scales become per-row scales, so a fused QKV or gate/up layer keeps each source matrix's scale on its
rows) and computes, for x [..., K] in the model's dtype:

    q_x, s_x = quantize(x)          per token (dynamic), per tensor (dynamic), or x / input_scale (static)
    y = (s_x · s_W) ⊙ (q_x q_Wᵀ) + b   in float32, rounded to the model's dtype

On CUDA (sm_89+, bf16 output, K and N multiples of 16) the product is one `torch._scaled_mm` (cuBLASLt
FP8 tensor cores with row-wise scales) and per-token activation quantization a Triton kernel
(kernels/fp8_quant.py); elsewhere (the CPU, other shapes) the same maths runs in float32 on the
dequantized operands, the reference the GPU path is checked against.

A layer that quantizes per token at run time (`takes_fp8_activations`) also takes its input already
quantized, as `Fp8Activations` (`forward_quantized`): the decoder has the RMSNorm or SwiGLU kernel that
produces the input write (q_x, s_x) directly, the same bits quantize_input would compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyvllm.quantization.config import QuantizationConfig
from tinyvllm.quantization.fp8 import FP8_DTYPE, amax_scale, quantize_rows, to_fp8

if TYPE_CHECKING:
    from tinyvllm.distributed.group import TPGroup


@dataclass(frozen=True)
class Fp8Activations:
    """A linear layer's input quantized per token: x[m, :] ≈ q[m, :] · scale[m] (quantization/fp8.py)."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M] float32


class Fp8Linear(nn.Module):
    """y = x Wᵀ + b with FP8 W and FP8 activations (module docstring).

    Args:
        in_features, out_features: K and N.
        bias: whether the layer has a bias (kept in `dtype`).
        dtype: the model's dtype: the input's, the output's and the bias's.
        activation_strategy: "token" or "tensor".
        activation_dynamic: scales from x at run time; False: the loaded `input_scale`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        activation_strategy: str = "token",
        activation_dynamic: bool = True,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype = dtype
        self.activation_strategy = activation_strategy
        self.activation_dynamic = activation_dynamic
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.input_scale = None
        if not activation_dynamic:
            self.input_scale = nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    @property
    def activation_scheme(self) -> str:
        """How the input is quantized, in words: "token, dynamic", "tensor, static", ..."""
        return f"{self.activation_strategy}, {'dynamic' if self.activation_dynamic else 'static'}"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fp8 activations {self.activation_scheme}"
        )

    @property
    def quantizes_per_token(self) -> bool:
        """Whether the input is quantized per token at run time (dynamic, strategy "token"), which is what
        `forward_quantized` takes."""
        return self.activation_dynamic and self.activation_strategy == "token"

    def dequantized_weight(self) -> torch.Tensor:
        """W ≈ q_W · s_W as float32 [N, K]."""
        return self.weight.to(torch.float32) * self.weight_scale[:, None]

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] → (q_x [M, K] float8_e4m3fn, s_x [M] float32)."""
        M = x.shape[0]
        if not self.activation_dynamic:
            scale = self.input_scale.expand(M)
            return to_fp8(x, self.input_scale), scale
        if self.activation_strategy == "tensor":
            scale = amax_scale(x.abs().amax())
            return to_fp8(x, scale), scale.expand(M)
        if x.is_cuda:
            from tinyvllm.kernels.fp8_quant import quantize_per_token

            return quantize_per_token(x)
        return quantize_rows(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        q, s_x = self.quantize_input(x2)
        y = fp8_matmul(q, s_x, self.weight, self.weight_scale, self.bias, self.out_dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def forward_quantized(self, x: Fp8Activations) -> torch.Tensor:
        """y [M, N] for an input the caller quantized per token (q [M, K], scale [M]): forward's product
        without its quantize_input. Only for a layer that `quantizes_per_token`."""
        if not self.quantizes_per_token:
            raise ValueError(f"forward_quantized takes dynamic per-token activations, not {self.activation_scheme}")
        if x.q.dim() != 2 or x.q.shape[1] != self.in_features or x.scale.shape != x.q.shape[:1]:
            raise ValueError(f"expected q [M, {self.in_features}] and scale [M], got {x.q.shape}, {x.scale.shape}")
        return fp8_matmul(x.q, x.scale, self.weight, self.weight_scale, self.bias, self.out_dtype)


def scaled_mm_supported(q: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether `torch._scaled_mm` with row-wise scales takes this product: CUDA sm_89+, bf16 output,
    K and N multiples of 16 (cuBLASLt's FP8 alignment)."""
    if not q.is_cuda or out_dtype != torch.bfloat16 or not hasattr(torch, "_scaled_mm"):
        return False
    N, K = weight.shape
    return K % 16 == 0 and N % 16 == 0 and torch.cuda.get_device_capability(q.device) >= (8, 9)


def fp8_matmul(
    q: torch.Tensor,
    s_x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y [M, N] = (s_x ⊗ s_W) ⊙ (q q_Wᵀ) (+ bias), rounded to out_dtype.

    q [M, K], weight [N, K] float8_e4m3fn; s_x [M], weight_scale [N] float32."""
    if scaled_mm_supported(q, weight, out_dtype):
        # cuBLASLt wants the second operand column-major: weight.t() of a row-major [N, K] is exactly that.
        y = torch._scaled_mm(
            q,
            weight.t(),
            scale_a=s_x.reshape(-1, 1).to(torch.float32).contiguous(),
            scale_b=weight_scale.reshape(1, -1).contiguous(),
            bias=bias,
            out_dtype=out_dtype,
        )
        return y
    y = (q.to(torch.float32) @ weight.to(torch.float32).t()) * (s_x.reshape(-1, 1) * weight_scale.reshape(1, -1))
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


def make_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    dtype: torch.dtype,
    quant: QuantizationConfig | None,
    hf_modules: tuple[str, ...],
    reduce_group: TPGroup | None = None,
) -> nn.Module:
    """The layer for the Hugging Face module(s) `hf_modules` (several for a fused layer): nn.Linear, or
    Fp8Linear when `quant` quantizes them. Fused modules must be all quantized or all ignored.

    The layer knows its tensor-parallel role through `reduce_group`: a row-parallel layer (it holds some
    of the input features, so its product is a partial sum) names the group whose all-reduce completes
    it; None for a whole or a column-parallel layer (`apply_linear` in models/decoder.py reads it)."""
    layer = _make_layer(in_features, out_features, bias=bias, dtype=dtype, quant=quant, hf_modules=hf_modules)
    layer.reduce_group = reduce_group
    return layer


def _make_layer(
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    dtype: torch.dtype,
    quant: QuantizationConfig | None,
    hf_modules: tuple[str, ...],
) -> nn.Module:
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    ignored = {quant.is_ignored(m) for m in hf_modules}
    if len(ignored) > 1:
        raise ValueError(
            f"quantization_config.ignore lists some but not all of {list(hf_modules)}, which tinyvllm runs as one "
            "fused layer; ignore all of them or none"
        )
    if ignored.pop():
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return Fp8Linear(
        in_features,
        out_features,
        bias=bias,
        dtype=dtype,
        activation_strategy=quant.activation_strategy,
        activation_dynamic=quant.activation_dynamic,
    )


def takes_fp8_activations(layer: nn.Module) -> bool:
    """Whether `layer` takes its input quantized per token (Fp8Activations, Fp8Linear.forward_quantized)."""
    return isinstance(layer, Fp8Linear) and layer.quantizes_per_token


def has_fp8_linear(model: nn.Module) -> bool:
    """Whether any of the model's layers is an Fp8Linear."""
    return any(isinstance(m, Fp8Linear) for m in model.modules())
