"""The FP8 model's layer loop (the batched path: activations quantized per token, x_q · W_q) with the
quantization of qkv_proj's, gate_up_proj's and down_proj's inputs fused into RMSNorm and SwiGLU
(models/decoder.py, `fused_fp8_quant`), on the Triton table (the CPU interpreter without CUDA).

Against the same model with every FP8 layer quantizing its own input (`fused_fp8_quant=False`): the fused
kernels write the codes and scales the layer would compute (tests/kernels/test_fp8_fused_quant.py), so the
hidden states, logits and KV caches are the same bits, and so are greedy tokens end to end.

Against references on the torch table (tolerances of test_megakernel_fp8.py):
  * the dequantized model (fp8_pair: plain layers holding q_W · s_W, activations not quantized) differs by
    the activations' FP8 rounding alone, √8 · ε ≈ 7 % over the 2 layers × 4 products (measured 5–8 %):
    bound 0.14 (twice that, the bound test_megakernel_fp8 gives √8 rounded operands), and above 2e-2, so
    the activations are quantized at all;
  * in float32, the torch table's layer loop over the same FP8 layers (the same quantized maths, Fp8Linear's
    reference product): only the order of float32 sums differs, 1e-5 (measured 2e-7; it also shows no
    activation rounded to a different code).
In bfloat16 the second comparison is not that tight: the interpreter converts float32 → bf16 by truncation
where torch rounds to nearest, so ~70 % of the norm's bf16 outputs differ in the last bit and ~5 % of their
e4m3 codes are one step apart (either rounding is correct), which moves the logits by ~7 %, as much as the
activations' FP8 rounding itself; there it is held to the same 0.14.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_fused_path import backends, batch, caches, device_for, run
from tests.engine.test_megakernel_fp8 import fp8_pair
from tests.engine.test_megakernel_path import rel
from tinyvllm.kernels import get_ops
from tinyvllm.models.decoder import CausalLM
from tinyvllm.quantization.linear import Fp8Linear

needs_triton = pytest.mark.skipif("triton" not in backends(), reason="needs CUDA or TRITON_INTERPRET=1")


def copy_of(model: CausalLM, backend: str, fused_fp8_quant: bool) -> CausalLM:
    """`model`'s weights and scales in a new model on `backend`'s table, with the fusion on or off."""
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    with torch.device(device):
        copy = CausalLM(
            model.config, get_ops(backend), model.max_positions, dtype, model.quant, fused_fp8_quant=fused_fp8_quant
        )
    copy.load_state_dict(model.state_dict())
    copy.init_rope_table()
    return copy.eval()


def counting_quantize_input(monkeypatch) -> list[int]:
    """Patch Fp8Linear.quantize_input to count its calls (the layers that quantize their own input)."""
    calls = [0]
    original = Fp8Linear.quantize_input

    def counted(self, x):
        calls[0] += 1
        return original(self, x)

    monkeypatch.setattr(Fp8Linear, "quantize_input", counted)
    return calls


@needs_triton
@pytest.mark.parametrize(
    "dtype,preset,kind",
    [
        (torch.float32, "tiny", "mixed"),  # a decode row and a 6-row prompt chunk
        (torch.bfloat16, "tiny", "decode"),  # 3 decode rows
        (torch.float32, "tiny-qwen3", "decode"),  # q/k norm (RMSNorm on the heads) unchanged
        (torch.bfloat16, "tiny-qwen2", "mixed"),  # the qkv bias after the row scales
    ],
)
def test_fused_quantization_gives_the_unfused_bits(dtype, preset, kind, monkeypatch):
    device = device_for("triton")
    fused, dequantized = fp8_pair(dtype, device, preset=preset)
    unfused = copy_of(fused, "triton", fused_fp8_quant=False)
    reference = copy_of(fused, "torch", fused_fp8_quant=False)
    layer = fused.layers[0]
    assert layer.quantize_qkv_input and layer.quantize_gate_up_input and layer.mlp.quantize_down_input
    assert not unfused.layers[0].quantize_qkv_input and not unfused.layers[0].mlp.quantize_down_input
    ids, positions, meta = batch(kind, device)
    kv = caches(fused, dtype, device)
    calls = counting_quantize_input(monkeypatch)
    h, logits, kv_out = run(fused, False, ids, positions, meta, kv)
    assert calls[0] == 2, "only o_proj, once per layer, quantizes its own input"
    h0, logits0, kv0 = run(unfused, False, ids, positions, meta, kv)
    assert calls[0] == 2 + 8
    assert torch.equal(h, h0) and torch.equal(logits, logits0)
    assert all(torch.equal(a, b) for x, y in zip(kv_out, kv0) for a, b in zip(x, y))
    _, logits_dq, _ = run(dequantized, False, ids, positions, meta, kv)
    assert 2e-2 < rel(logits, logits_dq) <= 0.14, rel(logits, logits_dq)
    h_ref, logits_ref, _ = run(reference, False, ids, positions, meta, kv)
    tol = 1e-5 if dtype == torch.float32 else 0.14
    assert rel(h, h_ref) <= tol and rel(logits, logits_ref) <= tol, (rel(h, h_ref), rel(logits, logits_ref))


def test_only_per_token_dynamic_layers_take_quantized_inputs():
    """Static or per-tensor activation scales, and bf16 layers, keep their own quantization (or none)."""
    from tinyvllm.config import ModelConfig
    from tinyvllm.models.checkpoint import make_config
    from tinyvllm.quantization.config import QuantizationConfig

    config = ModelConfig.from_dict(make_config("tiny", num_hidden_layers=2))
    for quant, fused in (
        (None, False),
        (QuantizationConfig(), True),
        (QuantizationConfig(activation_strategy="tensor"), False),
        (QuantizationConfig(activation_strategy="tensor", activation_dynamic=False), False),
    ):
        model = CausalLM(config, get_ops("torch"), 64, torch.float32, quant=quant)
        layer = model.layers[1]
        assert layer.quantize_qkv_input == layer.quantize_gate_up_input == layer.mlp.quantize_down_input == fused
    ignored = QuantizationConfig(ignore=("lm_head", "re:.*down_proj"))
    model = CausalLM(config, get_ops("torch"), 64, torch.float32, quant=ignored)
    assert model.layers[0].quantize_gate_up_input and not model.layers[0].mlp.quantize_down_input
    layer = Fp8Linear(16, 16, bias=False, dtype=torch.float32, activation_strategy="tensor")
    with pytest.raises(ValueError, match="per-token"):
        layer.forward_quantized(None)


@needs_triton
def test_greedy_tokens_end_to_end_with_and_without_fusion(tmp_path):
    """`quantization="fp8"` through the LLM on the Triton table: three prompts decoded together (3 rows:
    the layer loop, not the batch-1 paths) give the same greedy tokens with the fusion turned off."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=7, init_std=0.1, dtype="bfloat16")
    llm = LLM(
        model=str(tmp_path),
        device=str(device_for("triton")),
        max_model_len=64,
        kernel_backend="triton",
        quantization="fp8",
        block_size=4,
        enforce_eager=True,  # the flags below are read at each launch, not frozen in a captured graph
    )
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [40, 41, 42, 43]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def greedy() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = greedy()
    for layer in llm.llm_engine.runner.model.layers:
        assert layer.quantize_qkv_input and layer.mlp.quantize_down_input
        layer.quantize_qkv_input = layer.quantize_gate_up_input = layer.mlp.quantize_down_input = False
    assert greedy() == fused and all(len(t) == 6 for t in fused)
