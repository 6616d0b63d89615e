"""The environment protocol, tools and tool-call parsing (issue 22, part 1)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from relax.environments import (
    Action,
    Tool,
    ToolCall,
    ToolEnvironment,
    as_async,
    check_arguments,
    parse_tool_calls,
    step_all,
)

MULTIPLY = Tool(
    "multiply",
    "Multiply two integers.",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    lambda a, b: a * b,
)
LOOKUP = Tool(
    "lookup",
    "Look a key up.",
    {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    lambda key: {"x": 1}[key],
)


def hermes(name, **args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_hermes_calls_and_errors():
    text = f"Let me compute.\n{hermes('multiply', a=12, b=34)}\nand {hermes('lookup', key='x')}"
    calls, errors = parse_tool_calls(text, "hermes", (MULTIPLY, LOOKUP))
    assert (
        calls == [ToolCall("multiply", {"a": 12, "b": 34}), ToolCall("lookup", {"key": "x"})]
        and errors == []
    )
    as_string = (
        '<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}</tool_call>'
    )
    assert parse_tool_calls(as_string, "hermes", (MULTIPLY,))[0] == [
        ToolCall("multiply", {"a": 2, "b": 3})
    ]
    bad = [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        hermes("divide", a=1, b=2),
        hermes("multiply", a=1),
        hermes("multiply", a=1, b="2"),
        hermes("multiply", a=1, b=2, c=3),
        hermes("multiply", a=True, b=2),
        '<tool_call>{"name": "multiply"',
    ]
    for text in bad:
        calls, errors = parse_tool_calls(text, "hermes", (MULTIPLY,))
        assert calls == [] and len(errors) == 1, (text, errors)
    assert "unknown tool 'divide'" in parse_tool_calls(bad[2], "hermes", (MULTIPLY,))[1][0]
    assert parse_tool_calls("The answer is 408.", "hermes", (MULTIPLY,)) == ([], [])


def test_llama3_calls():
    calls, errors = parse_tool_calls(
        '<|python_tag|>{"name": "multiply", "parameters": {"a": 2, "b": 5}}', "llama3", (MULTIPLY,)
    )
    assert calls == [ToolCall("multiply", {"a": 2, "b": 5})] and not errors
    two = '{"name": "multiply", "parameters": {"a": 1, "b": 2}}; {"name": "lookup", "parameters": {"key": "x"}}'
    assert [c.name for c in parse_tool_calls(two, "llama3", (MULTIPLY, LOOKUP))[0]] == [
        "multiply",
        "lookup",
    ]
    assert parse_tool_calls("It is 10.", "llama3", (MULTIPLY,)) == ([], [])
    assert len(parse_tool_calls("{oops", "llama3", (MULTIPLY,))[1]) == 1
    with pytest.raises(ValueError, match="tool call format"):
        parse_tool_calls("", "xml")
    assert check_arguments(MULTIPLY, {"a": 1, "b": 2}) is None


def exact(row, text):
    return float(text.strip() == row["answer"])


def test_a_deeply_nested_call_is_an_error_not_a_crash():
    """A policy's tool call nested 100,000 deep (json's own parser raises a bare RecursionError
    past ~1,000) is a parse error the environment reports, in both formats."""
    deep = "[" * 100_000 + "]" * 100_000
    body = '{"name": "multiply", "arguments": ' + deep + "}"
    for fmt, text in (("hermes", f"<tool_call>{body}</tool_call>"), ("llama3", body)):
        calls, errors = parse_tool_calls(text, fmt, (MULTIPLY,))
        assert calls == [] and len(errors) == 1 and "not valid JSON" in errors[0], (fmt, errors)


def test_tool_environment_turns():
    env = ToolEnvironment(
        [MULTIPLY, LOOKUP],
        fmt="hermes",
        answer_reward=exact,
        max_turns=4,
        system_prompt="Use the tools.",
    )
    messages = env.reset({"prompt": "What is 12 * 34?", "answer": "408"})
    assert messages == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 12 * 34?"},
    ]
    r = env.step(Action(hermes("multiply", a=12, b=34)))
    assert (
        not r.done
        and r.reward is None
        and r.observation == [{"role": "tool", "name": "multiply", "content": "408"}]
    )
    r = env.step(
        Action(hermes("multiply", a=12) + hermes("lookup", key="y"))
    )  # bad arguments; a tool that raises
    assert not r.done and r.info == {"tool_calls": 2, "tool_errors": 1}
    contents = sorted(m["content"] for m in r.observation)
    assert contents[0].startswith("error: lookup raised KeyError") and contents[1].startswith(
        "error: multiply: missing"
    )
    r = env.step(Action("408"))
    assert r.done and r.reward == 1.0 and r.observation == ()
    env.reset({"prompt": "q", "answer": "1"})
    for _ in range(3):
        assert not env.step(Action(hermes("multiply", a=1, b=1))).done
    last = env.step(Action(hermes("multiply", a=1, b=1)))
    assert last.done and last.reward == 0.0 and last.info["truncated"]
    with pytest.raises(KeyError, match="needs the column 'prompt'"):
        env.reset({"question": "q"})


def test_tools_and_observations_render_through_the_chat_template(tmp_path):
    from text_fixtures import make_model_dir

    from relax.text import load_tokenizer

    tok = load_tokenizer(make_model_dir(tmp_path, "qwen25"))
    env = ToolEnvironment([MULTIPLY], fmt="hermes", answer_reward=exact, max_turns=2)
    messages = env.reset({"prompt": "What is 12 * 34?", "answer": "408"})
    prompt = tok.apply_chat_template(
        messages, tools=env.schemas(), add_generation_prompt=True, tokenize=False
    )
    assert '"name": "multiply"' in prompt and "Multiply two integers." in prompt
    action = hermes("multiply", a=12, b=34)
    observation = env.step(Action(action)).observation
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [ToolCall("multiply", {"a": 12, "b": 34}).message()],
    }
    text = tok.apply_chat_template(
        messages + [turn, *observation],
        tools=env.schemas(),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.startswith(prompt) and "<tool_response>\n408\n</tool_response>" in text


class SlowEnv:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        time.sleep(0.2)
        from relax.environments import StepResult

        return StepResult((), 1.0, True)


def test_async_environments_step_concurrently():
    envs = [as_async(SlowEnv()) for _ in range(4)]
    assert as_async(envs[0]) is envs[0]
    t0 = time.perf_counter()
    results = asyncio.run(step_all(envs, [Action("a"), None, Action("b"), Action("c")]))
    assert time.perf_counter() - t0 < 0.5  # three 0.2 s steps at once, not 0.6 s
    assert results[1] is None and all(r.done for i, r in enumerate(results) if i != 1)
    with pytest.raises(TypeError, match="neither reset/step"):
        as_async(object())
