"""xgrammar's view of a vocabulary (`xgrammar.TokenizerInfo`), built from our own `Tokenizer`.

xgrammar needs every token id's bytes. It takes the vocabulary as stored in tokenizer.json and decodes
it by the vocabulary's type, which we read off the tokenizer's decoder:

* ``ByteLevel`` decoder (GPT-2 / Llama 3 byte-level BPE): tokens are the byte-to-unicode encoding of
  their bytes ("Ġthe" is " the");
* a ``ByteFallback`` step (SentencePiece-style BPE, Llama 2 / Mistral): "<0x0A>" is the byte 0x0A and
  "▁" a space;
* anything else: tokens are their raw text.

Special tokens (and ids past the tokenizer's vocabulary, up to the model's logits width) are given as
empty strings, which xgrammar never allows inside a grammar: their text is dropped by detokenization,
so a grammar must not count on it. The stop token ids are the engine's EOS ids: the only tokens the
mask allows once the grammar is complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def vocab_type(decoder: dict[str, Any] | None) -> tuple[str, bool]:
    """(xgrammar vocabulary type name, add_prefix_space) for a tokenizer.json ``decoder`` section."""
    if not decoder:
        return "RAW", False
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = [s.get("type") for s in steps]
    if "ByteLevel" in types:
        return "BYTE_LEVEL", False
    if "ByteFallback" in types:
        # SentencePiece tokenizers strip the space they prepend (a Strip step or a Metaspace decoder).
        return "BYTE_FALLBACK", "Strip" in types or "Metaspace" in types
    if "Metaspace" in types:
        return "BYTE_FALLBACK", True
    return "RAW", False


def build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
    """The `xgrammar.TokenizerInfo` of `tokenizer` for a model whose logits have `vocab_size` columns.

    Args:
        tokenizer: a `tinyvllm.tokenizer.Tokenizer`.
        vocab_size: the model's logits width (may exceed the tokenizer's; the extra ids are never allowed).
        stop_token_ids: the engine's EOS ids (allowed only where the grammar may end).
    """
    import xgrammar as xgr

    backend = tokenizer._backend
    encoded = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = token
    for i in tokenizer.all_special_ids:
        if i is not None and i < vocab_size:
            encoded[i] = ""
    kind, add_prefix_space = vocab_type(json.loads(backend.to_str()).get("decoder"))
    stops = [int(i) for i in stop_token_ids if 0 <= i < vocab_size]
    return xgr.TokenizerInfo(
        encoded,
        getattr(xgr.VocabType, kind),
        vocab_size=vocab_size,
        stop_token_ids=stops or None,
        add_prefix_space=add_prefix_space,
    )
