"""``relax agent --env reasoning_gym:<names>`` (``relax.environments.reasoning_gym_env``): an
episode asks a reasoning-gym question and scores each answer with reasoning-gym's own scorer
(called here directly as the reference), asks again after a wrong one up to ``attempts``, and the
agent trainer runs on it from the command line (slow)."""

import json

import pytest

pytest.importorskip("reasoning_gym")

import reasoning_gym  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS  # noqa: E402

from relax.environments.protocol import Action  # noqa: E402
from relax.environments.reasoning_gym_env import ReasoningGymEnv, ReasoningGymSpec  # noqa: E402
from relax.tasks import reasoning_gym as reasoning_gym_task  # noqa: E402

NAMES = ("basic_arithmetic", "chain_sum")


def _rows(n=4):
    task = reasoning_gym_task.with_names(
        reasoning_gym_task.ReasoningGymTask(size=n, eval_size=0), NAMES
    )
    return reasoning_gym_task.make_splits(task)[0]


def _score(row, answer):
    """reasoning-gym's own score of ``answer`` for the row's entry (the reference)."""
    entry = json.loads(json.dumps(row["entry"]))  # as a data file gives it back
    return reasoning_gym.get_score_answer_fn(row["data_source"])(answer, entry)


def test_spec_parsing_and_its_errors():
    assert ReasoningGymSpec.parse("reasoning_gym:a,b") == ReasoningGymSpec("reasoning_gym:a,b")
    spec = ReasoningGymSpec.parse("reasoning_gym:a?attempts=3&answer=plain")
    assert (spec.task, spec.attempts, spec.answer) == ("reasoning_gym:a", 3, "plain")
    for bad, match in [
        ("reasoning_gym:a?attempts=0", "attempts must be >= 1"),
        ("reasoning_gym:a?attempts=two", "not a whole number"),
        ("reasoning_gym:a?answer=boxed", "answer='boxed'"),
        ("reasoning_gym:a?turns=2", "unknown option 'turns'"),
    ]:
        with pytest.raises(ValueError, match=match):
            ReasoningGymSpec.parse(bad)


def test_one_attempt_scores_the_answer_with_the_tasks_own_scorer():
    system = SYSTEM_PROMPTS["direct"]
    for row in _rows():
        env = ReasoningGymEnv(ReasoningGymSpec("reasoning_gym:x"), system)
        messages = env.reset(row)
        assert messages == [
            {"role": "system", "content": system},
            {"role": "user", "content": row["prompt"]},
        ]
        right = env.step(Action(f"Thinking. <answer>{row['answer']}</answer>"))
        assert (right.reward, right.done, tuple(right.observation)) == (1.0, True, ())
        env.reset(row)
        wrong = env.step(Action("<answer>-1</answer>"))  # no sum of these is -1
        assert wrong.done and wrong.reward == pytest.approx(_score(row, "-1")) and wrong.reward < 1
        with pytest.raises(RuntimeError, match="episode ended"):
            env.step(Action("<answer>1</answer>"))


def test_a_wrong_answer_is_asked_again_up_to_the_attempts():
    row = _rows(1)[0]
    env = ReasoningGymEnv(ReasoningGymSpec("reasoning_gym:x", attempts=3), None)
    assert env.reset(row) == [{"role": "user", "content": row["prompt"]}]
    first = env.step(Action("no tags, so no answer"))
    assert (first.reward, first.done) == (None, False)
    assert [m["role"] for m in first.observation] == ["user"]
    assert "<answer>" in first.observation[0]["content"]
    second = env.step(Action(f"<answer>{row['answer']}</answer>"))  # right: ends early
    assert (second.reward, second.done) == (1.0, True)
    env.reset(row)
    results = [env.step(Action("<answer>-1</answer>")) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == pytest.approx(_score(row, "-1"))


def test_plain_answers_are_scored_whole():
    row = _rows(1)[0]
    env = ReasoningGymEnv(ReasoningGymSpec("reasoning_gym:x", answer="plain"), None)
    env.reset(row)
    text = f"The answer is {row['answer']}"
    got = env.step(Action(f"  {text}\n"))
    assert got.reward == pytest.approx(_score(row, text)) and 0 < got.reward < 1  # partial credit


def test_a_row_without_an_entry_is_an_error_naming_the_field():
    env = ReasoningGymEnv(ReasoningGymSpec("reasoning_gym:x"), None)
    with pytest.raises(ValueError, match="no reasoning-gym 'entry'.*prompt, answer"):
        env.reset({"prompt": "1 + 1 =", "answer": "2"})


def test_agent_flags_are_checked_when_the_config_is_made():
    from relax.algorithms.agent.config import AgentConfig
    from relax.algorithms.agent.run import AgentRunConfig

    with pytest.raises(ValueError, match="--env 'reasoning_gym:basic_arithmetc'.*close names"):
        AgentRunConfig(env="reasoning_gym:basic_arithmetc")
    with pytest.raises(ValueError, match="3 attempts need --agent.max-turns >= 3"):
        AgentRunConfig(env="reasoning_gym:chain_sum?attempts=3", agent=AgentConfig(max_turns=2))
    with pytest.raises(ValueError, match="--reasoning-gym.eval-seed 5"):
        AgentRunConfig(
            env="reasoning_gym:chain_sum",
            reasoning_gym=reasoning_gym_task.ReasoningGymTask(eval_seed=5),
        )
    cfg = AgentRunConfig(env="reasoning_gym:chain_sum?attempts=2", model="m")  # no --data
    assert cfg.makes_data and cfg.data is None


@pytest.mark.slow  # the built-in agent model's supervised phase, then 2 steps
def test_agent_trains_on_reasoning_gym_from_the_command_line(tmp_path):
    from test_agent_run import FAST, train_agent

    run = tmp_path / "run"
    train_agent.main(
        FAST + ["--env", "reasoning_gym:chain_sum?attempts=2&answer=plain",
                "--reasoning-gym.size", "16", "--reasoning-gym.eval-size", "4",
                "--reasoning-gym.options", "max_terms=2", "min_digits=1", "max_digits=1",
                "--run-dir", str(run)]
    )  # fmt: skip
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "turns" in x and "reward" in x]
    assert len(trained) == 2 and all(1 <= x["turns"] <= 2 for x in trained)
    report = (run / "startup.txt").read_text()
    assert "reasoning-gym (reasoning_gym:chain_sum?attempts=2&answer=plain)" in report
