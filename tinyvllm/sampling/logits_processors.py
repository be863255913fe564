"""Host side of `allowed_token_ids`, `bad_words` and `logit_bias` (vLLM's built-in logits processors).

`allowed_token_ids` and `bad_words` only remove tokens, so they become bits cleared in the step's packed
token bitmask (sampling/bitmask.py), the one structured outputs use: a row under them can still be served
by the fused greedy/Gumbel kernel, which reads the bitmask, and a row with a grammar ANDs both. A step
whose rows have none of them (and no grammar) builds no bitmask at all.

`logit_bias` adds a value to some logits: the fused kernel cannot, so a row with a bias goes to the full
sampler (`fused_plan.is_plain`), which adds the biases as one sparse `index_put_` over its rows
(`bias_indices`).

Bad words (vLLM's rule, `vllm/v1/sample/ops/bad_words.py`): each word is tokenized without and with a
leading space (the second only when it gives a different first token and as many tokens), so it is
banned at the start of the text and after a space. A bad word of tokens ``w_1 .. w_k`` bans ``w_k`` at a
step whose output so far ends with ``w_1 .. w_{k-1}`` (the prompt is not looked at); a one-token word
bans its token at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinyvllm.sampling.bitmask import bitmask_width, pack_bitmask
from tinyvllm.sampling_params import SamplingParams


def bad_words_token_ids(words: Sequence[str], encode, vocab_size: int) -> list[list[int]]:
    """The token id sequences banned for `words` (module docstring). `encode(text)` gives the ids of
    `text` without special tokens. Raises ValueError when a word encodes to nothing or to an id outside
    the vocabulary."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            raise ValueError(f"bad_words: {word!r} encodes to no tokens.")
        out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    for ids in out:
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"bad_words: token id {t} is outside the vocabulary [0, {vocab_size}).")
    return out


def needs_history(params: SamplingParams) -> bool:
    """Whether a bad word of several tokens reads the output's last tokens: the step that samples a
    token must then know the previous one (no async overlap)."""
    return any(len(ids) > 1 for ids in params.bad_words_token_ids or ())


def masks_tokens(params: SamplingParams) -> bool:
    """Whether the request removes tokens through the bitmask (allowed_token_ids or bad_words)."""
    return params.allowed_token_ids is not None or bool(params.bad_words_token_ids)


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the field and the id when `logit_bias` or `allowed_token_ids` holds an id
    outside [0, vocab_size)."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        for t in ids:
            if t >= vocab_size:
                raise ValueError(f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size}).")


def banned_ids(params: SamplingParams, output_token_ids: Sequence[int]) -> list[int]:
    """The ids the request's bad words ban at the step after `output_token_ids`."""
    banned = []
    n = len(output_token_ids)
    for ids in params.bad_words_token_ids or ():
        k = len(ids) - 1
        if k == 0 or (k <= n and list(output_token_ids[n - k :]) == ids[:k]):
            banned.append(ids[-1])
    return banned


def _allowed_words(params: SamplingParams, vocab_size: int) -> np.ndarray:
    """The packed bitmask row [ceil(V / 32)] int32 of `allowed_token_ids`, built once per params."""
    cached = getattr(params, "_allowed_words", None)
    if cached is None or cached.shape[0] != bitmask_width(vocab_size):
        allowed = np.zeros((1, vocab_size), dtype=bool)
        allowed[0, params.allowed_token_ids] = True
        cached = pack_bitmask(allowed)[0]
        params._allowed_words = cached
    return cached


def apply_to_bitmask(seqs: Sequence, rows: Sequence[int], out: np.ndarray, vocab_size: int) -> None:
    """AND into `out` [N, ceil(V / 32)] int32 (already holding the grammars' masks, all ones elsewhere)
    the allowed tokens and the bad-word bans of `rows` (ScheduledSequences `seqs`, in row order)."""
    for i in rows:
        seq = seqs[i]
        params = seq.sampling_params
        if params.allowed_token_ids is not None:
            out[i] &= _allowed_words(params, vocab_size)
        if params.bad_words_token_ids:
            view = out[i].view(np.uint32)
            for t in banned_ids(params, seq.all_token_ids[seq.prompt_len :]):
                view[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


def bias_indices(params_rows: Sequence[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(flat indices ``row * V + token`` int64, biases float32) of the rows' logit_bias; None when no
    row has one."""
    flat: list[int] = []
    values: list[float] = []
    for row, params in enumerate(params_rows):
        if params.logit_bias:
            for t, b in params.logit_bias.items():
                flat.append(row * vocab_size + t)
                values.append(b)
    if not flat:
        return None
    return np.asarray(flat, dtype=np.int64), np.asarray(values, dtype=np.float32)
