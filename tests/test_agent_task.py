"""The built-in multi-turn tool-use task (relax.tasks.agent): splits, the tokenizer and its chat
template, teacher transcripts tokenized as a rollout builds them, the reward and the environment."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from relax.environments import Action
from relax.environments.chat import ChatFormat
from relax.tasks import agent

TASK = agent.AgentTask(num_train=300, num_eval=40)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return agent.build_tokenizer(TASK, tmp_path_factory.mktemp("agent"))


def test_splits_are_disjoint_and_right():
    train, held_out = agent.make_splits(TASK)
    assert len(train) == 300 and len(held_out) == 40
    assert not {(r["a"], r["b"]) for r in train} & {(r["a"], r["b"]) for r in held_out}
    for r in train + held_out:
        assert len(str(r["a"])) == 3 and len(str(r["b"])) == 2
        assert r["prompt"] == f"What is {r['a']} * {r['b']}?" and r["answer"] == str(
            r["a"] * r["b"]
        )
    assert agent.make_splits(TASK) == (train, held_out)  # deterministic
    with pytest.raises(ValueError, match="too many"):
        agent.make_splits(dataclasses.replace(TASK, digits_a=1, digits_b=1))


def test_tokenizer_and_chat_template(tok):
    assert tok.decode([tok.eos_token_id]) == "<|im_end|>" and tok.eos_token_ids == (
        tok.eos_token_id,
    )
    assert tok.decode([tok.pad_token_id]) == tok.decode([tok.bos_token_id]) == "<|endoftext|>"
    call = agent.tool_call_text(347, 86)
    assert tok.decode(tok.encode(call, add_special_tokens=False)) == call
    assert (
        len(tok.encode(call, add_special_tokens=False)) <= 12
    )  # compact: digits, a few merged pieces
    assert tok.encode("12", add_special_tokens=False) == [
        tok.token_to_id("1"),
        tok.token_to_id("2"),
    ]
    chat = agent.chat_format(TASK, tok)
    env = agent.make_environment(TASK)
    messages = env.reset({"prompt": "What is 347 * 86?", "answer": "29842"})
    prompt = chat.prompt_ids(messages)
    assert tok.decode(prompt) == (
        "<|im_start|>system\nTools: multiply<|im_end|>\n<|im_start|>user\nWhat is 347 * 86?"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(prompt) < 64
    obs = env.step(Action(call)).observation
    assert tok.decode(chat.observation_ids(obs)) == (
        "\n<|im_start|>user\n<tool_response>\n29842\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    two = [
        {"role": "tool", "name": "multiply", "content": "6"},
        {"role": "tool", "name": "multiply", "content": "8"},
    ]
    assert ChatFormat(tok, tools=env.schemas()).observation_text(two) == (
        "\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n8\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _pieces(tok, pieces):
    """Ids and loss mask built from text pieces ``(text, is_assistant)``, each encoded on its own."""
    ids, mask = [], []
    for text, target in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids, mask = ids + piece, mask + [int(target)] * len(piece)
    return ids, mask


def test_teacher_transcripts_mask_only_assistant_turns(tok):
    chat = agent.chat_format(TASK, tok)
    row = {"prompt": "What is 347 * 86?", "a": 347, "b": 86, "answer": "29842"}
    call = agent.tool_call_text(347, 86)
    assert agent.teacher_turns(row, False) == ["29842"]
    ids, mask = agent.encode_transcript(TASK, chat, row, agent.teacher_turns(row, True))
    header = (
        "<|im_start|>system\nTools: multiply<|im_end|>\n<|im_start|>user\nWhat is 347 * 86?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    observation = "\n<|im_start|>user\n<tool_response>\n29842\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert (ids, mask) == _pieces(
        tok, [(header, 0), (call + "<|im_end|>", 1), (observation, 0), ("29842<|im_end|>", 1)]
    )
    # the whole conversation as the template renders it, tokenized at once, is the same sequence
    messages = [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "multiply", "content": "29842"},
        {"role": "assistant", "content": "29842"},
    ]
    text = tok.apply_chat_template(messages, tools=chat.tools, tokenize=False)
    assert ids == tok.encode(text.removesuffix("\n"), add_special_tokens=False)
    direct = agent.encode_transcript(TASK, chat, row, agent.teacher_turns(row, False))
    assert direct == _pieces(tok, [(header, 0), ("29842<|im_end|>", 1)])
    padded = agent.pad_transcripts([(ids, mask), direct], tok.pad_token_id)
    assert [a.shape for a in padded] == [(2, 48)] * 3
    np.testing.assert_array_equal(padded[2].sum(1), [sum(mask), sum(direct[1])])
    assert padded[1][1, len(direct[0]) :].sum() == 0 and padded[0][1, -1] == tok.pad_token_id


def test_answer_reward():
    row = {"answer": "29842"}
    for text, want in [
        ("29842", 1.0),
        ("  29842\n", 1.0),
        ("29842<|im_end|>", 1.0),
        ("+29842", 1.0),
        ("29843", 0.0),
        ("The answer is 29842", 0.0),
        ("", 0.0),
        ("29842 29842", 0.0),
        (agent.tool_call_text(347, 86), 0.0),
    ]:
        assert agent.answer_reward(row, text) == want, text


def test_environment_with_the_tool():
    row = {"prompt": "What is 347 * 86?", "a": 347, "b": 86, "answer": "29842"}
    env = agent.make_environment(TASK)
    env.reset(row)
    step = env.step(Action(agent.tool_call_text(347, 86)))
    assert not step.done and step.observation == [
        {"role": "tool", "name": "multiply", "content": "29842"}
    ]
    step = env.step(Action("29842"))
    assert step.done and step.reward == 1.0
    env = agent.make_environment(TASK)
    env.reset(row)
    assert env.step(Action("30000")).reward == 0.0
    env.reset(row)
    for _ in range(TASK.max_turns - 1):
        assert not env.step(Action(agent.tool_call_text(1, 2))).done
    last = env.step(Action(agent.tool_call_text(1, 2)))
    assert last.done and last.reward == 0.0 and last.info["truncated"]


@pytest.mark.slow
def test_train_base_model_runs(tok):
    task = dataclasses.replace(TASK, hidden_size=16, num_layers=1, sft_steps=2, sft_batch=4)
    train, _ = agent.make_splits(task)
    model = agent.train_base_model(task, tok, train, key=jax.random.key(0), log=lambda _: None)
    config = agent.model_config(task, tok)
    assert (
        model.config == config
        and config.vocab_size == tok.vocab_size
        and config.max_position_embeddings >= 192
    )
