"""The rising curriculum (``relax.data.curriculum``, ``--reasoning-gym.max-level``): the level
rises as the module's rule says (hand-computed sequences), a stopped and resumed iterator draws
what the uninterrupted one does, the rows of every level are reasoning-gym's at that level, and a
GRPO run climbs the levels from the command line (slow)."""

from __future__ import annotations

import json

import pytest

from relax.data.curriculum import RisingCurriculum


class Counter:
    """A pipeline stand-in: yields ``(name, i)``; its state is its position."""

    def __init__(self, name):
        self.name, self.i = name, 0

    def __next__(self):
        self.i += 1
        return (self.name, self.i - 1)

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def _curriculum(window=3, threshold=0.5):
    return RisingCurriculum(
        [0, 1, 2], [Counter("a"), Counter("b"), Counter("c")], threshold=threshold, window=window
    )


def test_the_level_rises_when_the_windows_mean_reaches_the_threshold():
    cur = _curriculum()
    # (reward observed, the level after it): the window's mean over 3 updates at a level
    steps = [
        (0.4, 0), (0.6, 0), (0.4, 0),            # mean 0.467 < 0.5: stays
        (0.6, 1),                                # last 3: 0.6, 0.4, 0.6 -> 0.533: up
        (1.0, 1), (1.0, 1),                      # window not full at level 1
        (float("nan"), 2),                       # NaN counts 0: 1, 1, 0 -> 0.667: up
        (1.0, 2), (1.0, 2), (1.0, 2), (1.0, 2),  # the last level: stays
    ]  # fmt: skip
    drawn = []
    for reward, level in steps:
        drawn.append(next(cur))
        cur.observe(reward)
        assert cur.level == level
    assert [name for name, _ in drawn] == ["a"] * 4 + ["b"] * 3 + ["c"] * 4
    assert [i for _, i in drawn] == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]  # each level's own position


def test_a_resumed_curriculum_draws_what_the_uninterrupted_one_does():
    rewards = [0.1, 0.9, 0.9, 0.9, 0.2, 0.8, 0.7, 0.9, 0.0, 1.0]

    def run(cur, rs):
        out = []
        for r in rs:
            out.append(next(cur))
            cur.observe(r)
        return out

    whole = run(_curriculum(), rewards)
    first = _curriculum()
    head = run(first, rewards[:5])
    state = json.loads(json.dumps(first.get_state()))  # as a checkpoint stores it
    resumed = _curriculum()
    resumed.set_state(state)
    assert head + run(resumed, rewards[5:]) == whole
    with pytest.raises(ValueError, match="not this run's"):
        RisingCurriculum([0, 1], [Counter("a"), Counter("b")], threshold=0.5, window=2).set_state(
            {**state, "level": 5}
        )


def test_bad_curricula_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        RisingCurriculum([1, 0], [Counter("a"), Counter("b")], threshold=0.5, window=1)
    with pytest.raises(ValueError, match="window >= 1"):
        RisingCurriculum([0], [Counter("a")], threshold=0.5, window=0)


# ---------------------------------------------------------------- reasoning-gym's levels


def test_rows_at_every_level_are_reasoning_gyms_at_that_level():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    from relax.rewards.reasoning_gym import to_json
    from relax.tasks import reasoning_gym as rg

    task = rg.with_names(
        rg.ReasoningGymTask(size=6, eval_size=3, eval_seed=100, level=1, max_level=3),
        ("basic_arithmetic",),
    )
    train, held_out = rg.make_splits(task)
    assert [r["level"] for r in train] == [1] * 6 + [2] * 6 + [3] * 6
    for i, level in enumerate((1, 2, 3)):
        want = reasoning_gym.create_dataset(
            "basic_arithmetic",
            seed=i * 7,  # each level's seeds after the last: size + one task
            size=6,
            **rg.curriculum_options("basic_arithmetic", level),
        )
        got = train[6 * i : 6 * (i + 1)]
        assert [r["entry"] for r in got] == [to_json(e) for e in want]
        assert {r["data_source"] for r in got} == {f"basic_arithmetic/level{level}"}
    assert {r["level"] for r in held_out} <= {1, 2, 3}
    with pytest.raises(ValueError, match="eval-seed 10: .* meet the training seeds"):
        rg.with_names(  # 3 levels x 7 seeds reach past 10
            rg.ReasoningGymTask(size=6, eval_size=3, eval_seed=10, max_level=2),
            ("basic_arithmetic",),
        )
    with pytest.raises(ValueError, match="max-level 0 is below the first level 1"):
        rg.with_names(rg.ReasoningGymTask(level=1, max_level=0), ("basic_arithmetic",))


def test_the_curriculum_is_refused_where_it_cannot_run():
    pytest.importorskip("reasoning_gym")
    from relax.algorithms.agent.run import AgentRunConfig
    from relax.algorithms.cli.configure import configure
    from relax.algorithms.grpo.run import GRPORunConfig
    from relax.tasks.reasoning_gym import ReasoningGymTask
    from relax.train.pipeline import AsyncConfig

    rising = ReasoningGymTask(max_level=2)
    with pytest.raises(ValueError, match="runs synchronously"):
        configure(
            GRPORunConfig,
            task="reasoning_gym:basic_arithmetic",
            reasoning_gym=rising,
            async_=AsyncConfig(staleness=1),
        )
    with pytest.raises(ValueError, match="runs with GRPO and PPO"):
        AgentRunConfig(env="reasoning_gym:basic_arithmetic", reasoning_gym=rising)


@pytest.mark.slow  # the built-in base model's supervised phase, then 3 GRPO steps
def test_grpo_climbs_the_levels_from_the_command_line(tmp_path):
    """``--reasoning-gym.max-level 1`` with a threshold of 0 over one update: step 1 trains on
    level 0, steps 2 and 3 on level 1; one compiled step for both levels (padded as the whole
    data), and the held-out metrics per task and level."""
    pytest.importorskip("reasoning_gym")
    from conftest import load_example

    run = tmp_path / "run"
    load_example("grpo").main(
        ["--task", "reasoning_gym:basic_arithmetic", "--run-dir", str(run)]
        + ["--reasoning-gym.size", "32", "--reasoning-gym.eval-size", "4"]
        + ["--reasoning-gym.max-level", "1", "--reasoning-gym.level-up-at", "0"]
        + ["--reasoning-gym.level-window", "1"]
        + ["--reasoning-gym.sft-steps", "10", "--reasoning-gym.sft-batch", "8"]
        + ["--max-prompt-tokens", "128", "--steps", "3", "--batch-size", "4"]
        + ["--grpo.num-generations", "2", "--eval-every", "0", "--checkpoint-every", "3"]
    )
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "time/step" in m]
    assert [m["curriculum/level"] for m in steps] == [0.0, 1.0, 1.0]
    assert [m["compiles"] for m in steps[1:]] == [0.0, 0.0]
    evals = [m for m in lines if "eval/basic_arithmetic/level0/reward" in m]
    assert evals and "eval/basic_arithmetic/level1/reward" in evals[-1]
    rows = [json.loads(x) for x in (run / "task" / "train.jsonl").read_text().splitlines()]
    assert [r["level"] for r in rows] == [0] * 32 + [1] * 32
