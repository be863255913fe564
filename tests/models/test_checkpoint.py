"""Presets and dummy checkpoints, checked against transformers (the loader of record) and hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tinyvllm.models import checkpoint, dummy_tokenizer
from tinyvllm.models.checkpoint import resolve_model, write_dummy_checkpoint
from tinyvllm.models.presets import PRESETS, make_config, num_parameters, weight_shapes
from tinyvllm.models.safetensors_writer import SafetensorsWriter
from tinyvllm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# --------------------------------------------------------------------------- presets


def test_presets_match_meta_configs() -> None:
    llama3_rope = {
        "rope_type": "llama3",
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = {
        "llama-3.2-1b": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            head_dim=64,
            tie_word_embeddings=True,
            rope_scaling={**llama3_rope, "factor": 32.0},
        ),
        "llama-3.2-3b": dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            head_dim=128,
            tie_word_embeddings=True,
            rope_scaling={**llama3_rope, "factor": 32.0},
        ),
        "llama-3.1-8b": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            head_dim=128,
            tie_word_embeddings=False,
            rope_scaling={**llama3_rope, "factor": 8.0},
        ),
    }
    for name, fields in expected.items():
        config = PRESETS[name]
        assert {k: config[k] for k in fields} == fields, name
        assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
        assert (config["vocab_size"], config["num_key_value_heads"], config["rope_theta"]) == (128256, 8, 500000.0)
        assert (config["max_position_embeddings"], config["rms_norm_eps"]) == (131072, 1e-5)
        assert (config["bos_token_id"], config["eos_token_id"]) == (128000, [128001, 128008, 128009])
        assert config["torch_dtype"] == "bfloat16" and config["hidden_act"] == "silu"
    tiny = PRESETS["tiny"]
    assert (tiny["vocab_size"], tiny["hidden_size"], tiny["intermediate_size"], tiny["num_hidden_layers"]) == (
        512,
        64,
        128,
        2,
    )
    assert (tiny["num_attention_heads"], tiny["num_key_value_heads"], tiny["head_dim"]) == (4, 2, 16)
    assert tiny["tie_word_embeddings"] and tiny["torch_dtype"] == "float32"
    assert tiny["rope_scaling"]["rope_type"] == "llama3" and tiny["max_position_embeddings"] == 2048
    assert (tiny["bos_token_id"], tiny["eos_token_id"]) == (256, [257, 264, 265])


def test_num_parameters_match_published_counts() -> None:
    assert num_parameters(PRESETS["llama-3.2-1b"]) == 1_235_814_400
    assert num_parameters(PRESETS["llama-3.2-3b"]) == 3_212_749_824
    assert num_parameters(PRESETS["llama-3.1-8b"]) == 8_030_261_248
    meta_8b = {k: v for k, v in PRESETS["llama-3.1-8b"].items() if k != "head_dim"}  # Meta's file has no head_dim
    assert num_parameters(meta_8b) == 8_030_261_248
    # tiny by hand: embed 512*64, per layer attn 64*64*2 + 64*32*2, mlp 3*64*128, norms 2*64; final norm 64
    assert num_parameters(PRESETS["tiny"]) == 512 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    untied = make_config(tie_word_embeddings=False)
    assert num_parameters(untied) == num_parameters(PRESETS["tiny"]) + 512 * 64


def test_num_parameters_match_transformers_model() -> None:
    config = make_config(tie_word_embeddings=False, num_key_value_heads=1, intermediate_size=96)
    hf_config = transformers.LlamaConfig(**config)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())
    assert dict(weight_shapes(config)) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_make_config_derives_and_validates() -> None:
    config = make_config(vocab_size=1024, hidden_size=96, num_attention_heads=6)
    assert (config["bos_token_id"], config["eos_token_id"], config["head_dim"]) == (768, [769, 776, 777], 16)
    assert make_config("llama-3.2-1b", num_hidden_layers=1)["hidden_size"] == 2048
    config["rope_theta"] = 1.0
    assert PRESETS["tiny"]["rope_theta"] == 10000.0  # a copy
    for bad, match in [
        (dict(num_layers=3), "unknown config keys"),
        (dict(vocab_size=300), ">= 512"),
        (dict(num_key_value_heads=3), "multiple"),
        (dict(bos_token_id=1), "layout"),
        (dict(attention_bias=True), "bias"),
        (dict(torch_dtype="int8"), "torch_dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_config(**bad)
    with pytest.raises(ValueError, match=r"llama-3\.2-1b"):
        make_config("llama-9")


# --------------------------------------------------------------------------- written checkpoints


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(scope="module")
def untied_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = make_config(tie_word_embeddings=False, vocab_size=1024)
    return write_dummy_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "untied", config, seed=3, dtype="bfloat16", max_shard_bytes=60_000
    )


@pytest.mark.parametrize("which", ["tiny_dir", "untied_sharded_dir"])
def test_transformers_loads_checkpoint(request: pytest.FixtureRequest, which: str) -> None:
    ckpt = request.getfixturevalue(which)
    config = json.loads((ckpt / "config.json").read_text())
    model, info = transformers.LlamaForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert model.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[config["torch_dtype"]]
    # transformers 5 folds the legacy rope_scaling + rope_theta into config.rope_parameters
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == config["rope_theta"]
    assert {
        k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    } == {k: v for k, v in config["rope_scaling"].items() if k != "rope_type"}
    assert model.model.rotary_emb.rope_type == "llama3"
    if which == "tiny_dir":  # by hand: head_dim 16, theta 1e4; wavelength < 64 kept, > 256 divided by 8
        inv_freq = model.model.rotary_emb.inv_freq
        assert inv_freq[0].item() == 1.0 and inv_freq[1].item() == pytest.approx(10000 ** (-2 / 16))
        assert inv_freq[7].item() == pytest.approx(10000 ** (-14 / 16) / 8)
    # every weight is the one in the files (lm_head only when untied); tied lm_head shares the embedding
    ours = _read_weights(ckpt)
    assert set(ours) == {name for name, _ in weight_shapes(config)}
    assert ("lm_head.weight" in ours) != config["tie_word_embeddings"]
    for name, param in model.state_dict().items():
        expected = (
            ours["model.embed_tokens.weight"]
            if name == "lm_head.weight" and config["tie_word_embeddings"]
            else ours[name]
        )
        assert torch.equal(param, expected), name
    logits = model(torch.tensor([[config["bos_token_id"], 5, 6, 7]])).logits
    assert logits.shape == (1, 4, config["vocab_size"]) and torch.isfinite(logits).all()


def _read_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        weights.update(load_file(f))
    return weights


def test_weight_statistics(untied_sharded_dir: Path) -> None:
    weights = _read_weights(untied_sharded_dir)
    config = json.loads((untied_sharded_dir / "config.json").read_text())
    assert dict(weight_shapes(config)) == {k: tuple(v.shape) for k, v in weights.items()}
    assert "lm_head.weight" in weights and all(v.dtype == torch.bfloat16 for v in weights.values())
    embed = weights["model.embed_tokens.weight"].float()
    assert abs(embed.std().item() - 0.02) < 0.002 and abs(embed.mean().item()) < 0.002
    norm = weights["model.layers.1.post_attention_layernorm.weight"].float()
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.05 < norm.std().item() < 0.2  # 1 + noise, not ones
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], weights["model.layers.1.mlp.up_proj.weight"])


def test_sharding_index_and_determinism(untied_sharded_dir: Path, tmp_path: Path) -> None:
    index = json.loads((untied_sharded_dir / "model.safetensors.index.json").read_text())
    shards = sorted(untied_sharded_dir.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 2 and [s.name for s in shards] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert not (untied_sharded_dir / "model.safetensors").exists()
    weights = _read_weights(untied_sharded_dir)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    for shard in shards:
        with safe_open(shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            names = list(f.keys())
            assert all(index["weight_map"][k] == shard.name for k in names)
            assert sum(f.get_tensor(k).numel() * 2 for k in names) <= 60_000 or len(names) == 1
    assert sorted(index["weight_map"]) == sorted(weights)
    # same seed -> same weights, whatever the sharding; another seed -> other weights
    config = json.loads((untied_sharded_dir / "config.json").read_text())
    single = write_dummy_checkpoint(tmp_path / "single", config, seed=3)
    assert {k: v.tolist() for k, v in _read_weights(single).items()} == {k: v.tolist() for k, v in weights.items()}
    other = write_dummy_checkpoint(tmp_path / "other", config, seed=4)
    assert not torch.equal(_read_weights(other)["model.norm.weight"], weights["model.norm.weight"])


def test_generation_config_and_tokenizer_files(untied_sharded_dir: Path) -> None:
    gen = transformers.GenerationConfig.from_pretrained(untied_sharded_dir)
    assert (gen.bos_token_id, gen.eos_token_id) == (768, [769, 776, 777])
    ours = Tokenizer.from_pretrained(untied_sharded_dir)
    hf = transformers.AutoTokenizer.from_pretrained(untied_sharded_dir)
    assert ours.vocab_size == len(hf) == 1024 and hf.model_max_length == 2048
    assert hf.convert_ids_to_tokens([768, 769, 776, 777]) == [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|eom_id|>",
        "<|eot_id|>",
    ]
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (768, 777)
    text = "Return the value of the argument, 😀 in 中文."
    assert ours.encode(text) == hf.encode(text) and ours.encode(text)[0] == 768
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_tokenizer_layout_at_llama3_ids_and_fillers() -> None:
    tok = dummy_tokenizer.build_tokenizer(128256)
    assert tok.get_vocab_size() == 128256
    llama3 = {
        128000: "<|begin_of_text|>",
        128001: "<|end_of_text|>",
        128004: "<|finetune_right_pad_id|>",
        128006: "<|start_header_id|>",
        128007: "<|end_header_id|>",
        128008: "<|eom_id|>",
        128009: "<|eot_id|>",
        128010: "<|python_tag|>",
        128011: "<|reserved_special_token_3|>",
        128255: "<|reserved_special_token_247|>",
    }
    assert {i: tok.id_to_token(i) for i in llama3} == llama3
    # no holes: every regular id is a token that decodes to text (fillers included)
    vocab = tok.get_vocab(with_added_tokens=False)
    assert sorted(vocab.values()) == list(range(128000))
    assert tok.encode("hello world").ids[0] == 128000  # BOS from the post-processor
    filler_ids = [127999, 100000, 50000]
    assert all(tok.decode([i]).strip().isalpha() for i in filler_ids)


def test_tokenizer_training_is_deterministic() -> None:
    first = dummy_tokenizer.build_tokenizer(2048).to_str()
    dummy_tokenizer.training_corpus.cache_clear()
    dummy_tokenizer.train_stdlib_bpe.cache_clear()
    assert dummy_tokenizer.build_tokenizer(2048).to_str() == first
    assert len(dummy_tokenizer.training_corpus()) > 1000


def test_write_rejects_bad_input(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        write_dummy_checkpoint(tmp_path / "full", "tiny")
    with pytest.raises(ValueError, match="dtype"):
        write_dummy_checkpoint(tmp_path / "a", "tiny", dtype="fp8")
    with pytest.raises(ValueError, match="unknown preset"):
        write_dummy_checkpoint(tmp_path / "b", "llama-7")


def test_safetensors_writer_round_trip(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 3, generator=g),
        "b.x": torch.randn(5, generator=g).to(torch.bfloat16),
        "c": torch.randn(4, 9, 2, generator=g).to(torch.float16),
    }
    specs = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    with SafetensorsWriter(tmp_path / "t.safetensors", specs, {"format": "pt"}) as w:
        for name, t in tensors.items():
            w.write(name, [t[:2], t[2:3], t[3:]])  # uneven row chunks
    loaded = load_file(tmp_path / "t.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())


# --------------------------------------------------------------------------- resolve_model


def test_resolve_model_directory(tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_dir)) == tiny_dir
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="nothing is downloaded"):
        resolve_model("meta-llama/Llama-3.2-1B-Instruct")
    with pytest.raises(ValueError, match=r"llama-3\.1-8b.*tiny"):
        resolve_model("dummy:huge")


def test_resolve_dummy_writes_once_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path / "env"))
    path = resolve_model("dummy:tiny")
    assert path == tmp_path / "env" / "dummy" / "tiny"
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("dummy:tiny") == path and (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == ["tiny"]  # no temporary directory left

    def crash(out_dir: Path, config: str, **kwargs: object) -> Path:
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "write_dummy_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("dummy:tiny", cache_dir=tmp_path / "explicit")
    assert list((tmp_path / "explicit").iterdir()) == []  # nothing half-written is left behind
