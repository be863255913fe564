"""POST /v1/chat/completions, non-streaming and SSE streaming.

Response (OpenAI's): {id: "chatcmpl-...", object: "chat.completion", created, model, choices: [{index,
message: {role: "assistant", content}, logprobs, finish_reason, stop_reason}], usage}. Streaming sends,
per choice, a first chunk with `delta: {role: "assistant", content: ""}`, then `delta: {content}`
chunks (one per new piece of text; a client that reads slowly gets fewer, larger pieces), the last
one carrying finish_reason; then the usage chunk (stream_options.include_usage) and
`data: [DONE]`.

With a reasoning parser or tools (`chat_output.OutputPlan.parses`), each choice's text goes through
`chat_output.ChoiceOutput`: the message gains `reasoning_content` and `tool_calls` (finish_reason
"tool_calls"), and streamed chunks carry `delta.reasoning_content` and `delta.tool_calls`. Constraints
(response_format, structured_outputs, a forced tool call) are checked and compiled by
`tinyvllm.entrypoints.structured` before the request is queued.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tinyvllm.chat_template import merge_template_kwargs
from tinyvllm.entrypoints.chat_output import ChoiceOutput, OutputPlan
from tinyvllm.entrypoints.errors import APIError
from tinyvllm.entrypoints.limits import check_json_size, check_prompt_chars
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, ChatMessage
from tinyvllm.entrypoints.serving import (
    SSE_DONE,
    ChunkFormat,
    ServingContext,
    SSEResponse,
    add_all,
    chat_choice_json,
    chat_delta_json,
    chat_logprobs,
    final_outputs,
    json_str,
    merged,
    new_id,
    now_s,
    prompt_logprobs_json,
    sse,
    sse_error,
    usage,
)
from tinyvllm.entrypoints.structured import structured_outputs_of, structured_params
from tinyvllm.entrypoints.tools import plan_tools
from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template wants them: text parts joined into one string (vLLM's "string" format);
    an assistant turn's tool-call arguments as objects (templates write them with `tojson`), its
    missing content as ""."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if m.tool_calls is not None:
            d["tool_calls"] = [
                _template_call(call, f"messages.{i}.tool_calls.{j}") for j, call in enumerate(m.tool_calls)
            ]
            d.setdefault("content", "")
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if isinstance(part, dict):
                    raise APIError(
                        400,
                        f"content part of type {part.get('type')!r} is not supported; only text parts are",
                        f"messages.{i}.content",
                    )
                texts.append(part.text)
            d["content"] = "\n".join(texts)
        out.append(d)
    return out


def _template_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{param} must be {{id, type: 'function', function: {{name, arguments}}}}", param)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise APIError(
                400, f"{param}.function.arguments is not valid JSON", f"{param}.function.arguments"
            ) from None
    return {**call, "function": {**fn, "arguments": args}}


def render_chat(
    ctx: ServingContext,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list | None = None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text of a conversation. Errors of the template (it rejects the messages) are 400s."""
    if continue_final_message and add_generation_prompt:
        raise APIError(
            400, "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
        )
    named = ctx.tokenizer.chat_template if isinstance(ctx.tokenizer.chat_template, dict) else {}
    if chat_template is not None and chat_template not in named:
        raise APIError(
            400,
            f"chat_template must name one of the model's templates {sorted(named)}; "
            f"templates sent in requests are not run",
            "chat_template",
        )
    check_json_size(tools, ctx.limits.max_tools_bytes, "tools")
    msgs = message_dicts(messages)
    try:
        kwargs = merge_template_kwargs(
            {"add_generation_prompt": add_generation_prompt, "tools": tools}, template_kwargs
        )
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), "chat_template_kwargs") from None
    try:
        text = ctx.tokenizer.apply_chat_template(msgs, chat_template=chat_template, **kwargs)
    except Exception as e:
        logger.info("chat template rejected a request: %s", e)
        raise APIError(400, f"the chat template could not render these messages: {e}", "messages") from None
    if continue_final_message:
        last = msgs[-1].get("content") or ""
        cut = text.rfind(last) if last else -1
        if cut >= 0:
            text = text[: cut + len(last)]
    check_prompt_chars(text, ctx.max_prompt_chars, "messages")
    return text


def _validate(ctx: ServingContext, req: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams, OutputPlan]:
    """(prompt text, its ids, params, how to read the output) of a request, or an APIError; runs on
    the worker pool (it renders, tokenizes and compiles the constraint)."""
    ctx.check_model(req.model)
    check_json_size(req.tools, ctx.limits.max_tools_bytes, "tools")
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.auto_tool_choice)
    plan = OutputPlan(tools, ctx.reasoning_parser, ctx.tool_call_parser)
    if plan.parses and req.echo:
        raise APIError(400, "echo cannot be combined with tools or a reasoning parser", "echo")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    text = render_chat(
        ctx,
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=req.tools,
        chat_template=req.chat_template,
        template_kwargs=req.chat_template_kwargs,
    )
    ids = ctx.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    ctx.check_length(len(ids), max_tokens, "messages", name)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, logprobs, {"max_tokens": name, "logprobs": "top_logprobs"})
    so, so_name = structured_outputs_of(req)
    constraint = structured_params(ctx, req.response_format, so, tools, so_name)
    if constraint is not None:
        params = params.replace(structured_outputs=constraint)
    return text, ids, params, plan


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    prompt, ids, params, plan = await ctx.run(_validate, ctx, req)
    request_id = new_id("chatcmpl")
    streams = await add_all(ctx, request_id, [(prompt, ids)], params, arrival)
    if req.stream:
        events = _parsed_events if plan.parses else _events
        return SSEResponse(events(ctx, req, request_id, prompt, len(ids), streams, plan), streams, ctx.drain)
    (final,) = await final_outputs(ctx, request, streams)
    return JSONResponse(_response(ctx, req, request_id, prompt, final, plan))


def _logprobs(ctx: ServingContext, req: ChatCompletionRequest, o: CompletionOutput) -> dict | None:
    if not req.logprobs:
        return None
    return chat_logprobs(ctx, o.token_ids, o.logprobs or [], req.top_logprobs or 0)


def _response(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    prompt: str,
    final: RequestOutput,
    plan: OutputPlan,
) -> dict:
    choices = []
    for o in final.outputs:
        finish_reason = o.finish_reason
        if plan.parses:
            parsed = ChoiceOutput(plan, prompt)
            message = parsed.message(o.text)
            finish_reason = parsed.finish_reason(finish_reason)
        else:
            message = {"role": "assistant", "content": (prompt if req.echo else "") + o.text}
        choices.append(
            {
                "index": o.index,
                "message": message,
                "logprobs": _logprobs(ctx, req, o),
                "finish_reason": finish_reason,
                "stop_reason": o.stop_reason,
            }
        )
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    response = {
        "id": request_id,
        "object": "chat.completion",
        "created": now_s(),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(len(final.prompt_token_ids), completion_tokens),
    }
    if req.prompt_logprobs is not None:  # vLLM's extra, on the response
        response["prompt_logprobs"] = prompt_logprobs_json(
            final.prompt_token_ids, final.prompt_logprobs, req.prompt_logprobs
        )
    return response


def _first_chunks(req: ChatCompletionRequest, head: dict, include_usage: bool, prompt: str) -> str:
    """Per choice, the chunk with `delta: {role: "assistant", content: ""}` (the prompt with echo)."""
    extra = {"usage": None} if include_usage else {}
    first = {"role": "assistant", "content": prompt if req.echo else ""}
    return "".join(
        sse(
            {
                **head,
                "choices": [
                    {"index": index, "delta": first, "logprobs": None, "finish_reason": None, "stop_reason": None}
                ],
                **extra,
            }
        )
        for index in range(req.n)
    )


async def _events(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    prompt: str,
    num_prompt_tokens: int,
    streams: list,
    plan: OutputPlan,
) -> AsyncIterator[str]:
    """The SSE events of a plain-text request (no parsing: each delta's text is the content)."""
    head = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": ctx.model_name}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    fmt = ChunkFormat(head, include_usage)
    yield _first_chunks(req, head, include_usage, prompt)
    completion_tokens = [0] * req.n
    done = [False] * req.n
    logprobs = req.logprobs
    plain = [fmt.text_chunk(index, chat=True) for index in range(req.n)] if not logprobs else []
    try:
        async for _, delta in merged(streams):  # what arrived since the previous event, merged
            chunks = []
            for c in delta.completions:
                i, text, token_ids, finish_reason = c.index, c.text, c.token_ids, c.finish_reason
                if done[i]:
                    continue  # a finished choice of a request whose other choices still run
                completion_tokens[i] += len(token_ids)
                if plain and finish_reason is None:  # the commonest chunk: more content, no logprobs
                    if text:
                        head_json, tail_json = plain[i]
                        chunks.append(head_json + json_str(text) + tail_json)
                    continue  # else no visible text yet (a partial character, a held-back stop prefix)
                finished = done[i] = finish_reason is not None
                if not text and not finished and not (logprobs and token_ids):
                    continue  # no visible text yet (a partial character, a held-back stop prefix)
                lp = chat_logprobs(ctx, token_ids, c.logprobs or [], req.top_logprobs or 0) if logprobs else None
                chunks.append(
                    fmt.chunk(chat_choice_json(i, text, lp, finish_reason, c.stop_reason if finished else None))
                )
            if chunks:
                yield chunks[0] if len(chunks) == 1 else "".join(chunks)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(num_prompt_tokens, sum(completion_tokens))})
    except Exception as e:
        yield sse_error(e)
    yield SSE_DONE


async def _parsed_events(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    prompt: str,
    num_prompt_tokens: int,
    streams: list,
    plan: OutputPlan,
) -> AsyncIterator[str]:
    """The SSE events of a request whose output is parsed (`ChoiceOutput`): one chunk per delta dict
    (the step's logprobs on its first chunk, or on an empty delta when the parser held the text
    back), then a last chunk with the finish_reason."""
    head = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": ctx.model_name}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    fmt = ChunkFormat(head, include_usage)
    yield _first_chunks(req, head, include_usage, prompt)
    parsers = [ChoiceOutput(plan, prompt) for _ in range(req.n)]
    completion_tokens = [0] * req.n
    done = [False] * req.n
    try:
        async for _, delta in merged(streams):
            chunks = []
            for c in delta.completions:
                i = c.index
                if done[i]:
                    continue
                completion_tokens[i] += len(c.token_ids)
                parts = parsers[i].feed(c.text) if c.text else []
                lp = None
                if req.logprobs and c.token_ids:
                    lp = chat_logprobs(ctx, c.token_ids, c.logprobs or [], req.top_logprobs or 0)
                    parts = parts or [{}]
                for k, part in enumerate(parts):
                    chunks.append(fmt.chunk(chat_delta_json(i, part, lp if k == 0 else None, None, None)))
                if c.finish_reason is not None:
                    done[i] = True
                    for part in parsers[i].finish():
                        chunks.append(fmt.chunk(chat_delta_json(i, part, None, None, None)))
                    reason = parsers[i].finish_reason(c.finish_reason)
                    chunks.append(fmt.chunk(chat_delta_json(i, {}, None, reason, c.stop_reason)))
            if chunks:
                yield "".join(chunks)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(num_prompt_tokens, sum(completion_tokens))})
    except Exception as e:
        yield sse_error(e)
    yield SSE_DONE
