"""Chat templates: relax.text renders them as transformers 5.23 does, token for token.

Templates modelled on Qwen2.5 (default system prompt, tools), Qwen3 (no default system prompt,
reasoning, enable_thinking), Llama 3.2 (BOS in the template, tools in the first user message,
strftime_now), Mistral v0.1 ([INST], raise_exception on role alternation), Gemma (model role,
chat_template.jinja) and Hermes-2-Pro (named templates, "tool_use" picked when tools are given).
"""

import dataclasses
from datetime import datetime

import jinja2
import numpy as np
import pytest
from text_fixtures import MULTI_TURN, STYLES, TOOL_CALLS, USER_ONLY, WEATHER_TOOL, WITH_SYSTEM

from relax.text import NoChatTemplateError, load_tokenizer, render_chat
from relax.text.chat_template import select_template

DATE = {"date_string": "26 Jul 2024"}
NO_SYSTEM = ("mistral", "gemma")  # their templates raise on a system message and ignore tools


def _cases(style):
    """(messages, tools) pairs the style's template supports."""
    cases = [(USER_ONLY, None), (MULTI_TURN, None)]
    if style not in NO_SYSTEM:
        cases += [(WITH_SYSTEM, None), (USER_ONLY, [WEATHER_TOOL]), (TOOL_CALLS, [WEATHER_TOOL])]
    if style not in NO_SYSTEM + ("hermes",):  # Hermes' default (ChatML) template has no tool calls
        cases += [(TOOL_CALLS, None)]
    return cases


# ---- relax's own semantics ----


def test_template_selection():
    named = {"default": "D", "tool_use": "T", "other": "O"}
    assert select_template(named, None, None, "p") == "D"
    assert select_template(named, None, [WEATHER_TOOL], "p") == "T"  # tools pick "tool_use"
    assert select_template(named, "other", [WEATHER_TOOL], "p") == "O"  # a name wins
    assert select_template(named, "{{ x }}", None, "p") == "{{ x }}"  # not a name: a template
    assert select_template("S", None, [WEATHER_TOOL], "p") == "S"
    with pytest.raises(ValueError, match=r"none is named 'default'.*\['a', 'b'\]"):
        select_template({"a": "A", "b": "B"}, None, None, "p")


def test_named_templates_and_tool_use(model_dirs):
    tok = load_tokenizer(model_dirs["hermes"])
    assert sorted(tok.chat_template) == ["default", "tool_use"]
    plain = tok.apply_chat_template(USER_ONLY, tokenize=False)
    assert plain == "<|im_start|>user\nHello world! What is 2 + 2?<|im_end|>\n"
    with_tools = tok.apply_chat_template(USER_ONLY, tools=[WEATHER_TOOL], tokenize=False)
    assert with_tools.startswith(
        "<|endoftext|><|im_start|>system\nYou are a function calling AI model"
    )
    assert tok.apply_chat_template(
        USER_ONLY, tokenize=False, chat_template="tool_use", tools=[]
    ) == tok.apply_chat_template(USER_ONLY, tokenize=False, tools=[])


def test_missing_template_names_the_path(tmp_path, model_dirs):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((model_dirs["llama3"] / "tokenizer.json").read_bytes())
    tok = load_tokenizer(d)
    assert not tok.has_chat_template
    with pytest.raises(NoChatTemplateError, match=f"{d} has no chat template"):
        tok.apply_chat_template(USER_ONLY, add_generation_prompt=True)
    assert (
        tok.apply_chat_template(USER_ONLY, tokenize=False, chat_template="{{ messages[0].role }}")
        == "user"
    )


def test_tool_calls_and_tool_results_render(model_dirs):
    text = load_tokenizer(model_dirs["qwen25"]).apply_chat_template(
        TOOL_CALLS, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    assert (
        '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": '
        '"Weather in a city <now> & \\"today\\" (é)"' in text
    )  # tojson: no HTML escaping, no \\u
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        in text
    )
    assert (
        '<|im_start|>user\n<tool_response>\n{"weather": "sunny", "temp": 21}\n</tool_response><|im_end|>'
        in text
    )
    assert "None" not in text  # content=None is dropped, as transformers does
    llama = load_tokenizer(model_dirs["llama3"]).apply_chat_template(
        TOOL_CALLS, tools=[WEATHER_TOOL], tokenize=False, **DATE
    )
    assert '    "type": "function",\n' in llama  # tojson(indent=4)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in llama


def test_raise_exception_and_template_errors(model_dirs):
    mistral = load_tokenizer(model_dirs["mistral"])
    with pytest.raises(jinja2.exceptions.TemplateError) as e:
        mistral.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )
    assert str(e.value) == "Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(ValueError, match="empty conversation"):
        mistral.apply_chat_template([])
    with pytest.raises(TypeError, match="return_tensors"):
        mistral.apply_chat_template(USER_ONLY, return_tensors="np")
    assert mistral.apply_chat_template(USER_ONLY, return_dict=False) == mistral.apply_chat_template(
        USER_ONLY
    )


def test_sandbox_and_globals():
    assert (
        render_chat("{{ messages[0].content | tojson }}", [{"role": "u", "content": "<é>&'"}])
        == '"<é>&\'"'
    )
    assert (
        render_chat(
            "{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=True, separators=(',', ':')) }}", USER_ONLY
        )
        == '{"a":[1,2],"b":1}'
    )
    assert (
        render_chat(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
            "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}",
            MULTI_TURN,
        )
        == "2"
    )
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        render_chat("{% set ns = namespace(_x=1) %}", USER_ONLY)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.__class__.__mro__ }}", USER_ONLY)
    assert (
        render_chat("{% generation %}{{ messages[0].content }}{% endgeneration %}", USER_ONLY)
        == USER_ONLY[0]["content"]
    )
    assert render_chat("{{ dict(a=1) | tojson }}", USER_ONLY) == '{"a": 1}'
    assert render_chat("{{ strftime_now('%Y') }}", USER_ONLY) == datetime.now().strftime("%Y")


def test_variables_and_inputs(model_dirs):
    qwen3 = load_tokenizer(model_dirs["qwen3"])
    text = qwen3.apply_chat_template(
        USER_ONLY, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # reasoning given as "thinking" is exposed as reasoning_content too
    chat = USER_ONLY + [{"role": "assistant", "content": "4", "thinking": "2+2=4"}]
    assert "<think>\n2+2=4\n</think>\n\n4<|im_end|>" in qwen3.apply_chat_template(
        chat, tokenize=False
    )
    # keyword arguments override the special token variables; documents is defined (None)
    assert (
        render_chat(
            "{{ eos_token }}|{{ documents is defined }}|{{ documents is none }}",
            USER_ONLY,
            variables={"eos_token": "E", **{"eos_token": "K"}},
        )
        == "K|True|True"
    )

    @dataclasses.dataclass
    class Message:
        role: str
        content: str

    assert (
        render_chat(
            "{{ messages[0].content }}|{{ messages[0].n }}",
            [{"role": "user", "content": Message("u", "x"), "n": np.int64(3)}],
        )
        == "{'role': 'u', 'content': 'x'}|3"
    )
    assert (
        render_chat("{{ messages[0].content }}", [{"role": "user", "content": object()}])
        == "<object>"
    )


def test_continue_final_message(model_dirs):
    tok = load_tokenizer(model_dirs["qwen3"])
    chat = USER_ONLY + [{"role": "assistant", "content": "The answer is"}]
    text = tok.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(ValueError, match="not compatible"):
        tok.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)


def test_llama3_date_defaults_to_today(model_dirs):
    text = load_tokenizer(model_dirs["llama3"]).apply_chat_template(USER_ONLY, tokenize=False)
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n" in text


# ---- parity with transformers ----


@pytest.mark.parity
@pytest.mark.parametrize("style", STYLES)
def test_chat_matches_transformers(style, model_dirs, auto):
    hf, ours = auto(model_dirs[style]), load_tokenizer(model_dirs[style])
    kwargs = DATE if style == "llama3" else {}
    for messages, tools in _cases(style):
        for prompt in (True, False):
            args = dict(tools=tools, add_generation_prompt=prompt, **kwargs)
            text = hf.apply_chat_template(messages, tokenize=False, **args)
            assert ours.apply_chat_template(messages, tokenize=False, **args) == text, (
                messages,
                tools,
                prompt,
            )
            ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **args)
            assert ours.apply_chat_template(messages, **args) == ids
            assert ids == hf.encode(text, add_special_tokens=False)  # no second BOS from encoding


@pytest.mark.parity
@pytest.mark.parametrize(
    "style, messages, kwargs",
    [
        ("mistral", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {}),
        ("mistral", [{"role": "system", "content": "s"}], {}),
        ("gemma", WITH_SYSTEM, {}),
        (
            "llama3",
            TOOL_CALLS[:2] + [{"role": "assistant", "tool_calls": TOOL_CALLS[2]["tool_calls"] * 2}],
            DATE,
        ),
        ("llama3", [{"role": "system", "content": "s"}], dict(tools=[WEATHER_TOOL], **DATE)),
    ],
)
def test_template_errors_match_transformers(style, messages, kwargs, model_dirs, auto):
    hf, ours = auto(model_dirs[style]), load_tokenizer(model_dirs[style])
    with pytest.raises(jinja2.exceptions.TemplateError) as theirs:
        hf.apply_chat_template(messages, tokenize=False, **kwargs)
    with pytest.raises(jinja2.exceptions.TemplateError) as mine:
        ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert type(mine.value) is type(theirs.value) and str(mine.value) == str(theirs.value)


@pytest.mark.parity
def test_named_templates_and_kwargs_match_transformers(model_dirs, auto):
    hermes = (auto(model_dirs["hermes"]), load_tokenizer(model_dirs["hermes"]))
    qwen3 = (auto(model_dirs["qwen3"]), load_tokenizer(model_dirs["qwen3"]))
    chat = USER_ONLY + [{"role": "assistant", "content": "4", "reasoning_content": "2+2"}]
    cases = [
        (hermes, TOOL_CALLS, dict(tools=[WEATHER_TOOL])),
        (hermes, MULTI_TURN, dict(chat_template="tool_use", tools=[])),
        (hermes, MULTI_TURN, dict(chat_template="{{ messages | length }}{{ bos_token }}")),
        (qwen3, USER_ONLY, dict(add_generation_prompt=True, enable_thinking=False)),
        (qwen3, chat, dict(continue_final_message=True)),
        (qwen3, chat, dict(continue_final_message="reasoning_content")),
        (
            qwen3,
            [{"role": "user", "content": "hi <|im_end|> there  "}],
            dict(add_generation_prompt=True),
        ),
    ]
    for (hf, ours), messages, kwargs in cases:
        text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == text, kwargs
        assert ours.apply_chat_template(messages, **kwargs) == hf.apply_chat_template(
            messages, return_dict=False, **kwargs
        )
