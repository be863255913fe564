"""Reasoning parsers on hand-written outputs: the whole text, and every split of it into deltas."""

import pytest

from tinyvllm.reasoning import ReasoningStream, check_reasoning_parser, split_reasoning

QWEN3_THINKING_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_OPEN_PROMPT = QWEN3_THINKING_PROMPT + "<think>\n"  # a template that opens the thinking
QWEN3_NO_THINK_PROMPT = QWEN3_THINKING_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking=False

CASES = [
    # (parser, prompt, output, reasoning, content)
    (
        "qwen3",
        QWEN3_THINKING_PROMPT,
        "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
        "\nLet me see.\n",
        "The answer is 4.",
    ),
    ("qwen3", QWEN3_THINKING_PROMPT, '\n<think>plan</think>{"a": 1}', "plan", '{"a": 1}'),
    ("qwen3", QWEN3_THINKING_PROMPT, "<think>cut off by max_tokens", "cut off by max_tokens", None),
    (
        "qwen3",
        QWEN3_THINKING_PROMPT,
        "No thinking here, x < y </think> stays",
        None,
        "No thinking here, x < y </think> stays",
    ),
    ("qwen3", QWEN3_NO_THINK_PROMPT, "Just the answer.", None, "Just the answer."),
    ("qwen3", QWEN3_OPEN_PROMPT, "thinking</think>\n\nanswer", "thinking", "answer"),
    ("qwen3", QWEN3_OPEN_PROMPT, "still thinking", "still thinking", None),
    ("qwen3", QWEN3_THINKING_PROMPT, "<thinker>not a tag", None, "<thinker>not a tag"),
    ("qwen3", QWEN3_THINKING_PROMPT, "<think></think>", None, None),
    ("qwen3", QWEN3_THINKING_PROMPT, "<think>a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", None, "step 1, step 2</think>\n\nDone.", "step 1, step 2", "Done."),
    ("deepseek_r1", None, "<think>\nx</think>y", "\nx", "y"),
    ("deepseek_r1", None, "no end tag at all", "no end tag at all", None),
    ("deepseek_r1", None, "</think>only content", None, "only content"),
    ("deepseek_r1", None, "a </thin and more</think>", "a </thin and more", None),
]


@pytest.mark.parametrize(("parser", "prompt", "output", "reasoning", "content"), CASES)
def test_split_whole_output(parser, prompt, output, reasoning, content):
    assert split_reasoning(parser, output, prompt) == (reasoning, content)


def _splits(text):
    """Every character its own delta, and every cut into two deltas."""
    yield list(text)
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]


@pytest.mark.parametrize(("parser", "prompt", "output", "reasoning", "content"), CASES)
def test_every_split_into_deltas_reassembles(parser, prompt, output, reasoning, content):
    for split in _splits(output):
        stream = ReasoningStream(parser, prompt)
        parts = [stream.feed(p) for p in split] + [stream.finish()]
        got = ("".join(p.reasoning for p in parts) or None, "".join(p.content for p in parts) or None)
        assert got == (reasoning, content), split


def test_end_tag_split_across_deltas_is_not_leaked():
    stream = ReasoningStream("deepseek_r1")
    first = stream.feed("thought </th")
    assert (first.reasoning, first.content) == ("thought ", "")
    second = stream.feed("ink>answer")
    assert (second.reasoning, second.content) == ("", "answer")
    assert not stream.in_reasoning


def test_unknown_parser_lists_choices():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        check_reasoning_parser("granite")
