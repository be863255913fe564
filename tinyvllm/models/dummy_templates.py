"""Chat templates of the dummy checkpoints' families, written for tinyvllm in the prompt formats the
published Instruct checkpoints use (a real checkpoint brings its own template; these only make the
dummy ones chat like it).

* :data:`QWEN3_CHAT_TEMPLATE`: Qwen3's ChatML. An optional system turn (with a ``# Tools`` section
  listing ``tools`` as JSON lines), ``<|im_start|>role\\ncontent<|im_end|>\\n`` turns, assistant
  tool calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, consecutive tool
  results grouped in one user turn as ``<tool_response>`` blocks, reasoning
  (``reasoning_content``, or the text before ``</think>``) kept as a ``<think>`` block only on the
  assistant turns after the last real user query, and, with ``add_generation_prompt``, the
  assistant header followed by an empty ``<think>\\n\\n</think>\\n\\n`` when
  ``enable_thinking=False``.
* :data:`QWEN2_CHAT_TEMPLATE`: Qwen2.5-Instruct's ChatML: the same turns without reasoning, and a
  default system prompt ("You are Qwen, created by Alibaba Cloud. ...") when none is given.
* :data:`LLAMA3_CHAT_TEMPLATE`: Llama 3.x Instruct's header format: BOS, then
  ``<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>`` per message. With ``tools``, as
  Llama 3.1/3.2's template does: a system turn ``Environment: ipython`` with the knowledge and today's
  date (``date_string``, default "26 Jul 2024") and the system message, then the tools as indented
  JSON with the instructions to answer ``{"name": ..., "parameters": ...}``, put in the first user
  turn; an assistant tool call rendered as that JSON (one call per turn, as Llama's template
  demands); tool results as ``ipython`` turns. Without tools there is no dated system turn (only a
  given system message), unlike the real template.
* :data:`MISTRAL_CHAT_TEMPLATE`: Mistral-7B-Instruct-v0.1's ``<s>[INST] user [/INST]assistant</s> ``
  format; roles must alternate user/assistant, starting with user.
"""

from __future__ import annotations

_QWEN_TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_QWEN_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)

# Tool results: consecutive "tool" messages share one user turn.
_QWEN_TOOL_RESULT = """\
{%- macro tool_result(index) -%}
    {%- if index == 0 or messages[index - 1].role != 'tool' -%}<|im_start|>user{%- endif -%}
    {{- '\\n<tool_response>\\n' + messages[index].content + '\\n</tool_response>' -}}
    {%- if index == messages|length - 1 or messages[index + 1].role != 'tool' -%}<|im_end|>{{ '\\n' }}{%- endif -%}
{%- endmacro -%}
"""

QWEN3_CHAT_TEMPLATE = (
    (
        _QWEN_TOOL_RESULT
        + """\
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if has_system else '') -}}
    {{- "@TOOLS_INTRO@" -}}
    {%- for tool in tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}
    {{- "@TOOLS_OUTRO@" -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}
{%- endif -%}
{#- The last real user query: a user turn that is not only a wrapped tool response. -#}
{%- set state = namespace(last_query=messages|length - 1, searching=true) -%}
{%- for i in range(messages|length - 1, -1, -1) -%}
    {%- set m = messages[i] -%}
    {%- if state.searching and m.role == 'user'
          and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) -%}
        {%- set state.searching = false -%}
        {%- set state.last_query = i -%}
    {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- set i = loop.index0 -%}
    {%- if m.role == 'user' or (m.role == 'system' and i > 0) -%}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set answer = m.content -%}
        {%- set thought = '' -%}
        {%- if m.reasoning_content is defined and m.reasoning_content is not none -%}
            {%- set thought = m.reasoning_content -%}
        {%- elif '</think>' in m.content -%}
            {%- set parts = m.content.split('</think>') -%}
            {%- set answer = parts[-1].lstrip('\\n') -%}
            {%- set thought = parts[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if i > state.last_query and (loop.last or thought) -%}
            {{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + answer.lstrip('\\n') -}}
        {%- else -%}
            {{- answer -}}
        {%- endif -%}
        {%- for call in m.tool_calls or [] -%}
            {%- if answer or not loop.first -%}{{- '\\n' -}}{%- endif -%}
            {%- set fn = call.function if call.function else call -%}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif m.role == 'tool' -%}
        {{- tool_result(i) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""
    )
    .replace("@TOOLS_INTRO@", _QWEN_TOOLS_INTRO)
    .replace("@TOOLS_OUTRO@", _QWEN_TOOLS_OUTRO)
)
"""Qwen3 (hybrid thinking) chat format; see the module docstring."""

QWEN2_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

QWEN2_CHAT_TEMPLATE = (
    _QWEN_TOOL_RESULT
    + """\
{%- set system = messages[0].content if messages[0].role == 'system' else '@DEFAULT_SYSTEM@' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' + system + '\\n\\n' -}}
    {{- "@TOOLS_INTRO@" -}}
    {%- for tool in tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}
    {{- "@TOOLS_OUTRO@" -}}
{%- else -%}
    {{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- set i = loop.index0 -%}
    {%- if m.role == 'user' or (m.role == 'system' and i > 0) or (m.role == 'assistant' and not m.tool_calls) -%}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
    {%- elif m.role == 'assistant' -%}
        {{- '<|im_start|>assistant' + ('\\n' + m.content if m.content else '') -}}
        {%- for call in m.tool_calls -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
            {{- fn.arguments | tojson + '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif m.role == 'tool' -%}
        {{- tool_result(i) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
).replace("@DEFAULT_SYSTEM@", QWEN2_DEFAULT_SYSTEM)
QWEN2_CHAT_TEMPLATE = QWEN2_CHAT_TEMPLATE.replace("@TOOLS_INTRO@", _QWEN_TOOLS_INTRO).replace(
    "@TOOLS_OUTRO@", _QWEN_TOOLS_OUTRO
)
"""Qwen2.5-Instruct chat format; see the module docstring."""

MISTRAL_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- for m in messages -%}
    {%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {%- elif m.role == 'user' -%}
        {{- '[INST] ' + m.content + ' [/INST]' -}}
    {%- elif m.role == 'assistant' -%}
        {{- m.content + eos_token + ' ' -}}
    {%- else -%}
        {{- raise_exception('Only user and assistant roles are supported!') -}}
    {%- endif -%}
{%- endfor -%}
"""
"""Mistral-7B-Instruct-v0.1 chat format; see the module docstring."""

LLAMA3_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- macro text(message) -%}
    {%- if message.content is string -%}{{- message.content -}}
    {%- elif message.content is mapping -%}{{- message.content | tojson -}}
    {%- elif message.content -%}
        {{- message.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -}}
    {%- endif -%}
{%- endmacro -%}
{%- set messages_left = messages -%}
{%- if tools is not none -%}
    {%- set date = date_string if date_string is defined else '26 Jul 2024' -%}
    {%- set system = '' -%}
    {%- if messages[0].role == 'system' -%}
        {%- set system = text(messages[0]) | trim -%}
        {%- set messages_left = messages_left[1:] -%}
    {%- endif -%}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n' -}}
    {{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date + '\\n\\n' + system + '<|eot_id|>' -}}
    {%- if not messages_left -%}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") -}}
    {%- endif -%}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Given the following functions, please respond with a JSON for a function call ' -}}
    {{- 'with its proper arguments that best answers the given prompt.\\n\\n' -}}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' -}}
    {{- 'Do not use variables.\\n\\n' -}}
    {%- for t in tools -%}{{- t | tojson(indent=4) + '\\n\\n' -}}{%- endfor -%}
    {{- text(messages_left[0]) | trim + '<|eot_id|>' -}}
    {%- set messages_left = messages_left[1:] -%}
{%- endif -%}
{%- for m in messages_left -%}
    {%- if m.role == 'tool' or m.role == 'ipython' -%}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + text(m) + '<|eot_id|>' -}}
    {%- elif m.tool_calls -%}
        {%- if m.tool_calls | length != 1 -%}
            {{- raise_exception('This model only supports single tool-calls at once!') -}}
        {%- endif -%}
        {%- set call = m.tool_calls[0].function -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' -}}
    {%- else -%}
        {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + text(m) | trim + '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}
"""
"""Llama 3.x Instruct chat format; see the module docstring."""
