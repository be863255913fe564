"""logit_bias, allowed_token_ids and bad_words end to end on a random-weight tiny checkpoint.

References are independent of the code under test: the unconstrained run's raw logprobs over the whole
vocabulary (the argmax of a subset, the second-best token), the unconstrained run's own tokens (rows
without these parameters in the same batch are bitwise unchanged), and hand-built cases on the byte-level
tokenizer of `dummy:tiny` (a letter is one token; a word of letters is one token per letter)."""

from __future__ import annotations

import os
import re

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

VOCAB = 512
PROMPTS = ["hello world", "the cat sat", "abc", "zz top"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_dummy_checkpoint(path, make_config("tiny"), seed=3, init_std=0.1, dtype="float32")
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), device="cpu", max_model_len=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def letters(llm):
    """The token ids of the letters a..z (one token each in this tokenizer)."""
    tok = llm.get_tokenizer()
    ids = [tok.encode(c, add_special_tokens=False) for c in "abcdefghijklmnopqrstuvwxyz"]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def run(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def full_logprobs(llm, prompt: str) -> dict[int, float]:
    """The raw logprob of every token at the first output position."""
    out = run(llm, [prompt], greedy(max_tokens=1, logprobs=VOCAB))[0]
    entry = out.logprobs[0]
    assert len(entry) == VOCAB
    return {t: lp.logprob for t, lp in entry.items()}


def test_plus_100_bias_forces_the_token(llm):
    outs = run(
        llm, PROMPTS[:2], [greedy(max_tokens=8, logit_bias={7: 100.0}), greedy(max_tokens=8, logit_bias={"300": 500})]
    )
    assert outs[0].token_ids == [7] * 8
    assert outs[1].token_ids == [300] * 8  # a string id, and a bias clamped to 100


def test_minus_100_bias_on_the_greedy_token_gives_the_second_best(llm):
    for prompt in PROMPTS:
        lps = full_logprobs(llm, prompt)
        first, second = sorted(lps, key=lambda t: -lps[t])[:2]
        out = run(llm, [prompt], greedy(max_tokens=1, logit_bias={first: -100.0}))[0]
        assert out.token_ids == [second], prompt


def test_allowed_token_ids_greedy_is_the_argmax_of_the_subset(llm, letters):
    allowed = letters[3:9]
    for prompt in PROMPTS:
        lps = full_logprobs(llm, prompt)
        out = run(llm, [prompt], greedy(max_tokens=1, allowed_token_ids=allowed))[0]
        assert out.token_ids == [max(allowed, key=lambda t: lps[t])], prompt
    outs = run(llm, PROMPTS, greedy(max_tokens=12, allowed_token_ids=allowed))
    assert all(set(o.token_ids) <= set(allowed) for o in outs)


def test_allowed_token_ids_seeded_sampling_stays_in_the_set(llm):
    allowed = [5, 400]
    params = [
        SamplingParams(temperature=1.5, seed=s, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
        for s in range(4)
    ]
    params[3] = params[3].replace(top_k=50, logprobs=1)  # the full sampler
    outs = run(llm, PROMPTS, params)
    tokens = [t for o in outs for t in o.token_ids]
    assert set(tokens) <= set(allowed) and set(tokens) == set(allowed)  # both drawn at this temperature


def test_rows_without_them_are_unchanged_in_the_same_batch(llm, letters):
    plain = [greedy(max_tokens=10), SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)]
    alone = run(llm, PROMPTS[:2], plain)
    mixed = run(
        llm,
        PROMPTS[:2] + PROMPTS[2:],
        [*plain, greedy(max_tokens=10, allowed_token_ids=letters[:4]), greedy(max_tokens=10, logit_bias={9: 50})],
    )
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert set(mixed[2].token_ids) <= set(letters[:4])


def test_one_token_bad_word_never_appears(llm, letters):
    base = run(llm, PROMPTS, greedy(max_tokens=16, allowed_token_ids=letters))
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, base):
        word = tok.decode([out.token_ids[0]])
        banned = run(llm, [prompt], greedy(max_tokens=16, allowed_token_ids=letters, bad_words=[word]))[0]
        assert out.token_ids[0] not in banned.token_ids and len(banned.token_ids) == 16, (prompt, word)


def test_two_token_bad_word_is_never_completed(llm, letters):
    """The first bigram of the greedy output, banned: the output up to its first token is unchanged, the
    token after it differs, and the bigram occurs nowhere in the new output."""
    tok = llm.get_tokenizer()
    base = run(llm, PROMPTS, greedy(max_tokens=16, allowed_token_ids=letters))
    for prompt, out in zip(PROMPTS, base):
        ids = out.token_ids
        a, b = ids[3], ids[4]
        word = tok.decode([a, b])
        assert tok.encode(word, add_special_tokens=False) == [a, b]
        first = next(i for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) == (a, b))
        new = run(llm, [prompt], greedy(max_tokens=16, allowed_token_ids=letters, bad_words=[word]))[0].token_ids
        assert new[: first + 1] == ids[: first + 1]
        assert new[first + 1] != b
        assert all((new[i], new[i + 1]) != (a, b) for i in range(len(new) - 1)), (prompt, word, new)


def test_bad_word_ids_follow_vllms_tokenization(llm):
    from tinyvllm.sampling.logits_processors import bad_words_token_ids, banned_ids

    tok = llm.get_tokenizer()

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    # " ab" is three tokens here (space, a, b): not the same length, so only the bare form is banned
    assert bad_words_token_ids(["ab", " c"], enc, VOCAB) == [enc("ab"), enc("c")]
    params = SamplingParams(bad_words=["ab"])
    params.bad_words_token_ids = [[1, 2], [3]]
    assert banned_ids(params, []) == [3]
    assert banned_ids(params, [5, 1]) == [2, 3]
    assert banned_ids(params, [1, 5]) == [3]


def test_with_structured_outputs(llm, letters):
    pytest.importorskip("xgrammar")
    from tinyvllm import StructuredOutputsParams as SO

    abc = letters[:3]
    params = greedy(
        max_tokens=8, structured_outputs=SO(regex="[a-c]{8}"), allowed_token_ids=[*abc, 100], bad_words=["a"]
    )
    params = params.replace(ignore_eos=False)
    outs = run(llm, PROMPTS, params)
    for o in outs:
        assert re.fullmatch("[bc]{8}", o.text), o.text


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"logit_bias": {VOCAB: 1.0}}, f"logit_bias holds token id {VOCAB}"),
        ({"allowed_token_ids": [1, VOCAB + 3]}, f"allowed_token_ids holds token id {VOCAB + 3}"),
    ],
)
def test_out_of_vocab_ids_are_rejected(llm, kw, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["x"], SamplingParams(**kw), use_tqdm=False)


def test_triton_samplers_apply_allowed_token_ids(model_dir):
    """The Triton ops (the interpreter on a CPU): allowed rows through the fused kernel (greedy, seeded)
    and the full sampler (top-k), beside a plain fused row and a biased row."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=64, max_num_seqs=4, kernel_backend="triton")
    allowed = [5, 64, 400]
    params = [
        greedy(max_tokens=6, allowed_token_ids=allowed),
        SamplingParams(temperature=2.0, seed=3, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, top_k=5, seed=4, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
        greedy(max_tokens=6, logit_bias={11: 100.0}),
    ]
    outs = run(llm, PROMPTS, params)
    for o in outs[:3]:
        assert set(o.token_ids) <= set(allowed), o.token_ids
    assert outs[3].token_ids == [11] * 6
    lps = full_logprobs(llm, PROMPTS[0])
    assert outs[0].token_ids[0] == max(allowed, key=lambda t: lps[t])
