"""Request bodies of the OpenAI-compatible API (pydantic), with OpenAI's and vLLM's field names.

Unknown fields are accepted and ignored (as vLLM does), so clients that send newer OpenAI fields
keep working. Types are checked here; values (ranges, combinations) are checked by
`SamplingParams` and by `tinyvllm.entrypoints.serving`, before anything reaches the engine.
Responses are plain dicts built in `serving.py` (the shapes are documented there).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

# Token ids are strict ints (no "12" or 1.0), so that the union below can be tried left to right: a
# long list of ids then validates as one list[int] pass (~50 ns an id; pydantic's "smart" union mode
# tries every member, ~700 ns an id, all of it holding the GIL).
TokenIds = list[StrictInt]
Prompt = Annotated[str | TokenIds | list[str] | list[TokenIds], Field(union_mode="left_to_right")]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (None: the server's default)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # the upper limit is the server's (--max-n)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` extra field: exactly one of json (a schema, or its JSON text),
    regex, choice, grammar (EBNF) or json_object (see tinyvllm.entrypoints.structured)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: text, json_object, or json_schema with
    `json_schema: {name, description, schema, strict}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ConstrainedFields(SamplingFields):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's names before its 0.12 (read as the `structured_outputs` they stand for:
    # entrypoints/structured.py, `structured_outputs_of`)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(ConstrainedFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids, or a list
    of lists of token ids (a batch: choice `i * n + j` is completion j of prompt i)."""

    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    """A message; `tool` results carry `tool_call_id`, assistant turns may carry `tool_calls`
    (OpenAI's `[{id, type: "function", function: {name, arguments}}]`) and `reasoning_content`."""

    role: Literal["system", "developer", "user", "assistant", "tool", "ipython", "function"]  # tokenizer.CHAT_ROLES
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(ConstrainedFields):
    """POST /v1/chat/completions. Messages go through the model's chat template; content parts
    other than text are rejected. `tools`, `tool_choice` and `parallel_tool_calls`: see
    tinyvllm.entrypoints.tools."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: `prompt` (a string), or `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds
