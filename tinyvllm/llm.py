"""The offline API, mirroring vLLM's `LLM`: build once, then `generate()` or `chat()` over many prompts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from tinyvllm.chat_template import merge_template_kwargs
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine, PromptType, TokenizedPrompt
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.tokenizer import check_conversation

Conversation = list[dict[str, Any]]


class LLM:
    """An engine plus a batch loop.

    >>> llm = LLM(model="path/to/Llama-3.2-1B-Instruct")          # doctest: +SKIP
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))     # doctest: +SKIP

    Args:
        model: A Hugging Face model directory, "demo" or "dummy:<preset>"; None: the default model.
        **kwargs: `EngineArgs` fields (vLLM's names): dtype, device, block_size, max_num_seqs,
            max_num_batched_tokens, max_model_len, gpu_memory_utilization, num_gpu_blocks_override,
            load_format, seed, enable_prefix_caching, enforce_eager, ...

    Raises:
        TypeError: A keyword argument that is not an `EngineArgs` field.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(
                f"LLM() got unknown argument(s) {sorted(unknown)}; valid ones: {sorted(EngineArgs.field_names())}"
            )
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args, show_progress=True)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params

    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges: running/waiting requests, KV usage, preemptions, prefix-cache hits."""
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block; returns False (and keeps them) while requests are running."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt.

        Every prompt is validated before any runs: a malformed one raises and nothing is queued. A
        prompt too long for the model finishes with finish_reason "error" and `error` set; the others
        run normally.

        Args:
            prompts: One prompt or a sequence of them; a prompt is a string, a list of token ids, or a
                dict with "prompt" (its text) or "prompt_token_ids" or both.
            sampling_params: One for all prompts or one per prompt; None: the model's defaults
                (generation_config.json).
            use_tqdm: Show a progress bar.

        Returns:
            One finished RequestOutput per prompt, in input order.

        Raises:
            ValueError: No prompts, a malformed prompt (text that is not valid Unicode, a token id
                outside the vocabulary), or a number of SamplingParams that is neither one nor one
                per prompt. The message names the prompt (``prompts[3]``).
            TypeError: A prompt or sampling_params of the wrong type.
        """
        prompts, names = _prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        tokenized = [self.llm_engine.tokenize_prompt(p, name) for p, name in zip(prompts, names)]
        return self._run(tokenized, params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate.

        Every conversation is checked before any runs (`tinyvllm.tokenizer.check_conversation`):
        messages are dicts with a known role and a string content (or a list of text parts, joined
        with newlines as the server does).

        Args:
            messages: One conversation (a list of {"role": ..., "content": ...}) or a list of them.
            sampling_params: As in `generate`, one per conversation.
            use_tqdm: Show a progress bar.
            chat_template: A Jinja template to use instead of the model's.
            add_generation_prompt: End the prompt with the assistant turn's header.
            tools: Tool JSON schemas for the template.
            chat_template_kwargs: Extra template variables, e.g. {"enable_thinking": False} for Qwen3; as in
                vLLM they also override add_generation_prompt and tools.

        Returns:
            One finished RequestOutput per conversation, in input order.

        Raises:
            ValueError: An empty list or conversation (the server answers 400 for these too), a
                message without role or content, an unknown role, text that is not valid Unicode,
                a template that rejects the messages, or chat_template_kwargs naming chat_template,
                tokenize or messages. The message names the place (``messages[1].content``, or
                ``messages[2][1].content`` in a list of conversations).
            TypeError: messages, a message, a role or a content of the wrong type; chat_template_kwargs
                not a dict.
        """
        conversations, names = _conversation_list(messages)
        params = self._params_per_prompt(sampling_params, len(conversations))
        tok = self.llm_engine.tokenizer
        kwargs = merge_template_kwargs(
            {"add_generation_prompt": add_generation_prompt, "tools": tools}, chat_template_kwargs
        )
        prompts = []
        for conv, name in zip(conversations, names):
            conv = check_conversation(conv, name)
            text = tok.apply_chat_template(conv, chat_template=chat_template, **kwargs)
            what = f"the chat prompt rendered from {name} (check chat_template_kwargs)"
            ids = tok.encode(text, add_special_tokens=False, what=what)
            prompts.append(self.llm_engine.tokenize_prompt({"prompt": text, "prompt_token_ids": ids}, name))
        return self._run(prompts, params, use_tqdm)

    def _params_per_prompt(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(
                "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                f"not {type(sampling_params).__name__}"
            )
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts; pass one or one per prompt")
        for i, p in enumerate(sampling_params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, not {type(p).__name__}")
        return list(sampling_params)

    def _run(self, prompts: list[TokenizedPrompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        for i, sp in enumerate(params):  # every constraint compiles before any request is queued
            if isinstance(sp, SamplingParams) and sp.structured_outputs is not None:
                try:
                    engine.structured.validate(sp.structured_outputs)
                except ValueError as e:
                    where = "sampling_params" if len(params) == 1 else f"sampling_params[{i}]"
                    raise ValueError(f"{where}: {e}") from None
        params = [p.replace(output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm)
        num_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        num_out += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        rate = bar.format_dict["rate"]
                        if rate:
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(f"output {num_out / elapsed:.0f} tok/s", refresh=False)
        except BaseException:
            engine.abort_request([rid for rid, i in order.items() if results[i] is None])
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]


def _prompt_list(prompts: Any) -> tuple[list, list[str]]:
    """`generate`'s prompts as (a list of prompts, the name of each for error messages). A single
    prompt is a string, a dict, a TokenizedPrompt or a list whose first item is an int (token ids).
    Raises TypeError/ValueError for what is neither a prompt nor a sequence of them, or for no prompts."""
    token_ids = isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    if token_ids or isinstance(prompts, (str, dict, TokenizedPrompt)):
        return [prompts], ["prompt"]
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise TypeError(
            "prompts must be a string, a list of token ids, a dict with 'prompt' or 'prompt_token_ids', "
            f"or a list of these; got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    return prompts, [f"prompts[{i}]" for i in range(len(prompts))]


def _conversation_list(messages: Any) -> tuple[list, list[str]]:
    """`chat`'s messages as (conversations, the name of each for error messages)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(
            "messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or a list of "
            f"conversations; got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; give a conversation with at least one message")
    if isinstance(messages[0], (list, tuple)):
        return list(messages), [f"messages[{i}]" for i in range(len(messages))]
    return [messages], ["messages"]
