"""POST /v1/completions, non-streaming and SSE streaming.

Response (OpenAI's): {id: "cmpl-...", object: "text_completion", created, model, choices: [{index, text,
logprobs, finish_reason, stop_reason}], usage}. A batch of prompts gives choice `i * n + j` for
completion j of prompt i. Streaming sends one chunk per new piece of text (same object, `text` being
the delta; a client that reads slowly gets fewer, larger pieces), the finish_reason on a choice's last
chunk, then, with stream_options.include_usage, a chunk with `choices: []` and the usage, and finally
`data: [DONE]`. `structured_outputs` (or `response_format`) constrains each completion's text
(tinyvllm.entrypoints.structured).

`echo` with `logprobs: k` scores the prompt (prompt_logprobs k): the choice's logprobs list the prompt's
tokens first, the first one's logprob and top_logprobs null, streamed in the choice's first chunk. vLLM's
`prompt_logprobs` field (not with `stream`) adds `prompt_logprobs` to each choice, in vLLM's shape
(`serving.prompt_logprobs_json`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tinyvllm.entrypoints.errors import APIError
from tinyvllm.entrypoints.limits import check_prompt_chars
from tinyvllm.entrypoints.protocol import CompletionRequest
from tinyvllm.entrypoints.serving import (
    SSE_DONE,
    ChunkFormat,
    ServingContext,
    SSEResponse,
    add_all,
    completion_choice_json,
    completion_logprobs,
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
from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

Prompt = tuple[str | None, list[int]]


def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[Prompt]:
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif not p:
        raise APIError(400, "prompt must not be an empty list", "prompt")
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    out = []
    for item in items:
        if isinstance(item, str):
            check_prompt_chars(item, ctx.max_prompt_chars, "prompt")
            out.append((item, ctx.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)))
        else:
            out.append((None, ctx.check_token_ids(item, "prompt")))
    return out


def _validate(ctx: ServingContext, req: CompletionRequest) -> tuple[list[Prompt], SamplingParams]:
    """(prompts, params) of a request, or an APIError; runs on the worker pool (it tokenizes)."""
    ctx.check_model(req.model)
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n when given)", "best_of")
    prompts = _prompts(ctx, req)
    explicit = "max_tokens" in req.model_fields_set  # null: the generation config's default (sampling_params)
    for _, ids in prompts:
        ctx.check_length(len(ids), req.max_tokens if explicit else None, "prompt", "max_tokens")
    max_tokens = req.max_tokens if explicit else 16  # OpenAI's default for completions
    params = ctx.sampling_params(req, max_tokens, req.logprobs, {}, req.logprobs if req.echo else None)
    so, so_name = structured_outputs_of(req)
    constraint = structured_params(ctx, req.response_format, so, structured_outputs_name=so_name)
    if constraint is not None:
        params = params.replace(structured_outputs=constraint)
    return prompts, params


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    prompts, params = await ctx.run(_validate, ctx, req)
    request_id = new_id("cmpl")
    streams = await add_all(ctx, request_id, prompts, params, arrival)
    if req.stream:
        return SSEResponse(_events(ctx, req, request_id, prompts, streams), streams, ctx.drain)
    finals = await final_outputs(ctx, request, streams)
    return JSONResponse(_response(ctx, req, request_id, prompts, finals))


def _prompt_text(ctx: ServingContext, prompt: Prompt) -> str:
    return prompt[0] if prompt[0] is not None else ctx.tokenizer.decode(prompt[1])


def _response(
    ctx: ServingContext, req: CompletionRequest, request_id: str, prompts: list[Prompt], finals: list[RequestOutput]
) -> dict:
    choices = []
    for i, out in enumerate(finals):
        for o in out.outputs:
            text = (_prompt_text(ctx, prompts[i]) if req.echo else "") + o.text
            lp = None
            if req.logprobs is not None:
                ids, entries = o.token_ids, o.logprobs or []
                if req.echo:  # the prompt's tokens first, scored as generated ones are (the first: null)
                    ids, entries = prompts[i][1] + ids, _prompt_entries(prompts[i][1], out.prompt_logprobs) + entries
                lp = completion_logprobs(ctx, ids, entries, req.logprobs, 0)
            choice = _choice(i * req.n + o.index, text, lp, o)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(
                    prompts[i][1], out.prompt_logprobs, req.prompt_logprobs
                )
            choices.append(choice)
    completion_tokens = sum(len(o.token_ids) for out in finals for o in out.outputs)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": now_s(),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(sum(len(p[1]) for p in prompts), completion_tokens),
    }


def _prompt_entries(prompt_ids: list[int], prompt_logprobs: list | None) -> list:
    """The prompt logprobs of an echoed prompt; nulls if the request ended before it was scored."""
    return list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(prompt_ids)


def _choice(index: int, text: str, logprobs: dict | None, o: CompletionOutput | None) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": o.finish_reason if o is not None else None,
        "stop_reason": o.stop_reason if o is not None else None,
    }


async def _events(
    ctx: ServingContext, req: CompletionRequest, request_id: str, prompts: list[Prompt], streams: list
) -> AsyncIterator[str]:
    head = {"id": request_id, "object": "text_completion", "created": now_s(), "model": ctx.model_name}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    fmt = ChunkFormat(head, include_usage)
    n, echo, num_logprobs = req.n, req.echo, req.logprobs
    num_choices = len(prompts) * n
    # per choice: the logprobs' text_offset of its next generated token (None: no chunk sent yet)
    sent_chars: list[int | None] = [None] * num_choices
    prompt_logprobs: dict[int, list] = {}  # per prompt, once the engine sent them (echo with logprobs)
    completion_tokens = [0] * num_choices
    done = [False] * num_choices
    plain = [fmt.text_chunk(index, chat=False) for index in range(num_choices)] if num_logprobs is None else []
    try:
        async for i, delta in merged(streams):  # what arrived since the previous event, merged
            if delta.prompt_logprobs is not None:
                prompt_logprobs[i] = delta.prompt_logprobs
            chunks = []
            for c in delta.completions:
                index = i * n + c.index
                if done[index]:
                    continue  # a finished choice of a request whose other choices still run
                text, token_ids, finish_reason = c.text, c.token_ids, c.finish_reason
                completion_tokens[index] += len(token_ids)
                sent = sent_chars[index]
                if plain and finish_reason is None and (sent is not None or not echo):
                    # The commonest chunk: more text of a running choice, no logprobs, no echo.
                    if text:
                        sent_chars[index] = (sent or 0) + len(text)
                        head_json, tail_json = plain[index]
                        chunks.append(head_json + json_str(text) + tail_json)
                    continue  # else no visible text yet (a partial character, a held-back stop prefix)
                first = sent is None
                finished = finish_reason is not None
                wanted = text or (first and echo) or (token_ids and num_logprobs is not None)
                if not wanted and not finished:
                    continue  # no visible text yet (a partial character, a held-back stop prefix)
                offset = sent or 0
                lp = None
                if num_logprobs is not None:
                    ids, entries = token_ids, c.logprobs or []
                    if first and echo:
                        # Completion 0's first output brings them, never later than any completion's first.
                        prompt_ids = prompts[i][1]
                        ids, entries = prompt_ids + ids, _prompt_entries(prompt_ids, prompt_logprobs.get(i)) + entries
                        offset = sum(len(ctx.token_text(t)) for t in prompt_ids)
                        lp = completion_logprobs(ctx, ids, entries, num_logprobs, 0)
                    else:
                        lp = completion_logprobs(ctx, ids, entries, num_logprobs, offset)
                sent_chars[index] = offset + len(text)
                if first and echo:
                    text = _prompt_text(ctx, prompts[i]) + text
                if finished:
                    done[index] = True
                stop_reason = c.stop_reason if finished else None
                chunks.append(fmt.chunk(completion_choice_json(index, text, lp, finish_reason, stop_reason)))
            if chunks:
                yield chunks[0] if len(chunks) == 1 else "".join(chunks)
        if include_usage:
            prompt_tokens = sum(len(p[1]) for p in prompts)
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens))})
    except Exception as e:
        yield sse_error(e)
    yield SSE_DONE
