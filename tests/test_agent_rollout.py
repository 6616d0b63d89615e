"""Multi-turn rollouts over environments (``relax.environments.rollout``): token-exact trajectories
with a byte-level BPE tokenizer whose decode -> encode is not the identity, observations outside
the loss mask, budgets, a malformed tool call and an environment that raises."""

import dataclasses
import json

import equinox as eqx
import jax
import numpy as np
import pytest
from test_rollout import tiny
from text_fixtures import make_model_dir

from relax.environments import Action, StepResult, Tool, ToolEnvironment
from relax.environments.chat import ChatFormat
from relax.environments.rollout import (
    AgentRolloutConfig,
    compact_sizes,
    prompt_width,
    rollout_trajectories,
    warm_rollout,
)
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


@pytest.mark.slow
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


class Staggered:
    """Of 8 trajectories, the 4th runs 4 turns, the 8th 3 and the others 1 (after the first turn
    the batch keeps 2 rows of 8, after the third 1); each turn before the last is answered by an
    observation several ``observation_chunk`` s long."""

    made = 0

    def __init__(self):
        self.turn, self.last = 0, {3: 4, 7: 3}.get(Staggered.made % 8, 1)
        Staggered.made += 1

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.turn == self.last:
            return StepResult((), float(self.turn), True)
        return StepResult(Staggered.observation(self.turn), 0.0, False)

    @staticmethod
    def observation(turn: int) -> list[dict]:
        return [{"role": "user", "content": f"observation {turn}: " + "abc def " * (2 + turn)}]


@pytest.mark.slow
def test_chunked_observations_and_compactions_give_the_trainers_logprobs(tokenizer, monkeypatch):
    """Observations prefilled 3 tokens at a time and a batch compacted down every size to 1 row
    (``min_rows=1``): the trainer's prefix-shared forward over ``[prompt | trajectory]`` gives the
    sampler's log-prob at every sampled token."""
    from relax.environments import rollout as R
    from relax.models.forward.prefix_shared import completion_logprobs

    calls = {"append": [], "compact": []}
    for name in calls:
        real = getattr(R.T, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls[_name].append(args[2].shape if _name == "append" else args[1].shape[0])
            return _real(*args, **kw)

        monkeypatch.setattr(R.T, name, spy)
    Staggered.made = 0
    cfg = config(g=4, n=160, turn_tokens=12, max_turns=4)
    cfg = dataclasses.replace(
        cfg,
        turns=dataclasses.replace(cfg.turns, observation_chunk=3),
        compact_below=0.75,
        min_rows=1,
    )
    model = stopping_model(tokenizer)
    rows = [{"prompt": "Hi"}, {"prompt": "A longer prompt, with more words"}]
    traj = rollout_trajectories(
        model, rows, Staggered, ChatFormat(tokenizer), key=jax.random.key(5), cfg=cfg
    )
    # the test means something: observations of several chunks, and compactions 8 -> ... -> 1
    assert all(shape[1] == 3 for shape in calls["append"]) and len(calls["append"]) > 6
    assert calls["compact"] == [4, 2, 1]  # 8 -> 4 -> 2 after the first turn, 2 -> 1 after the third
    # every observation as the chat template renders it, whole, after its turn
    chat, n = ChatFormat(tokenizer), traj.tokens.shape[-1]
    tokens, index = traj.tokens.reshape(-1, n), traj.turn_index.reshape(-1, n)
    observed = (traj.mask.astype(bool) & ~traj.sampled_mask.astype(bool)).reshape(-1, n)
    for t, turns in enumerate(traj.turns.reshape(-1)):
        for k in range(turns - 1):
            want = chat.observation_ids(Staggered.observation(k + 1))
            assert tokens[t][observed[t] & (index[t] == k)].tolist() == want, (t, k)
    assert observed.sum(-1).max() > 3 * 3
    trainer = completion_logprobs(
        model,
        jax.numpy.asarray(traj.prompt_ids),
        jax.numpy.asarray(traj.prompt_mask),
        jax.numpy.asarray(traj.tokens),
        jax.numpy.asarray(traj.mask),
    )
    sampled = traj.sampled_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(trainer)[sampled], traj.logprobs[sampled], atol=2e-5)


@pytest.mark.parametrize(
    "trajectories,min_rows,want",
    [
        (64, 8, (64, 32, 16, 8)),
        (200, 8, (200, 128, 64, 32, 16, 8)),
        (6, 1, (6, 4, 2, 1)),
        (6, 8, (6,)),
        (8, 8, (8,)),
        (9, 6, (9, 8)),
    ],
)
def test_compact_sizes(trajectories, min_rows, want):
    turns = config().turns
    cfg = AgentRolloutConfig(turns=turns, max_turns=2, min_rows=min_rows)
    assert compact_sizes(trajectories, cfg) == want


@pytest.mark.slow
def test_a_warmed_rollout_compiles_nothing(tokenizer):
    """``warm_rollout`` for a batch's size and prompt width compiles every program the rollout
    then calls, whatever its environments answer: a rollout with observations, compactions and
    early ends compiles nothing after it (``CompileCounter``)."""
    from relax.train.run import CompileCounter

    Staggered.made = 0
    cfg = config(g=4, n=160, turn_tokens=12, max_turns=4)
    cfg = dataclasses.replace(cfg, compact_below=0.75, min_rows=2)
    model, chat = stopping_model(tokenizer), ChatFormat(tokenizer)
    rows = [{"prompt": "Hi"}, {"prompt": "A longer prompt, with more words"}]
    width = max(len(chat.prompt_ids(Staggered().reset(r))) for r in rows)
    keys = jax.random.split(jax.random.key(5), 8)
    timed = warm_rollout(model, 2, prompt_width(width, cfg.turns, 512), key=keys, cfg=cfg)
    names = sorted(name.split(" [")[0] for name, _ in timed)
    assert names == sorted(
        [
            "start",
            "fused_layers",
            "decode_turn 8 rows",
            "append 8 rows",
            "compact 8 to 4",
            "decode_turn 4 rows",
            "append 4 rows",
            "compact 4 to 2",
            "decode_turn 2 rows",
            "append 2 rows",
        ]
    )
    Staggered.made = 0
    with CompileCounter() as compiles:
        traj = rollout_trajectories(model, rows, Staggered, chat, key=keys, cfg=cfg)
    assert len(set(traj.turns.reshape(-1).tolist())) > 2  # the batch did shrink
    assert compiles.count == 0
