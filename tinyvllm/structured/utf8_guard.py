"""Masks that keep constrained outputs well-formed UTF-8 where xgrammar's own masks do not.

xgrammar 0.2.9 matches a negated character class (``[^"\\\\]`` inside JSON strings, ``[^a]`` and ``.`` in
regexes) over UTF-8 byte sequences that include encoded surrogates (ED A0..BF xx) and, in regex classes,
overlong three-byte forms (E0 80..9F xx). Those bytes are not UTF-8: detokenization turns each into
U+FFFD, so the text no longer matches what the grammar accepted (a maxLength is exceeded, a pattern
fails). Unicode's table of well-formed byte sequences (The Unicode Standard, table 3-7) forbids exactly
these second bytes after four lead bytes::

    E0: 80..9F (overlong)   ED: A0..BF (surrogates)   F0: 80..8F (overlong)   F4: 90..BF (> U+10FFFF)

so a constrained row's mask is ANDed with `valid` (tokens with no such pair inside them) and, when the
row's last token ended with one of those lead bytes, with `after_lead[lead]` (tokens that do not start
with a forbidden second byte). Both are packed like xgrammar's bitmask, built once per vocabulary.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from tinyvllm.sampling.bitmask import pack_bitmask

_FORBIDDEN_SECOND = {0xE0: (0x80, 0x9F), 0xED: (0xA0, 0xBF), 0xF0: (0x80, 0x8F), 0xF4: (0x90, 0xBF)}
_ILL_FORMED_PAIR = re.compile(rb"\xe0[\x80-\x9f]|\xed[\xa0-\xbf]|\xf0[\x80-\x8f]|\xf4[\x90-\xbf]")


class Utf8Guard:
    """The packed masks of one vocabulary (module docstring).

    Args:
        decoded_vocab: each token id's bytes (xgrammar's `TokenizerInfo.decoded_vocab`).

    Attributes:
        valid: [W] int32, tokens whose bytes hold no ill-formed pair.
        after_lead: lead byte -> [W] int32, the valid tokens that may follow a token ending with it.
        ends_with_lead: token id -> the lead byte it ends with, for the tokens that end with one.
        all_valid: every token is valid (`valid` is all ones, and `apply` skips it).
    """

    def __init__(self, decoded_vocab: Sequence[bytes]) -> None:
        n = len(decoded_vocab)
        valid = np.ones(n, dtype=bool)
        first = np.zeros(n, dtype=np.int16) - 1
        self.ends_with_lead: dict[int, int] = {}
        for i, token in enumerate(decoded_vocab):
            if not token:
                continue
            first[i] = token[0]
            if _ILL_FORMED_PAIR.search(token):
                valid[i] = False
            if token[-1] in _FORBIDDEN_SECOND:
                self.ends_with_lead[i] = token[-1]
        self.valid = pack_bitmask(valid[None])[0]
        self.all_valid = bool(valid.all())
        self.after_lead = {
            lead: pack_bitmask((valid & ~((first >= lo) & (first <= hi)))[None])[0]
            for lead, (lo, hi) in _FORBIDDEN_SECOND.items()
        }

    def apply(self, words: np.ndarray, rows: Sequence[int], last_tokens: Sequence[int | None]) -> None:
        """AND the packed mask rows `words[rows]` ([B, W] int32, in place) given each row's last output
        token (`last_tokens`, one per row of `rows`). The `valid` AND is skipped for a vocabulary whose
        tokens are all valid (Llama 3's): then only the rows whose last token ends with a lead byte
        (a few tokens of the vocabulary) are touched."""
        if not len(rows):
            return
        if not self.all_valid:
            if len(rows) == words.shape[0]:
                words &= self.valid
            else:
                words[rows] &= self.valid
        leads = self.ends_with_lead
        for i, last in zip(rows, last_tokens):
            lead = leads.get(last)
            if lead is not None:
                words[i] &= self.after_lead[lead]
