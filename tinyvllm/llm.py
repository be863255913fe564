"""The offline API, mirroring vLLM's `LLM`: build once, then `generate()` or `chat()` over many prompts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tinyvllm.chat_template import merge_template_kwargs
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine, PromptType, TokenizedPrompt
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

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
            ValueError: A malformed prompt (e.g. a token id outside the vocabulary), or a number of
                SamplingParams that is neither one nor one per prompt.
            TypeError: A prompt or sampling_params of the wrong type.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        tokenized = [self.llm_engine.tokenize_prompt(p) for p in prompts]  # validate all first
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

        Args:
            messages: One conversation (a list of {"role": ..., "content": ...}) or a sequence of them.
            sampling_params: As in `generate`.
            use_tqdm: Show a progress bar.
            chat_template: A Jinja template to use instead of the model's.
            add_generation_prompt: End the prompt with the assistant turn's header.
            tools: Tool JSON schemas for the template.
            chat_template_kwargs: Extra template variables, e.g. {"enable_thinking": False} for Qwen3; as in
                vLLM they also override add_generation_prompt and tools.

        Returns:
            One finished RequestOutput per conversation, in input order.

        Raises:
            ValueError: The template rejects a conversation, or chat_template_kwargs names chat_template,
                tokenize or messages.
            TypeError: chat_template_kwargs is not a dict.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        kwargs = merge_template_kwargs(
            {"add_generation_prompt": add_generation_prompt, "tools": tools}, chat_template_kwargs
        )
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, chat_template=chat_template, **kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one or one per prompt")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, not {type(p).__name__}")
        return params

    def _run(self, prompts: list[TokenizedPrompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
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
