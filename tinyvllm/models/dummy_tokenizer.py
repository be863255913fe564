"""A Llama-3-like tokenizer, trained offline: on the Python standard library (dummy checkpoints) or on a
given corpus (the demo model, see ``scripts/train_demo_model.py``).

Layout (as Llama 3): ids ``0 .. V-257`` are byte-level BPE tokens, ids ``V-256 .. V-1`` are 256
special tokens in Llama 3's order (``<|begin_of_text|>``, ``<|end_of_text|>``, ..., ``<|eot_id|>``
at ``V-247``), so at ``V = 128256`` every special token has its Llama 3 id.

The BPE is trained with ``tokenizers`` on the docstrings of a fixed list of standard-library
modules (read with :mod:`ast` from the source files, nothing imported): available on every
machine, deterministic for one Python version, and trained in well under a second. That text
yields ~13k tokens; the remaining regular ids are filled with letter strings (``"Ġabq"`` =
``" abq"``) that encoding never produces, so every id in ``[0, V)`` decodes to text — a random
model may sample any of them. With ``corpus=`` the same layout is trained on those texts instead.
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

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
"""Llama-3-style chat template: BOS, one header + content + ``<|eot_id|>`` per message, and the
assistant header when ``add_generation_prompt``. Content may be a string or OpenAI-style parts."""


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


def special_token_ids(vocab_size: int) -> dict[str, Any]:
    """``bos_token_id`` and ``eos_token_id`` (end_of_text, eom, eot: Llama 3.x Instruct's list)."""
    base = vocab_size - NUM_SPECIAL_TOKENS
    return {"bos_token_id": base, "eos_token_id": [base + 1, base + 8, base + 9]}


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


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def train_bpe(texts: Iterable[str], max_tokens: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train byte-level BPE on ``texts`` with at most ``max_tokens`` tokens (the 256 bytes first).

    Returns (vocab token → id, merges). Deterministic for the same texts in the same order.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
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
def train_stdlib_bpe(max_tokens: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """:func:`train_bpe` on :func:`training_corpus`, the standard-library docstrings (cached: dummy
    checkpoints reuse it)."""
    return train_bpe(training_corpus(), max_tokens)


def _filler_tokens(taken: set[str]):
    """Endless distinct letter strings, shortest first, each with and without a leading space."""
    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            word = "".join(letters)
            for token in ("Ġ" + word, word):
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
