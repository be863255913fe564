"""FP8 models end to end on the CPU: a compressed-tensors FP8 checkpoint written here (safetensors with the
spec's tensor names: `weight` float8_e4m3fn, `weight_scale` [N, 1] per channel or one value per tensor,
`input_scale` for static activations, `k_proj.output_scale` / `v_proj.output_scale` for the KV cache)
loads as it is, and `quantization="fp8"` quantizes an unquantized checkpoint at load. The oracle is
transformers' LlamaForCausalLM holding the dequantized weights, with each quantized linear layer's input
replaced by its FP8 quantization (hooks), so it computes the quantized maths in float32."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyvllm import LLM
from tinyvllm.bench.parity import teacher_forced_logits
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.quantization.fp8 import amax_scale, quantize_rows, quantize_tensor, to_fp8

from .test_config import ct_config

transformers = pytest.importorskip("transformers")

CONFIG = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, tie_word_embeddings=False, vocab_size=512)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_SCALE = {"self_attn": 0.02, "o": 0.01, "mlp": 0.015, "down": 0.004}  # static activation scales


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An unquantized float32 checkpoint (random weights, confident enough to have a logit spread)."""
    path = tmp_path_factory.mktemp("base")
    write_dummy_checkpoint(path, make_config("tiny", **CONFIG), seed=7, init_std=0.1, dtype="float32")
    return path


def _input_scale(name: str) -> float:
    if ".o_proj" in name:
        return INPUT_SCALE["o"]
    if ".down_proj" in name:
        return INPUT_SCALE["down"]
    return INPUT_SCALE["self_attn"] if ".self_attn." in name else INPUT_SCALE["mlp"]


def write_fp8_checkpoint(base, out, weights: str, dynamic: bool, kv_scales: tuple[float, float] | None = None):
    """`base` re-saved in compressed-tensors FP8: every decoder linear layer's weight as float8_e4m3fn with
    its scale; the LM head and embeddings untouched (`ignore: ["lm_head"]`)."""
    shutil.copytree(base, out)
    tensors = load_file(str(base / "model.safetensors"))
    result = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".")[-1] in LINEARS:
            if weights == "channel":
                q, s = quantize_rows(t)
                s = s[:, None]  # [N, 1], as compressed-tensors stores channel scales
            else:
                q, s = quantize_tensor(t)
                s = s.reshape(1)
            result[name], result[f"{module}.weight_scale"] = q, s
            if not dynamic:
                result[f"{module}.input_scale"] = torch.tensor([_input_scale(name)])
            if kv_scales is not None and module.endswith(("k_proj", "v_proj")):
                result[f"{module}.output_scale"] = torch.tensor([kv_scales[module.endswith("v_proj")]])
        else:
            result[name] = t
    (out / "model.safetensors").unlink()
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = ct_config(weights, "token" if dynamic else "tensor", dynamic, kv=kv_scales is not None)
    (out / "config.json").write_text(json.dumps(cfg))
    return result


def oracle(base, fp8_tensors: dict | None, dynamic: bool):
    """transformers' model with dequantized weights (from `fp8_tensors`; None: quantize per row here) and
    each quantized layer's input FP8-quantized: per token when dynamic, else by the layer's input_scale."""
    hf = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    for name, module in hf.named_modules():
        if name.split(".")[-1] not in LINEARS:
            continue
        w = module.weight.data
        if fp8_tensors is None:
            q, s = quantize_rows(w)
            s = s[:, None]
        else:
            q, s = fp8_tensors[f"{name}.weight"], fp8_tensors[f"{name}.weight_scale"]
        module.weight.data = q.float() * s.float().reshape(-1, 1) if s.numel() > 1 else q.float() * s.float()
        if dynamic:
            scale = None
        else:
            scale = torch.tensor(_input_scale(name + "."))

        def quantize_input(mod, args, scale=scale):
            x = args[0]
            if scale is None:
                s_x = amax_scale(x.abs().amax(-1, keepdim=True))
            else:
                s_x = scale
            return (to_fp8(x, s_x).float() * s_x,)

        module.register_forward_pre_hook(quantize_input)
    return hf


def prompts(n: int = 3, length: int = 40) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(500) for _ in range(length)] for _ in range(n)]


def our_logits(path, **kw) -> list[torch.Tensor]:
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_gpu_blocks_override=64, **kw)
    return [teacher_forced_logits(llm.llm_engine, p, [25, 15]) for p in prompts()], llm


def hf_logits(hf) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0] for p in prompts()]


def assert_matches(ours, ref, unquantized):
    """Our logits equal the oracle's up to float32 rounding, which is far below FP8's own effect.

    Both sides quantize the same activations, but their float32 inputs differ in the last bits (summation
    order), so now and then one element rounds to the neighbouring e4m3 value: a rare 2⁻⁴-relative change
    of one input element. Hence the bound relative to FP8's own error rather than float32's 1e-5."""
    for o, r, u in zip(ours, ref, unquantized):
        fp8_effect = (r - u).norm()
        assert fp8_effect > 1e-3 * u.norm()  # FP8 changed the model: the comparison can tell
        assert (o - r).norm() <= 0.02 * fp8_effect, f"{(o - r).norm():.3e} vs FP8's own {fp8_effect:.3e}"


@pytest.fixture(scope="module")
def unquantized(base):
    hf = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    return hf_logits(hf)


@pytest.mark.parametrize(
    "weights,dynamic", [("channel", True), ("tensor", True), ("channel", False), ("tensor", False)]
)
def test_compressed_tensors_checkpoint_loads(base, unquantized, tmp_path, weights, dynamic):
    tensors = write_fp8_checkpoint(base, tmp_path / "fp8", weights, dynamic)
    ours, llm = our_logits(tmp_path / "fp8")
    layer = llm.llm_engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert llm.llm_engine.runner.model.lm_head.weight.dtype == torch.float32  # ignored: the checkpoint's dtype
    if weights == "tensor":  # q, k and v keep their own per-tensor scales on their rows of the fused layer
        scales = layer.self_attn.qkv_proj.weight_scale
        assert scales[0] == tensors["model.layers.0.self_attn.q_proj.weight_scale"][0]
        assert scales[-1] == tensors["model.layers.0.self_attn.v_proj.weight_scale"][0]
        assert scales[0] != scales[-1]
    assert_matches(ours, hf_logits(oracle(base, tensors, dynamic)), unquantized)


def test_quantize_at_load(base, unquantized):
    ours, llm = our_logits(base, quantization="fp8")
    assert llm.llm_engine.runner.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert llm.llm_engine.runner.executor.fused_max_tokens == 0  # the torch table has no FP8 fused product
    assert_matches(ours, hf_logits(oracle(base, None, True)), unquantized)


def test_kv_cache_scales_load(base, tmp_path):
    write_fp8_checkpoint(base, tmp_path / "fp8", "channel", True, kv_scales=(0.05, 0.125))
    llm = LLM(model=str(tmp_path / "fp8"), device="cpu", dtype="float32", num_gpu_blocks_override=8)
    attn = llm.llm_engine.runner.model.layers[1].self_attn
    assert (attn.k_scale, attn.v_scale) == (torch.tensor(0.05).item(), 0.125)  # float32 in the file


def test_quantized_lm_head_loads_dequantized(base, tmp_path):
    """A checkpoint that quantizes the LM head too (`ignore: []`): the head loads as q · s in the model's dtype."""
    out = tmp_path / "head"
    write_fp8_checkpoint(base, out, "channel", True)
    tensors = load_file(str(out / "model.safetensors"))
    q, s = quantize_rows(tensors["lm_head.weight"])
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = q, s[:, None]
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = []
    (out / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(out), device="cpu", dtype="float32", num_gpu_blocks_override=8)
    head = llm.llm_engine.runner.model.lm_head.weight
    assert head.dtype == torch.float32 and torch.equal(head, q.float() * s[:, None])


def test_fp8_weights_with_bf16_values_are_an_error(base, tmp_path):
    out = tmp_path / "bad"
    write_fp8_checkpoint(base, out, "channel", True)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"].float()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.weight.*stored in FP8"):
        LLM(model=str(out), device="cpu", num_gpu_blocks_override=8)


def test_fp8_kv_cache_doubles_capacity(base):
    """The cache is sized in bytes: at the same kv_cache_memory_bytes an FP8 cache holds twice the blocks of a
    16-bit one (four times a float32 one)."""
    budget = 1 << 20
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model=str(base), device="cpu", dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype=kv)
        engine = llm.llm_engine
        blocks[kv] = engine.num_blocks
        assert engine.runner.kv_caches[0][0].dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
    c = make_config("tiny", **CONFIG)
    per_block_bf16 = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * 16 * (c["hidden_size"] // 4) * 2
    assert blocks["auto"] == budget // per_block_bf16
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_bad_flags():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        LLM(model="dummy:tiny", device="cpu", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        LLM(model="dummy:tiny", device="cpu", quantization="awq")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engines under the interpreter; CUDA: tests/kernels")
def test_fp8_kv_cache_engine_triton_matches_torch(base):
    """The engine with an FP8 KV cache and per-layer K/V scales: the Triton kernels (KV write, prefill over a
    cache written by an earlier chunk, paged decode) give the torch reference's logits, and the cache changes
    them by far more than the two backends differ (the scales are applied, not ignored). The weights stay in
    float32: FP8 activations would turn last-bit differences into whole e4m3 steps at rounding ties."""
    prompt = prompts(1, 24)[0]
    runs = {}
    for backend, kv in (("torch", "fp8"), ("triton", "fp8"), ("torch", "auto")):
        llm = LLM(
            model=str(base),
            device="cpu",
            dtype="float32",
            kernel_backend=backend,
            kv_cache_dtype=kv,
            num_gpu_blocks_override=16,
        )
        for layer in llm.llm_engine.runner.model.layers:
            layer.self_attn.k_scale, layer.self_attn.v_scale = 0.05, 0.02  # as a checkpoint's scales would be
        # chunks of 16, 1 and 7 tokens: a prefill, a one-token step reading 16 cached tokens, another prefill
        runs[backend, kv] = teacher_forced_logits(llm.llm_engine, prompt, [16, 1, 7])
    diff = (runs["triton", "fp8"] - runs["torch", "fp8"]).norm()
    fp8_effect = (runs["torch", "fp8"] - runs["torch", "auto"]).norm()
    assert fp8_effect > 1e-3 * runs["torch", "auto"].norm()
    assert diff <= 1e-5 * runs["torch", "fp8"].norm(), (float(diff), float(fp8_effect))
