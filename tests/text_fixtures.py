"""Model directories in the styles of the major chat-model families, built in-test.

Shared by tests/test_text_tokenizer.py and tests/test_text_chat_template.py (no tests here).
Each style trains a tiny tokenizer with the ``tokenizers`` library (well under a second) and
writes ``tokenizer.json`` plus ``tokenizer_config.json`` / ``chat_template.jinja`` /
``special_tokens_map.json`` / ``generation_config.json`` / ``config.json`` the way the real
repositories lay them out. The templates are written here, modelled on the real ones (Qwen2.5,
Qwen3 without thinking by default, Llama 3.2, Mistral-7B-Instruct-v0.1, Gemma, Hermes-2-Pro).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "Hello world! This is a tiny corpus for a tiny tokenizer.",
    "The weather in Paris is sunny; the weather in Tokyo is rainy.",
    "Ünïcödé café naïve 日本語 😀 — tabs\tand  spaces\n\nnew lines.",
    'def f(x):\n    return {"name": x, "arguments": [1, 2, 3]}\n',
    "You are a helpful assistant. What is 2 + 2? The answer is 4.",
    "system user assistant tool model function call response",
] * 8

QWEN25 = """{%- if tools %}
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

# Qwen3-like: no default system prompt, reasoning rendered in <think>, enable_thinking=False
# closes an empty think block in the generation prompt, namespace() for the last user turn.
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
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and ns.last_query_index == messages|length - 1 %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content if message.content is string else '' %}
        {%- if message.reasoning_content is string and loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
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
        {{- message.content }}
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
{%- endif %}
"""

LLAMA3 = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
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

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Hermes-2-Pro style "tool_use" template (the second of a named list).
HERMES_TOOL_USE = """{{- bos_token }}
{{- '<|im_start|>system\\nYou are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. Here are the available tools: <tools> ' }}
{%- for tool in tools %}
    {%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
    {{- '{"type": "function", "function": ' }}{{- tool | tojson }}{{- '}' }}
    {%- if not loop.last %}{{- ' ' }}{%- endif %}
{%- endfor %}
{{- ' </tools>\\nFor each function call return a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:\\n<tool_call>\\n{"arguments": <args-dict>, "name": <function-name>}\\n</tool_call><|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" or (message.role == "assistant" and message.tool_calls is not defined) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n' }}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '{"arguments": ' }}{{- tool_call.arguments | tojson }}{{- ', "name": "' + tool_call.name + '"}' }}
            {{- '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}{{- '<|im_start|>tool\\n' }}{%- endif %}
        {{- '<tool_response>\\n' }}{{- message.content }}
        {%- if not loop.last %}{{- '\\n</tool_response>\\n' }}{%- else %}{{- '\\n</tool_response>' }}{%- endif %}
        {%- if not loop.last and loop.nextitem.role != "tool" %}{{- '<|im_end|>' }}{%- elif loop.last %}{{- '<|im_end|>' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>"]

STYLES = ("qwen25", "qwen3", "llama3", "mistral", "gemma", "hermes")


# Qwen2's pre-tokenizer split (as in its tokenizer.json and transformers' Qwen2Tokenizer).
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_bpe(
    specials: list[str], *, flavor: str = "byte_level", vocab_size: int = 600
) -> Tokenizer:
    """A BPE tokenizer trained on CORPUS. ``flavor``: ``"byte_level"`` (GPT-2 / Llama 3 style),
    ``"qwen"`` (NFC + Qwen's split regex + byte-level, Qwen2's exact pipeline) or
    ``"metaspace"`` (sentencepiece-like, with ``<unk>`` for unseen characters)."""
    if flavor == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = []
    elif flavor == "qwen":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _bos_processor(
    tok: Tokenizer, bos: str, *, byte_level: bool = True
) -> processors.PostProcessor:
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    if not byte_level:
        return template
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])


def _added(tok: Tokenizer, token: str, special: bool) -> dict:
    return {
        "content": token,
        "lstrip": False,
        "normalized": not special,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def _decoder_entries(tok: Tokenizer) -> dict:
    return {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }


def _write(directory: Path, name: str, value) -> None:
    (directory / name).write_text(json.dumps(value, indent=2, ensure_ascii=False), encoding="utf-8")


def make_model_dir(root: Path, style: str) -> Path:
    """Write a ``style`` model directory under ``root`` and return it."""
    d = root / style
    d.mkdir(parents=True)
    if style in ("qwen25", "qwen3", "hermes"):
        tok = train_bpe(CHATML_SPECIALS, flavor="qwen")
        extra = ["<tool_call>", "</tool_call>"] + (
            ["<think>", "</think>"] if style == "qwen3" else []
        )
        tok.add_tokens(extra)  # Qwen's tool / think markers are added but not special tokens
        tok.post_processor = processors.ByteLevel(
            add_prefix_space=False, trim_offsets=False, use_regex=False
        )
        ids = {t: tok.token_to_id(t) for t in CHATML_SPECIALS}
        if style == "hermes":  # legacy layout: tokens only in special_tokens_map.json
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
                "chat_template": [
                    {"name": "default", "template": CHATML},
                    {"name": "tool_use", "template": HERMES_TOOL_USE},
                ],
            }
            _write(
                d,
                "special_tokens_map.json",
                {
                    "bos_token": {
                        "content": "<|endoftext|>",
                        "lstrip": False,
                        "normalized": False,
                        "rstrip": False,
                        "single_word": False,
                    },
                    "eos_token": "<|im_end|>",
                },
            )
        else:
            config = {
                "add_bos_token": False,
                "add_prefix_space": False,
                "added_tokens_decoder": _decoder_entries(tok),
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "bos_token": None,
                "chat_template": QWEN25 if style == "qwen25" else QWEN3,
                "clean_up_tokenization_spaces": False,
                "eos_token": "<|im_end|>",
                "errors": "replace",
                "model_max_length": 131072,
                "pad_token": "<|endoftext|>",
                "split_special_tokens": False,
                "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None,
            }
            if style == "qwen3":
                config["image_token"] = "<|image_pad|>"  # model-specific, not in tokenizer.json
            _write(d, "config.json", {"model_type": "qwen2" if style == "qwen25" else "qwen3"})
            _write(
                d,
                "generation_config.json",
                {
                    "bos_token_id": ids["<|endoftext|>"],
                    "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                },
            )
    elif style == "llama3":
        tok = train_bpe(LLAMA3_SPECIALS)
        tok.post_processor = _bos_processor(tok, "<|begin_of_text|>")
        ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIALS}
        config = {
            "bos_token": "<|begin_of_text|>",
            "chat_template": LLAMA3,
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": _decoder_entries(tok),
        }
        _write(
            d,
            "generation_config.json",
            {
                "bos_token_id": ids["<|begin_of_text|>"],
                "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]],
            },
        )
    elif style == "mistral":
        tok = train_bpe(MISTRAL_SPECIALS, flavor="metaspace")
        tok.post_processor = _bos_processor(tok, "<s>", byte_level=False)

        def added_token(content):
            return {
                "__type": "AddedToken",
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
            }

        config = {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": added_token("<s>"),
            "eos_token": added_token("</s>"),
            "unk_token": added_token("<unk>"),
            "pad_token": None,
            "chat_template": MISTRAL,
            "clean_up_tokenization_spaces": False,
            "legacy": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    elif style == "gemma":
        tok = train_bpe(GEMMA_SPECIALS)
        tok.post_processor = _bos_processor(tok, "<bos>")
        ids = {t: tok.token_to_id(t) for t in GEMMA_SPECIALS}
        config = {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "mask_token": "<mask>",  # not in tokenizer.json: added with a new id on load
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"],
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        (d / "chat_template.jinja").write_text(GEMMA, encoding="utf-8")  # the newer layout
        _write(d, "generation_config.json", {"eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]})
    else:
        raise ValueError(style)
    tok.save(str(d / "tokenizer.json"))
    _write(d, "tokenizer_config.json", config)
    return d


# Conversations (OpenAI-style tool calls: arguments as a dict).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Weather in a city <now> & "today" (é)',
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City"}},
            "required": ["city"],
        },
    },
}
USER_ONLY = [{"role": "user", "content": "Hello world! What is 2 + 2?"}]
MULTI_TURN = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "The answer is 4."},
    {"role": "user", "content": "  Ünïcödé café 😀\n"},
]
WITH_SYSTEM = [{"role": "system", "content": "You are a helpful assistant."}] + MULTI_TURN
TOOL_CALLS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "name": "get_weather", "content": '{"weather": "sunny", "temp": 21}'},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "And in Tokyo?"},
]
