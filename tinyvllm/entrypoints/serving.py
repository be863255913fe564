"""What /v1/completions and /v1/chat/completions share: parsing and validating a request into (prompt
token ids, SamplingParams) before anything reaches the engine, queueing it, reading its outputs (with
disconnect detection), logprobs and usage in OpenAI's shapes, and the SSE response.

Parsing, chat-template rendering and tokenization run on a small thread pool (`ServingContext.run`),
never on the event loop, so that one large request does not stall the others (/health included).

Every check raises `APIError(400, message, param)` naming the offending field, so that bad input never
reaches the engine (whose own ValueError/TypeError would still come back as a 400).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from tinyvllm.engine.async_llm import EngineClient, RequestRejected, RequestStream
from tinyvllm.engine.messages import OutputAccumulator, RequestDelta
from tinyvllm.entrypoints.errors import APIError, error_json
from tinyvllm.entrypoints.guard import BODY_SEND
from tinyvllm.entrypoints.limits import ServerLimits, check_stop, parse_body, prompt_char_bound
from tinyvllm.entrypoints.protocol import SamplingFields
from tinyvllm.entrypoints.shutdown import Drain
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling.logits_processors import bad_words_token_ids, check_vocab
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)


@dataclass
class ServingContext:
    """Everything a handler needs: the engine, its tokenizer and limits, the served names, the worker
    pool (`tokenizer_workers` threads) and the shutdown state."""

    engine: EngineClient
    served_model_names: list[str]
    limits: ServerLimits = field(default_factory=ServerLimits)
    drain: Drain = field(default_factory=Drain)
    tokenizer_workers: int = 2
    reasoning_parser: str | None = None  # tinyvllm.reasoning: split the thinking off chat outputs
    tool_call_parser: str | None = None  # tinyvllm.tool_parsers: the format of tool_choice "auto"
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        info = self.engine.info
        self.tokenizer = info.tokenizer
        self.vocab_size: int = info.vocab_size
        self.max_model_len: int = info.max_model_len
        self.default_params: SamplingParams = info.default_sampling_params
        self.default_max_tokens: int | None = info.default_max_tokens
        self.max_tokens_cap: int | None = info.max_tokens_cap
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        limit = self.limits.max_prompt_chars
        self.max_prompt_chars: int | None = (
            prompt_char_bound(self.tokenizer, self.max_model_len) if limit is None else (limit or None)
        )
        self.pool = ThreadPoolExecutor(self.tokenizer_workers, thread_name_prefix="tinyvllm-api")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker pool (parsing, templates, tokenization: off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def parse(self, request: Request, model: type[T]) -> T:
        """The request's body as a validated `model`. The body is read in chunks (RequestGuard holds
        them to the size limit) and not kept on the request, so it is freed once parsed."""
        chunks = [chunk async for chunk in request.stream()]
        body = b"".join(chunks)
        del chunks
        return await self.run(parse_body, body, model, self.limits.max_json_depth)

    @property
    def auto_tool_choice(self) -> bool:
        """tool_choice "auto" is served (vLLM needs both flags)."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_token_ids(self, ids: Sequence[int], param: str) -> list[int]:
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)
        return list(ids)

    def check_length(self, num_prompt: int, max_tokens: int | None, param: str, max_tokens_param: str) -> None:
        """A prompt must leave room for one token; an explicit max_tokens must fit too (vLLM's rule)."""
        limit = self.max_model_len
        if num_prompt == 0:
            raise APIError(400, "the prompt is empty; at least one token is needed", param)
        if num_prompt >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt} input tokens. Please reduce the length of the input.",
                param,
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise APIError(
                400,
                f"'{max_tokens_param}' is too large: {max_tokens}. This model's maximum context "
                f"length is {limit} tokens and your request has {num_prompt} input tokens "
                f"({max_tokens} > {limit} - {num_prompt}).",
                max_tokens_param,
            )

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        renames: dict[str, str],
        echo_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams from the request's fields over the model's defaults; errors name the field
        as the client spelled it (`renames`: SamplingParams name -> request name). `max_tokens` None
        (the request sets none) takes the generation config's max_new_tokens, as vLLM's server does;
        without one, generation runs to the end of the context (where the engine stops in any case).
        A max_new_tokens given on the command line (`max_tokens_cap`) also caps the request's own.
        The engine sends DELTA outputs: each carries only what a step added. The prompt is scored
        (prompt_logprobs) for the request's `prompt_logprobs` field and for `echo_logprobs`
        (completions' echo with logprobs), with the larger k of the two."""
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options can only be set when stream is true", "stream_options")
        max_logprobs = self.limits.max_logprobs
        if req.prompt_logprobs is not None:
            if req.stream:  # as vLLM: they come in the response, which a stream does not have
                raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
            if not 0 <= req.prompt_logprobs <= max_logprobs:
                raise APIError(
                    400, f"prompt_logprobs must be in [0, {max_logprobs}], got {req.prompt_logprobs}", "prompt_logprobs"
                )
        if logprobs is not None and not 0 <= logprobs <= max_logprobs:
            raise APIError(
                400, f"logprobs must be in [0, {max_logprobs}], got {logprobs}", renames.get("logprobs", "logprobs")
            )
        if req.n > self.limits.max_n:
            raise APIError(400, f"n must be at most {self.limits.max_n}, got {req.n}", "n")
        check_stop(req.stop, self.limits)
        changes = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        if self.max_tokens_cap is not None:
            max_tokens = self.max_tokens_cap if max_tokens is None else min(max_tokens, self.max_tokens_cap)
        scored = [k for k in (req.prompt_logprobs, echo_logprobs) if k is not None]
        changes.update(
            n=req.n,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=max(scored) if scored else None,
            output_kind=RequestOutputKind.DELTA,
        )
        try:
            params = self.default_params.replace(**changes)
            check_vocab(params, self.vocab_size)
            if params.bad_words:  # tokenized here, off the engine's loop (the engine keeps these ids)
                params.bad_words_token_ids = bad_words_token_ids(params.bad_words, self._encode_plain, self.vocab_size)
            return params
        except (ValueError, TypeError) as e:
            field = re.match(r"\w*", str(e)).group()
            param = renames.get(field, field) if field in SamplingParams.__dataclass_fields__ else None
            raise APIError(400, str(e), param) from None

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, what="bad_words")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---------------------------------------------------------------------- queueing and reading
async def add_all(
    ctx: ServingContext,
    request_id: str,
    prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams,
    arrival_time: float,
) -> list[RequestStream]:
    """Queue every prompt (ids `request_id-i`), all or none: on a rejection the others are aborted."""
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(
                await ctx.engine.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, params, arrival_time)
            )
    except RequestRejected as e:
        for s in streams:
            s.abort()
        headers = {"Retry-After": "1"} if e.status == 503 else None
        raise APIError(e.status, str(e), e.param, headers) from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    ctx.drain.register(streams)
    return streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(prompt index, RequestDelta: what arrived since the previous one, see RequestStream.deltas)
    from every stream as they arrive; errors propagate."""
    if len(streams) == 1:
        next_delta = streams[0].next_delta
        while (delta := await next_delta()) is not None:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for delta in stream.deltas():
                queue.put_nowait((i, delta))
            queue.put_nowait((i, None))
        except BaseException as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def final_outputs(ctx: ServingContext, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of each stream (its deltas accumulated); aborts them all if the client
    disconnects first."""

    async def collect() -> list[RequestOutput]:
        totals = [OutputAccumulator(s.request_id, s.prompt, s.prompt_token_ids) for s in streams]
        async for i, out in merged(streams):
            totals[i].add(out)
        return [t.output() for t in totals]

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise APIError(499, "the client closed the request")
        finals = engine_errors_to_api(work)
        rejected = next((out.error for out in finals if out.error), None)
        if rejected is not None:  # the engine refused it (checks here should have caught it first)
            raise APIError(400, rejected)
        return finals
    finally:
        work.cancel()
        watch.cancel()
        for s in streams:
            s.abort()
        ctx.drain.unregister(streams)


def engine_errors_to_api(task: asyncio.Future) -> Any:
    try:
        return task.result()
    except RequestRejected as e:
        raise APIError(e.status, str(e), e.param) from None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """text/event-stream whose requests are aborted whenever the response ends (a client that
    disconnects cancels the body iterator, and this `finally` frees the KV blocks at once). The
    events are strings; their body messages go to `RequestGuard`'s send (`guard.BODY_SEND`, when the
    scope has it), past the middlewares that only look at the response's start."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream], drain: Drain) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._streams = streams
        self._drain = drain
        self._body_send: Any = None

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        send = self._body_send or send
        charset = self.charset
        async for event in self.body_iterator:
            await send({"type": "http.response.body", "body": event.encode(charset), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._body_send = scope.get(BODY_SEND)
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()
            self._drain.unregister(self._streams)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def sse_error(e: BaseException) -> str:
    status = e.status if isinstance(e, (RequestRejected, APIError)) else 500
    return f"data: {error_json(status, str(e))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
json_str = json.encoder.encode_basestring  # what json.dumps(ensure_ascii=False) uses for a str (C)


def to_json(value: Any) -> str:
    """`value` as `sse` encodes it (compact, non-ASCII kept); None and strings take a shortcut."""
    if value is None:
        return "null"
    if value.__class__ is str:
        return json_str(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class ChunkFormat:
    """The SSE chunks of one streamed response, `data: {**head, "choices": [choice], "usage": null}`
    ("usage" with include_usage only), with the head and tail encoded once: `chunk(choice_json)` is
    byte-identical to `sse({**head, "choices": [choice], ...})`."""

    def __init__(self, head: dict, include_usage: bool) -> None:
        encoded = json.dumps(head, separators=(",", ":"), ensure_ascii=False)
        self.prefix = f'data: {encoded[:-1]},"choices":['
        self.suffix = "]" + (',"usage":null' if include_usage else "") + "}\n\n"

    def chunk(self, choice_json: str) -> str:
        return self.prefix + choice_json + self.suffix

    def text_chunk(self, index: int, chat: bool) -> tuple[str, str]:
        """(head, tail) of the commonest chunk, some text of a running choice without logprobs:
        `head + json_str(text) + tail` is `chunk(completion_choice_json(index, text, None, None,
        None))` (`chat_choice_json`'s for chat, text not empty)."""
        if chat:
            return f'{self.prefix}{{"index":{index},"delta":{{"content":', "}" + _RUNNING + self.suffix
        return f'{self.prefix}{{"index":{index},"text":', _RUNNING + self.suffix


_RUNNING = ',"logprobs":null,"finish_reason":null,"stop_reason":null}'  # a running choice's end, without logprobs


def completion_choice_json(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> str:
    """A streamed /v1/completions choice: {index, text, logprobs, finish_reason, stop_reason}."""
    return (
        f'{{"index":{index},"text":{json_str(text)},"logprobs":{to_json(logprobs)},'
        f'"finish_reason":{to_json(finish_reason)},"stop_reason":{to_json(stop_reason)}}}'
    )


def chat_choice_json(
    index: int, content: str, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> str:
    """A streamed chat choice: {index, delta: {content} ({} when content is empty), logprobs,
    finish_reason, stop_reason}."""
    delta = f'{{"content":{json_str(content)}}}' if content else "{}"
    return (
        f'{{"index":{index},"delta":{delta},"logprobs":{to_json(logprobs)},'
        f'"finish_reason":{to_json(finish_reason)},"stop_reason":{to_json(stop_reason)}}}'
    )


def chat_delta_json(
    index: int, delta: dict, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> str:
    """A streamed chat choice with any delta dict (reasoning_content, tool_calls, content)."""
    return (
        f'{{"index":{index},"delta":{to_json(delta)},"logprobs":{to_json(logprobs)},'
        f'"finish_reason":{to_json(finish_reason)},"stop_reason":{to_json(stop_reason)}}}'
    )


# ---------------------------------------------------------------------- usage and logprobs
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finite(x: float) -> float:
    """JSON has no infinities: clamp as vLLM does."""
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position (the engine's entry also holds the sampled one)."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return ranked[:k]


def chat_logprobs(
    ctx: ServingContext, token_ids: list[int], entries: list[dict[int, Logprob]], k: int
) -> dict[str, list]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""

    def item(tid: int, lp: Logprob) -> dict:
        text = ctx.token_text(tid)
        return {"token": text, "logprob": finite(lp.logprob), "bytes": list(text.encode())}

    content = []
    for tid, entry in zip(token_ids, entries):
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, lp) for t, lp in top_entries(entry, k)]})
    return {"content": content}


def completion_logprobs(
    ctx: ServingContext, token_ids: list[int], entries: Sequence[dict[int, Logprob] | None], k: int, offset: int
) -> dict[str, list]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset. An entry None
    (an echoed prompt's first token) gives a null logprob and null top_logprobs, as OpenAI's."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        text = ctx.token_text(tid)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(finite(entry[tid].logprob))
        top = {ctx.token_text(t): finite(lp.logprob) for t, lp in top_entries(entry, k)}
        top.setdefault(text, finite(entry[tid].logprob))
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs_json(
    token_ids: list[int], entries: Sequence[dict[int, Logprob] | None] | None, k: int
) -> list[dict[str, dict] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} with the prompt token and the k most likely (the engine may have scored more)."""
    if entries is None:
        return None
    out: list[dict[str, dict] | None] = []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        kept = dict(top_entries(entry, k))
        kept.setdefault(tid, entry[tid])
        out.append(
            {
                str(t): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in kept.items()
            }
        )
    return out
