"""The demo model shipped in tinyvllm/models/demo: the default model, and greedy parity with transformers.

Its predictions are confident (a trained model, unlike the random dummies), so greedy generation token for
token is a sharp check: a wrong RoPE band, GQA grouping or norm would change the text within a few tokens.
The parity tests skip only when the weights are absent from the checkout (before the model is trained).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_greedy
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine import args as engine_args
from tinyvllm.entrypoints.cli import main
from tinyvllm.models import checkpoint
from tinyvllm.models.checkpoint import DEMO_MODEL_DIR, demo_model_available, resolve_model

transformers = pytest.importorskip("transformers")

VAL_TEXT = Path(__file__).resolve().parents[2] / "data" / "demo_corpus" / "val.txt.gz"
DOC_SEPARATOR = "\n<|end_of_text|>\n"
NUM_PROMPTS = 8
PROMPT_TOKENS = 64  # <|begin_of_text|> + 63 tokens of held-out text
MAX_NEW = 64
needs_weights = pytest.mark.skipif(
    not demo_model_available(),
    reason=f"the demo model's weights are not in {DEMO_MODEL_DIR} (scripts/train_demo_model.py writes them)",
)


def validation_paragraphs() -> list[str]:
    """NUM_PROMPTS long paragraphs of the held-out pages, spread over the pages."""
    with gzip.open(VAL_TEXT, "rt", encoding="utf-8") as f:
        docs = f.read().split(DOC_SEPARATOR)
    paragraphs = [p for doc in docs for p in doc.split("\n\n") if len(p) >= 400]
    step = len(paragraphs) // NUM_PROMPTS
    return [paragraphs[i * step] for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32")  # no model named: the demo model


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    out = [tok.encode(p, add_special_tokens=True)[:PROMPT_TOKENS] for p in validation_paragraphs()]
    assert all(len(p) == PROMPT_TOKENS and p[0] == llm.llm_engine.model_config.bos_token_id for p in out)
    return out


@needs_weights
def test_demo_is_the_default_model(llm):
    assert engine_args.default_model() == "demo"
    assert llm.llm_engine.model_dir == DEMO_MODEL_DIR == resolve_model("demo")


@needs_weights
@torch.no_grad()
def test_greedy_generation_matches_transformers(llm, prompts):
    """Token for token: `hf_greedy` checks that rounding decides none of transformers' choices."""
    hf = transformers.LlamaForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ours = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    ]
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, MAX_NEW)


@needs_weights
def test_main_command_prints_english(capsys):
    """The README's main command, `tinyvllm generate "The list type"`, with the model's own sampling defaults."""
    assert main(["generate", "The list type", "--device", "cpu", "--sampling-seed", "0"]) == 0
    text = capsys.readouterr().out.split("-" * 40)[0]
    assert text.startswith("The list type")
    words = text.split()
    assert len(words) >= 20
    common = {"the", "a", "of", "is", "to", "and", "in", "an", "be", "for", "that", "are", "or", "as", "it", "if"}
    assert sum(w.lower() in common for w in words) >= 5, text


@needs_weights
def test_shipped_files_and_card():
    files = {p.name: p.stat().st_size for p in DEMO_MODEL_DIR.iterdir()}
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "LICENSE",
        "loss.png",
        "training_log.json",
    ):
        assert name in files, name
    assert sum(files.values()) <= 25 * 10**6
    log = json.loads((DEMO_MODEL_DIR / "training_log.json").read_text())
    assert log["shipped_val_loss"] < 0.7 * log["unigram"]["cross_entropy_nats"]
    assert f"{log['shipped_val_loss']:.3f}" in (DEMO_MODEL_DIR / "README.md").read_text()


def test_without_weights_the_default_falls_back_to_dummy(monkeypatch, tmp_path):
    monkeypatch.setattr(checkpoint, "DEMO_MODEL_DIR", tmp_path / "demo")
    assert not demo_model_available()
    assert engine_args.default_model() == engine_args.FALLBACK_MODEL == "dummy:tiny"
    with pytest.raises(ValueError, match="demo model's files are not in this installation"):
        resolve_model("demo")
