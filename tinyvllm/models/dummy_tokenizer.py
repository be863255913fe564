"""Tokenizers for dummy checkpoints, laid out as each family's published one and trained offline: on
the Python standard library (dummy checkpoints) or on a given corpus (the demo model, see
``scripts/train_demo_model.py``). :func:`write_dummy_tokenizer` writes the one a config.json dict's
``model_type`` calls for ("llama", "qwen2", "qwen3", "mistral").

Llama 3 (:func:`build_tokenizer`), layout as Llama 3: ids ``0 .. V-257`` are byte-level BPE tokens,
ids ``V-256 .. V-1`` are 256 special tokens in Llama 3's order (``<|begin_of_text|>``,
``<|end_of_text|>``, ..., ``<|eot_id|>`` at ``V-247``), so at ``V = 128256`` every special token has its Llama 3 id.

The BPE is trained with ``tokenizers`` on the docstrings of a fixed list of standard-library
modules (read with :mod:`ast` from the source files, nothing imported): available on every
machine, deterministic for one Python version, and trained in well under a second. That text
yields ~13k tokens; the remaining regular ids are filled with letter strings (``"Ġabq"`` =
``" abq"``) that encoding never produces, so every id in ``[0, V)`` decodes to text — a random
model may sample any of them. With ``corpus=`` the same layout is trained on those texts instead.

Qwen2.5 / Qwen3 (:func:`build_qwen_tokenizer`), as Qwen's tokenizer.json: NFC, Qwen's split regex
(digits one by one), byte-level BPE, no BOS added; then Qwen's added tokens in Qwen's order
(``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ..., Qwen3's ``<think>``/``</think>``), so with
151,643 regular tokens (a vocabulary of at least 151,665 / 151,669) each sits at its real id. A model's
vocab_size beyond that (Qwen3: 151,936) leaves embedding rows the tokenizer has no token for, as in
the real checkpoints.

Mistral v0.1 (:func:`build_mistral_tokenizer`), as its SentencePiece-converted tokenizer.json:
``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, the byte tokens ``<0x00>``..``<0xFF>`` at 3..258 (byte fallback
for characters without a piece), then ``▁``-prefixed BPE pieces; spaces become ``▁``, one ``▁`` is
prepended, BOS is added.
"""

from __future__ import annotations

import ast
import itertools
import json
import string
import sysconfig
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tinyvllm.models.dummy_templates import (
    LLAMA3_CHAT_TEMPLATE,
    MISTRAL_CHAT_TEMPLATE,
    QWEN2_CHAT_TEMPLATE,
    QWEN3_CHAT_TEMPLATE,
)

NUM_SPECIAL_TOKENS = 256
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + NUM_SPECIAL_TOKENS

# Llama 3's pre-tokenizer split (tiktoken's cl100k pattern).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Standard-library modules whose docstrings form the training text: ``<name>.py`` or
# ``<name>/__init__.py`` under the stdlib directory (a missing one is skipped).
CORPUS_MODULES = (
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "collections/__init__",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "doctest",
    "enum",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "http/client",
    "http/server",
    "imaplib",
    "inspect",
    "ipaddress",
    "json/__init__",
    "json/decoder",
    "locale",
    "logging/__init__",
    "mailbox",
    "optparse",
    "pathlib",
    "pdb",
    "pickle",
    "pprint",
    "pydoc",
    "queue",
    "random",
    "sched",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "ssl",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "unittest/case",
    "urllib/parse",
    "uuid",
    "warnings",
    "weakref",
    "_pydecimal",
    "_pyio",
    "_strptime",
)

CHAT_TEMPLATE = LLAMA3_CHAT_TEMPLATE
"""Llama-3-style chat template (see :data:`tinyvllm.models.dummy_templates.LLAMA3_CHAT_TEMPLATE`)."""


def special_tokens() -> list[str]:
    """The 256 special tokens in Llama 3's order (offset i sits at id ``V - 256 + i``)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + NUM_SPECIAL_TOKENS - len(named))]
    return named + reserved


@lru_cache(maxsize=1)
def training_corpus() -> tuple[str, ...]:
    """Docstrings of :data:`CORPUS_MODULES` in a fixed order (module, then ``ast.walk`` order)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for module in CORPUS_MODULES:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            path = stdlib / module / "__init__.py"
            if not path.is_file():
                continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    return tuple(texts)


def _pre_tokenizer(split_pattern: str = LLAMA3_SPLIT_PATTERN) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def train_bpe(
    texts: Iterable[str], max_tokens: int, split_pattern: str = LLAMA3_SPLIT_PATTERN
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train byte-level BPE on ``texts`` with at most ``max_tokens`` tokens (the 256 bytes first),
    pre-tokenized by ``split_pattern``.

    Returns (vocab token → id, merges). Deterministic for the same texts in the same order.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(split_pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=max_tokens,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


@lru_cache(maxsize=4)
def train_stdlib_bpe(
    max_tokens: int, split_pattern: str = LLAMA3_SPLIT_PATTERN
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """:func:`train_bpe` on :func:`training_corpus`, the standard-library docstrings (cached: dummy
    checkpoints reuse it)."""
    return train_bpe(training_corpus(), max_tokens, split_pattern)


def _filler_tokens(taken: set[str], space: str = "Ġ"):
    """Endless distinct letter strings, shortest first, each with and without a leading ``space``
    (byte-level BPE's ``Ġ``, SentencePiece's ``▁``)."""
    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            word = "".join(letters)
            for token in (space + word, word):
                if token not in taken:
                    yield token


def build_tokenizer(vocab_size: int, corpus: Sequence[str] | None = None) -> Tokenizer:
    """The tokenizer for a model with ``vocab_size`` ids (see the module docstring).

    Args:
        vocab_size: regular BPE tokens + 256 special tokens.
        corpus: texts to train the BPE on; default the standard-library docstrings.

    Raises:
        ValueError: ``vocab_size`` < 512 (256 bytes + 256 special tokens).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 byte tokens + 256 special tokens), got {vocab_size}"
        )
    num_regular = vocab_size - NUM_SPECIAL_TOKENS
    vocab, merges = train_stdlib_bpe(num_regular) if corpus is None else train_bpe(corpus, num_regular)
    vocab = dict(vocab)
    fillers = _filler_tokens(set(vocab))
    while len(vocab) < num_regular:
        vocab[next(fillers)] = len(vocab)
    assert sorted(vocab.values()) == list(range(num_regular))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = specials[0]
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, num_regular)]
            ),
        ]
    )
    assert tok.token_to_id(specials[-1]) == vocab_size - 1
    return tok


def write_tokenizer_files(
    out_dir: Path, vocab_size: int, model_max_length: int, corpus: Sequence[str] | None = None
) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``;
    return the tokenizer. ``corpus``: as in :func:`build_tokenizer`.

    tokenizer_config.json is Llama 3.x Instruct's (eos ``<|eot_id|>``, ``PreTrainedTokenizerFast``)
    except ``clean_up_tokenization_spaces: false``, so transformers' decode equals ours.
    """
    tok = build_tokenizer(vocab_size, corpus)
    tok.save(str(out_dir / "tokenizer.json"))
    base = vocab_size - NUM_SPECIAL_TOKENS
    added = {
        str(base + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(special_tokens())
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": "<|begin_of_text|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    special_map = {"bos_token": config["bos_token"], "eos_token": config["eos_token"]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    return tok


# --------------------------------------------------------------------------- families

FAMILIES = {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
"""config.json ``model_type`` -> tokenizer family."""


def tokenizer_family(model_type: str) -> str:
    """The tokenizer family of a config.json ``model_type``.

    Raises:
        ValueError: a model_type without a dummy tokenizer.
    """
    if model_type not in FAMILIES:
        raise ValueError(f"no dummy tokenizer for model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def _json_file(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _added_tokens_decoder(tokens: Sequence[tuple[int, str, bool]]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's ``added_tokens_decoder`` for (id, content, special) triples."""
    return {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, t, special in tokens
    }


# --------------------------------------------------------------------------- Qwen2.5 / Qwen3

QWEN_NUM_REGULAR = 151643
"""Regular (BPE) tokens of Qwen's tokenizer; the added tokens start at this id."""

# Added tokens in Qwen's order, with their ``special`` flag (skipped by skip_special_tokens when True).
QWEN2_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    *QWEN2_ADDED_TOKENS,
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Qwen's pre-tokenizer split: Llama 3's, except that digits are split one by one.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen_added_tokens(family: str) -> tuple[tuple[str, bool], ...]:
    """The added tokens of "qwen2" (Qwen2.5) or "qwen3"."""
    return QWEN3_ADDED_TOKENS if family == "qwen3" else QWEN2_ADDED_TOKENS


def qwen_tokenizer_size(vocab_size: int, family: str) -> int:
    """Tokens of the dummy Qwen tokenizer for a model with ``vocab_size`` embedding rows: all of them
    up to Qwen's real size (151,643 regular tokens + the added ones), that size beyond."""
    return min(vocab_size, QWEN_NUM_REGULAR + len(qwen_added_tokens(family)))


def build_qwen_tokenizer(num_tokens: int, family: str = "qwen3") -> Tokenizer:
    """A Qwen-like tokenizer with ``num_tokens`` ids: ``num_tokens - len(added)`` byte-level BPE
    tokens, then Qwen's added tokens (see the module docstring).

    Raises:
        ValueError: fewer than 256 regular tokens.
    """
    added = qwen_added_tokens(family)
    num_regular = num_tokens - len(added)
    if num_regular < NUM_BYTE_TOKENS:
        raise ValueError(f"a {family} tokenizer needs >= {NUM_BYTE_TOKENS + len(added)} tokens, got {num_tokens}")
    vocab, merges = train_stdlib_bpe(num_regular, QWEN_SPLIT_PATTERN)
    vocab = dict(vocab)
    fillers = _filler_tokens(set(vocab))
    while len(vocab) < num_regular:
        vocab[next(fillers)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added])
    assert tok.get_vocab_size(with_added_tokens=True) == num_tokens
    return tok


def _write_qwen_files(out_dir: Path, config: dict[str, Any], family: str, num_tokens: int) -> Tokenizer:
    tok = build_qwen_tokenizer(num_tokens, family)
    tok.save(str(out_dir / "tokenizer.json"))
    added = qwen_added_tokens(family)
    base = num_tokens - len(added)
    named = [t for t, special in added[1:] if special]  # Qwen's additional_special_tokens
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder([(base + i, t, sp) for i, (t, sp) in enumerate(added)]),
        "additional_special_tokens": named,
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE if family == "qwen3" else QWEN2_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": config["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _json_file(out_dir / "tokenizer_config.json", tokenizer_config)
    _json_file(
        out_dir / "special_tokens_map.json",
        {"additional_special_tokens": named, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    return tok


# --------------------------------------------------------------------------- Mistral v0.1

MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
MISTRAL_NUM_FIXED = len(MISTRAL_SPECIAL_TOKENS) + NUM_BYTE_TOKENS  # ids before the BPE pieces
_SPACE = "▁"


@lru_cache(maxsize=4)
def train_stdlib_sentencepiece_bpe(max_pieces: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """SentencePiece-style BPE on the standard-library docstrings: pieces never contain ``▁`` except as
    their first character; at most ``max_pieces`` pieces (characters included). Returns (piece → id
    from 0, merges)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    tok.pre_tokenizer = pre_tokenizers.Split(_SPACE, behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=max_pieces, min_frequency=2, show_progress=False, limit_alphabet=min(100, max_pieces // 2)
    )
    tok.train_from_iterator(training_corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def build_mistral_tokenizer(num_tokens: int) -> Tokenizer:
    """A Mistral-v0.1-like tokenizer with ``num_tokens`` ids (see the module docstring).

    Raises:
        ValueError: fewer than 259 + 64 tokens.
    """
    if num_tokens < MISTRAL_NUM_FIXED + 64:
        raise ValueError(f"a mistral tokenizer needs >= {MISTRAL_NUM_FIXED + 64} tokens, got {num_tokens}")
    pieces, merges = train_stdlib_sentencepiece_bpe(num_tokens - MISTRAL_NUM_FIXED)
    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIAL_TOKENS)}
    vocab.update({f"<0x{b:02X}>": len(MISTRAL_SPECIAL_TOKENS) + b for b in range(NUM_BYTE_TOKENS)})
    for piece, _ in sorted(pieces.items(), key=lambda kv: kv[1]):
        vocab[piece] = len(vocab)
    fillers = _filler_tokens(set(vocab), space=_SPACE)
    while len(vocab) < num_tokens:
        vocab[next(fillers)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    assert tok.get_vocab_size(with_added_tokens=True) == num_tokens
    return tok


def _write_mistral_files(out_dir: Path, config: dict[str, Any], num_tokens: int) -> Tokenizer:
    tok = build_mistral_tokenizer(num_tokens)
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": _added_tokens_decoder([(i, t, True) for i, t in enumerate(MISTRAL_SPECIAL_TOKENS)]),
        "additional_special_tokens": [],
        "bos_token": "<s>",
        "chat_template": MISTRAL_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": False,
        "model_max_length": config["max_position_embeddings"],
        "pad_token": None,
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    _json_file(out_dir / "tokenizer_config.json", tokenizer_config)
    _json_file(out_dir / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return tok


# --------------------------------------------------------------------------- entry points


def special_token_ids(vocab_size: int, model_type: str = "llama") -> dict[str, Any]:
    """config.json's ``bos_token_id`` and ``eos_token_id`` for a dummy checkpoint of ``model_type``
    with ``vocab_size`` embedding rows, as the family's Instruct checkpoints have them.

    llama: BOS ``<|begin_of_text|>``, EOS [end_of_text, eom, eot] (Llama 3.x Instruct's list); qwen2 /
    qwen3: BOS ``<|endoftext|>`` (the tokenizer adds none), EOS ``<|im_end|>``; mistral: 1 and 2.
    """
    family = tokenizer_family(model_type)
    if family == "llama3":
        base = vocab_size - NUM_SPECIAL_TOKENS
        return {"bos_token_id": base, "eos_token_id": [base + 1, base + 8, base + 9]}
    if family == "mistral":
        return {"bos_token_id": 1, "eos_token_id": 2}
    base = qwen_tokenizer_size(vocab_size, family) - len(qwen_added_tokens(family))
    return {"bos_token_id": base, "eos_token_id": base + 2}


def generation_token_ids(vocab_size: int, model_type: str = "llama") -> dict[str, Any]:
    """generation_config.json's token ids, as the family's Instruct checkpoints have them: the
    config's (:func:`special_token_ids`), except Qwen's EOS list ``[<|im_end|>, <|endoftext|>]`` (e.g.
    Qwen2.5-Instruct's [151645, 151643]) and its ``pad_token_id`` ``<|endoftext|>``."""
    ids = special_token_ids(vocab_size, model_type)
    if tokenizer_family(model_type) in ("qwen2", "qwen3"):
        endoftext = ids["bos_token_id"]
        return {"bos_token_id": endoftext, "eos_token_id": [ids["eos_token_id"], endoftext], "pad_token_id": endoftext}
    return ids


def dummy_tokenizer_size(config: dict[str, Any]) -> int:
    """Tokens of the dummy tokenizer of ``config``: its vocab_size, except for Qwen beyond Qwen's real
    tokenizer size (:func:`qwen_tokenizer_size`)."""
    family = tokenizer_family(config.get("model_type", "llama"))
    if family in ("qwen2", "qwen3"):
        return qwen_tokenizer_size(config["vocab_size"], family)
    return config["vocab_size"]


def write_dummy_tokenizer(out_dir: str | Path, config: dict[str, Any], num_tokens: int | None = None) -> Tokenizer:
    """Write the tokenizer files of a dummy checkpoint for the config.json dict ``config`` (its
    ``model_type``, ``vocab_size`` and ``max_position_embeddings``) into ``out_dir``: tokenizer.json,
    tokenizer_config.json (with the family's chat template) and special_tokens_map.json. Returns
    the tokenizer.

    Args:
        num_tokens: the tokenizer's size; default :func:`dummy_tokenizer_size`. A smaller one than
            vocab_size leaves embedding rows without a token (as Qwen's checkpoints have).

    Raises:
        ValueError: an unsupported model_type, or a size too small for the family's layout.
    """
    out_dir = Path(out_dir)
    family = tokenizer_family(config.get("model_type", "llama"))
    size = dummy_tokenizer_size(config) if num_tokens is None else num_tokens
    if family == "llama3":
        return write_tokenizer_files(out_dir, size, config["max_position_embeddings"])
    if family == "mistral":
        return _write_mistral_files(out_dir, config, size)
    return _write_qwen_files(out_dir, config, family, size)
