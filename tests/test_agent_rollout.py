"""Multi-turn rollouts over environments (``relax.environments.rollout``): token-exact trajectories
with a byte-level BPE tokenizer whose decode -> encode is not the identity, observations outside
the loss mask, budgets, a malformed tool call and an environment that raises."""

import json

import equinox as eqx
import jax
import numpy as np
import pytest
from test_rollout import tiny
from text_fixtures import make_model_dir

from relax.environments import Action, StepResult, Tool, ToolEnvironment
from relax.environments.chat import ChatFormat
from relax.environments.rollout import AgentRolloutConfig, rollout_trajectories
from relax.models import init
from relax.rollout.sampling import SamplingConfig
from relax.rollout.turns import TurnConfig
from relax.text import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(make_model_dir(tmp_path_factory.mktemp("tok"), "qwen25"))


def stopping_model(tokenizer, stop_logit: float = 5.0):
    """A random tiny model that ends a turn (samples ``<|im_end|>``) every ~6 tokens: a constant
    residual direction makes the stop token's logit ``stop_logit`` above the rest."""
    model = init(
        tiny(
            vocab_size=tokenizer.vocab_size, max_position_embeddings=512, tie_word_embeddings=False
        ),
        jax.random.key(0),
        std=0.02,
    )
    embed = model.embed.at[:, 0].set(5.0)
    head = (
        model.lm_head.at[:, 0].set(0.0).at[tokenizer.eos_token_id, 0].set(stop_logit / 8.0)
    )  # |h_0| ~ sqrt(64)
    return eqx.tree_at(lambda m: (m.embed, m.lm_head), model, (embed, head))


class Scripted:
    """Two turns answered by a user message, then done with reward = turn count; records actions."""

    log: dict = {}

    def __init__(self):
        self.turn, self.id = 0, len(Scripted.log)
        Scripted.log[self.id] = []

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: Action) -> StepResult:
        Scripted.log[self.id].append(action)
        self.turn += 1
        if self.turn == 3:
            return StepResult((), 1.0, True, {"tool_calls": 0})
        return StepResult([{"role": "user", "content": f"go on {self.turn} éü"}], 0.5, False)


def config(g=3, n=120, turn_tokens=24, max_turns=4):
    turns = TurnConfig(
        num_generations=g,
        max_tokens=n,
        max_turn_tokens=turn_tokens,
        eos_ids=(2,),
        sampling=SamplingConfig(temperature=1.0),
        pad_id=0,
    )
    return AgentRolloutConfig(turns=turns, max_turns=max_turns)


def test_trajectories_are_token_exact_and_observations_masked(tokenizer):
    assert tokenizer.eos_token_id == 2
    model = stopping_model(tokenizer)
    chat = ChatFormat(tokenizer)
    Scripted.log = {}
    rows = [{"prompt": "Hi there"}, {"prompt": "A longer prompt, with more words in it"}]
    traj = rollout_trajectories(model, rows, Scripted, chat, key=jax.random.key(3), cfg=config())
    p, g, n = traj.tokens.shape
    assert (p, g, n) == (2, 3, 120)
    non_identity = 0
    for t in range(p * g):
        tokens, sampled = (
            traj.tokens.reshape(p * g, n)[t],
            traj.sampled_mask.reshape(p * g, n)[t].astype(bool),
        )
        index, valid = (
            traj.turn_index.reshape(p * g, n)[t],
            traj.mask.reshape(p * g, n)[t].astype(bool),
        )
        actions = Scripted.log[t]
        for k, action in enumerate(actions):
            # the policy's turn k is exactly the ids the environment was given, as sampled
            turn = tokens[sampled & (index == k)]
            assert tuple(turn.tolist()) == action.token_ids and turn[-1] == tokenizer.eos_token_id
            assert action.text == tokenizer.decode(turn[:-1])
            non_identity += tokenizer.encode(action.text, add_special_tokens=False) != list(
                turn[:-1]
            )
            # what follows the turn is the observation, tokenized once and never in the loss
            obs = tokens[~sampled & valid & (index == k)]
            if k < 2 and k + 1 < len(actions):
                expected = chat.observation_ids([{"role": "user", "content": f"go on {k + 1} éü"}])
                assert obs.tolist() == expected
            else:
                assert obs.size == 0
        assert sampled.sum() == sum(len(a.token_ids) for a in actions)
        assert not np.any(sampled & ~valid)
    # the test means something: re-encoding the decoded text changes the ids of some turns
    assert non_identity > 0
    finished = ~traj.truncated
    assert np.all(traj.rewards[finished] == 2.0) and np.all(traj.turns[finished] == 3)


def test_budgets_truncate_and_flag(tokenizer):
    model = stopping_model(
        tokenizer, stop_logit=-20.0
    )  # never stops: every first turn hits its budget
    Scripted.log = {}
    traj = rollout_trajectories(
        model,
        [{"prompt": "x"}],
        Scripted,
        ChatFormat(tokenizer),
        key=jax.random.key(0),
        cfg=config(g=2, turn_tokens=7),
    )
    assert (
        np.all(traj.truncated)
        and np.all(traj.turns == 1)
        and np.all(traj.sampled_mask.sum(-1) == 7)
    )
    assert all(
        len(v) == 0 for v in Scripted.log.values()
    )  # a cut turn is never sent to the environment
    traj = rollout_trajectories(
        stopping_model(tokenizer),
        [{"prompt": "x"}],
        Scripted,
        ChatFormat(tokenizer),
        key=jax.random.key(0),
        cfg=config(g=2, n=40, max_turns=2),
    )
    assert np.all(traj.truncated) and np.all(traj.mask.sum(-1) <= 40)


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


class Raising:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        raise RuntimeError("the environment broke")


def test_raising_environment_and_malformed_call(tokenizer):
    model = stopping_model(tokenizer)
    traj = rollout_trajectories(
        model,
        [{"prompt": "x"}],
        Raising,
        ChatFormat(tokenizer),
        key=jax.random.key(0),
        cfg=config(g=2),
    )
    assert np.all(np.isnan(traj.rewards)) and all(
        "RuntimeError: the environment broke" in e for e in traj.env_errors
    )
    assert np.all(traj.turns == 1)

    # a malformed call comes back as an error observation and the trajectory goes on
    env = ToolEnvironment(
        [MULTIPLY], fmt="hermes", answer_reward=lambda row, text: 1.0, max_turns=3
    )
    env.reset({"prompt": "What is 2 * 3?"})
    result = env.step(Action('<tool_call>{"name": "multiply", "arguments": {"a": 2}}</tool_call>'))
    assert not result.done and result.info == {"tool_calls": 1, "tool_errors": 1}
    assert result.observation[0]["content"].startswith("error: multiply: missing argument(s) b")
    chat = ChatFormat(tokenizer, tools=env.schemas())
    ids = chat.observation_ids(result.observation)
    assert "<tool_response>\nerror: multiply: missing argument" in tokenizer.decode(ids)
    good = env.step(
        Action(
            "<tool_call>"
            + json.dumps({"name": "multiply", "arguments": {"a": 2, "b": 3}})
            + "</tool_call>"
        )
    )
    assert good.observation[0]["content"] == "6" and env.step(Action("6")).reward == 1.0


def test_group_resets_must_agree(tokenizer):
    class Random:
        calls = 0

        def reset(self, row):
            Random.calls += 1
            return [{"role": "user", "content": f"{row['prompt']} {Random.calls}"}]

        def step(self, action):
            return StepResult((), 0.0, True)

    with pytest.raises(ValueError, match="row 0: the environment's reset gave"):
        rollout_trajectories(
            stopping_model(tokenizer),
            [{"prompt": "x"}],
            Random,
            ChatFormat(tokenizer),
            key=jax.random.key(0),
            cfg=config(g=2),
        )
