#!/usr/bin/env python3
"""Make lesson 09's chat-template fixtures and what Hugging Face renders for them.

    pip install transformers jinja2      (no torch needed)
    python3 weights/tools/make_chat_template_cases.py [--out tests/data/chat_templates]

The C++ side (lessons/09_tokenizer_sampling/chat_template.h) has no Jinja interpreter: it recognises a
template's family and renders it with code. This script is its oracle. It writes, under --out:

  <name>/tokenizer_config.json   a fixture template in the form a Hub repository ships it (bos_token,
                                 eos_token, chat_template), written here from the families' real templates:
      llama3        Meta-Llama-3-8B-Instruct's template (BOS, headers, trimmed content)
      llama3_1      Llama-3.1-8B-Instruct's (system block with "Cutting Knowledge Date", fixed date
                    "26 Jul 2024", builtin_tools; its tool-call branch as 3.2's, which no case here reaches)
      llama3_2      Llama-3.2-1B-Instruct's (the same block; the date is strftime_now("%d %b %Y"))
      llama2        Llama-2-7b-chat-hf's ([INST] ... [/INST], <<SYS>> in the first user turn, roles must
                    alternate; bos/eos as AddedToken objects, as that repository has them)
      chatml        plain ChatML (<|im_start|>role\\ncontent<|im_end|>\\n), no default system prompt
      smollm2       SmolLM2-Instruct's ChatML with its default system prompt
      qwen2_5       Qwen2.5-Instruct's ChatML with tools branch and its default system prompt
      qwen3         Qwen3's (hybrid thinking): ChatML, no default system prompt, <think> blocks kept after the
                    last user query and dropped before it, enable_thinking (cases with False as well)
      mistral_v0_1_release  Mistral-7B-Instruct-v0.1's first template (no system message)
      mistral_v0_2  Mistral-7B-Instruct-v0.1/v0.2's current one (system folded into the first user turn)
      mistral_v0_3  Mistral-7B-Instruct-v0.3's (system folded into the last user turn, answers trimmed)
  The templates are written from the published tokenizer_config.json files as exactly as we could (no network
  here to fetch them): a fixture is what the C++ side is checked against, whatever its source.
  cases.json                     for every template (these and the bundled weights/tiny-llama3 one) and
                                 every conversation below: the string of
                                 tokenizer.apply_chat_template(messages, tokenize=False,
                                                               add_generation_prompt=...)
                                 and, for templates that read strftime_now, the date it returned.

The tokenizer object only carries the template and the special-token strings (tokenize=False never encodes):
it is built on the bundled tokenizer.json, so nothing is downloaded. Same bytes on every run with the same
transformers / jinja2 versions, except the "today" date of the strftime_now templates.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "weights" / "tiny-llama3"

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama 3.1 and 3.2 differ in the default date (fixed vs strftime_now) and 3.1's builtin_tools lines.
_LLAMA31_DATE = """{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}"""
_LLAMA32_DATE = """{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}"""
_LLAMA31_BUILTIN = """{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}"""
_LLAMA32_BUILTIN = """{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}"""

_LLAMA3X = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
@DATE@
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
@BUILTIN@
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA3_1 = _LLAMA3X.replace("@DATE@", _LLAMA31_DATE).replace("@BUILTIN@", _LLAMA31_BUILTIN)
LLAMA3_2 = _LLAMA3X.replace("@DATE@", _LLAMA32_DATE).replace("@BUILTIN@", _LLAMA32_BUILTIN)

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN2_5 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


# Qwen3's template (Qwen3-0.6B ... Qwen3-32B, the hybrid thinking models), written from the published
# tokenizer_config.json: no default system prompt; an assistant turn after the last user query keeps its
# reasoning in <think>...</think> (an empty block when it has none and is the last message), earlier ones
# lose it; enable_thinking=false adds an empty think block to the generation prompt.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Mistral-7B-Instruct-v0.1's template as first released: no system message at all, "[INST] " without a space
# in front, an answer followed by eos_token and a space.
MISTRAL_V0_1_RELEASE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Mistral-7B-Instruct-v0.1 / v0.2's current template (the 2024 update): an optional system message folded
# into the FIRST user turn, " [INST] " with a space in front (their tokenizer has [INST] as plain text).
MISTRAL_V0_2 = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# Mistral-7B-Instruct-v0.3's (control tokens [INST] [/INST], no spaces around them): the system message goes
# into the LAST user turn, and only when that turn is the conversation's last message; answers are trimmed.
MISTRAL_V0_3 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""


def added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False}


# name -> (tokenizer_config.json fields other than chat_template, template, family the C++ side must report)
FIXTURES = {
    "llama3": ({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, LLAMA3, "llama3"),
    "llama3_1": ({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, LLAMA3_1, "llama3.1"),
    "llama3_2": ({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, LLAMA3_2, "llama3.1"),
    "llama2": ({"bos_token": added_token("<s>"), "eos_token": added_token("</s>")}, LLAMA2, "llama2"),
    "chatml": ({"bos_token": None, "eos_token": "<|im_end|>"}, CHATML, "chatml"),
    "smollm2": ({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, SMOLLM2, "chatml"),
    "qwen2_5": ({"bos_token": None, "eos_token": "<|im_end|>"}, QWEN2_5, "chatml"),
    "qwen3": ({"bos_token": None, "eos_token": "<|im_end|>"}, QWEN3, "qwen3"),
    "mistral_v0_1_release": ({"bos_token": "<s>", "eos_token": "</s>"}, MISTRAL_V0_1_RELEASE, "mistral"),
    "mistral_v0_2": ({"bos_token": "<s>", "eos_token": "</s>"}, MISTRAL_V0_2, "mistral"),
    "mistral_v0_3": ({"bos_token": "<s>", "eos_token": "</s>"}, MISTRAL_V0_3, "mistral"),
}
# Templates that read enable_thinking: their cases are also rendered with enable_thinking=False.
THINKING_TEMPLATES = ("qwen3",)

SYSTEM = "You are a helpful assistant who knows about baking."
CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Give me one tip for baking bread."}],
    "system_user": [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Give me one tip for baking bread."}],
    "multi_turn": [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": "Give me one tip for baking bread."},
                   {"role": "assistant", "content": "Let the dough rise somewhere warm."},
                   {"role": "user", "content": "And for the crust?"}],
    "multi_turn_no_system": [{"role": "user", "content": "Hello!"},
                             {"role": "assistant", "content": "Hi. How can I help?"},
                             {"role": "user", "content": "Name a fruit."},
                             {"role": "assistant", "content": "A pear."},
                             {"role": "user", "content": "Another one?"}],
    "special_characters": [{"role": "system", "content": "Quotes \" ' and braces {{ x }} {% if %} stay as they are."},
                           {"role": "user", "content": "Grüße 👋 — “curly” \\ backslash, tab\there, newline\nthere, "
                                                       "<b>tags</b> & [INST] <<SYS>> <|im_start|> text"}],
    "whitespace_ends": [{"role": "system", "content": "  system with spaces \n"},
                        {"role": "user", "content": "\n\n  leading and trailing whitespace \t\r\n"},
                        {"role": "assistant", "content": "  an answer  "},
                        {"role": "user", "content": "\tinner  spaces   kept\t"}],
    # Python's str.strip() (Jinja's trim) also removes these: U+3000, U+00A0, U+0085, U+001F, U+2028.
    "unicode_whitespace_ends": [{"role": "user", "content": "\u3000\u00a0ideographic and no-break\u0085\u001f\u2028"},
                                {"role": "assistant", "content": "\u2003em space\u200b"},
                                {"role": "user", "content": "\u200bzero width is not whitespace\u200b"}],
    "empty_content": [{"role": "user", "content": ""}],
    "whitespace_only": [{"role": "system", "content": "   "}, {"role": "user", "content": " \n "}],
    "two_user_turns": [{"role": "user", "content": "First question."}, {"role": "user", "content": "Second."}],
    "assistant_last": [{"role": "user", "content": "Finish this: bread is"},
                       {"role": "assistant", "content": "made of flour"}],
}
CONVERSATIONS.update({
    # Reasoning in the history (Qwen3 drops it from turns before the last user query, keeps it after).
    "thinking_history": [{"role": "user", "content": "What is 2+2?"},
                         {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
                         {"role": "user", "content": "And 3+3?"}],
    "thinking_last": [{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "Knead how long?"},
                      {"role": "assistant", "content": "<think>\n\nTen minutes is usual.\n\n</think>\n\n\nAbout ten minutes."}],
    "thinking_odd_tags": [{"role": "user", "content": "x"},
                          {"role": "assistant", "content": "no opening tag</think>  answer </think>\nlast"},
                          {"role": "user", "content": "y"},
                          {"role": "assistant", "content": "<think>a<think>b</think>c"}],
    "system_in_the_middle": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be terse."},
                             {"role": "user", "content": "Hello?"}],
    "system_user_answered": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "One tip?"},
                             {"role": "assistant", "content": " Use steam. "}],
})
NO_GENERATION_PROMPT = ("user_only", "multi_turn", "assistant_last", "thinking_last")  # also rendered with add_generation_prompt=False


def token_content(value) -> str | None:
    if isinstance(value, dict):
        return value["content"]
    return value


def make_tokenizer(config: dict):
    from transformers import PreTrainedTokenizerFast

    kwargs = {"tokenizer_file": str(BUNDLED / "tokenizer.json"), "chat_template": config["chat_template"]}
    for key in ("bos_token", "eos_token"):
        if config.get(key) is not None:
            kwargs[key] = token_content(config[key])
    return PreTrainedTokenizerFast(**kwargs)


def render(tok, messages, add_generation_prompt: bool, enable_thinking: bool | None = None):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       **kwargs), None
    except Exception as e:  # the template raised (Llama 2: roles must alternate)
        return None, str(e)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "chat_templates")
    args = ap.parse_args()
    import jinja2
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    templates = []
    configs = {}
    for name, (fields, template, family) in FIXTURES.items():
        config = {k: v for k, v in fields.items() if v is not None}
        config["chat_template"] = template
        (args.out / name).mkdir(exist_ok=True)
        with open(args.out / name / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
        configs[name] = config
        templates.append({"name": name, "dir": f"tests/data/chat_templates/{name}", "family": family})
    with open(BUNDLED / "tokenizer_config.json", encoding="utf-8") as f:
        configs["bundled"] = json.load(f)
    templates.append({"name": "bundled", "dir": "weights/tiny-llama3", "family": "llama3"})

    cases = []
    for t in templates:
        config = configs[t["name"]]
        tok = make_tokenizer(config)
        uses_today = "strftime_now" in config["chat_template"]
        for conv_name, messages in CONVERSATIONS.items():
            thinking = (None, False) if t["name"] in THINKING_TEMPLATES else (None,)
            for agp, think in [(a, k) for a in ((True, False) if conv_name in NO_GENERATION_PROMPT else (True,))
                               for k in thinking]:
                before = datetime.now().strftime("%d %b %Y")
                rendered, error = render(tok, messages, agp, think)
                after = datetime.now().strftime("%d %b %Y")
                if before != after:
                    raise SystemExit("error: the date changed while rendering; run again")
                case = {"template": t["name"], "conversation": conv_name, "add_generation_prompt": agp,
                        "today": before if uses_today else None}
                if think is not None:
                    case["enable_thinking"] = think
                if error is not None:
                    case["error"] = error
                else:
                    case["rendered"] = rendered
                cases.append(case)

    out = {
        "producer": "weights/tools/make_chat_template_cases.py",
        "versions": {"transformers": transformers.__version__, "jinja2": jinja2.__version__},
        "call": "tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)",
        "templates": templates,
        "conversations": CONVERSATIONS,
        "cases": cases,
    }
    with open(args.out / "cases.json", "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    errors = sum("error" in c for c in cases)
    print(f"wrote {len(templates) - 1} fixture templates and {len(cases)} cases ({errors} template errors) "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
