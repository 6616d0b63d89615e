"""``--task reasoning_gym:<names>``: the rows are reasoning-gym's own entries, the held-out rows
disjoint from the training rows, the reward is each task's own ``score_answer``, a mixture keeps
its weights, bad names are refused, and the command line runs end to end (slow)."""

from __future__ import annotations

import json
import warnings

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from conftest import load_example  # noqa: E402
from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec  # noqa: E402

from relax.rewards.builtin import get_reward  # noqa: E402
from relax.rewards.reasoning_gym import from_json, to_json  # noqa: E402
from relax.tasks import reasoning_gym as rg  # noqa: E402

OPTIONS = {"max_digits": 2, "max_terms": 3}


def _task(names, **kw):
    return rg.with_names(rg.ReasoningGymTask(**kw), tuple(names))


def test_rows_are_reasoning_gym_entries_and_held_out_is_disjoint():
    task = _task(
        ["basic_arithmetic"],
        size=40,
        eval_size=20,
        seed=3,
        eval_seed=500,
        options=("max_digits=2", "basic_arithmetic.max_terms=3"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a repeated question's warning: checked below
        train, held_out = rg.make_splits(task)
    ref = list(reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=40, **OPTIONS))
    assert [from_json(r["entry"]) for r in train] == ref
    assert [(r["prompt"], r["answer"], r["data_source"]) for r in train] == [
        (e["question"], e["answer"], "basic_arithmetic") for e in ref
    ]
    ref_eval = reasoning_gym.create_dataset("basic_arithmetic", seed=500, size=20, **OPTIONS)
    seen = {e["question"] for e in ref}
    assert [from_json(r["entry"]) for r in held_out] == [
        e for e in ref_eval if e["question"] not in seen
    ]
    assert held_out and not {r["prompt"] for r in held_out} & seen
    assert json.loads(json.dumps(train[0]))["entry"] == train[0]["entry"]  # a jsonl row as it is
    # one-digit sums of two terms have at most 100 questions: many held-out ones repeat
    options = ("max_terms=2", "max_digits=1", 'operators=["+"]', "allow_negation=false")
    task = _task(["basic_arithmetic"], size=200, eval_size=50, eval_seed=10_000, options=options)
    with pytest.warns(UserWarning, match=r"(\d+) of 50 held-out rows repeat") as record:
        train, held_out = rg.make_splits(task)
    dropped = int(str(record[0].message).split(": ")[1].split(" of ")[0])
    ref = reasoning_gym.create_dataset(
        "basic_arithmetic",
        seed=10_000,
        size=50,
        max_terms=2,
        max_digits=1,
        operators=["+"],
        allow_negation=False,
    )
    seen = {r["prompt"] for r in train}
    assert dropped == sum(e["question"] in seen for e in ref) == 50 - len(held_out) > 0


def test_reward_is_the_tasks_own_score_answer():
    """Hand-written completions: right, wrong, garbled (no tags, unclosed tag), partly right."""
    ds = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=1)
    entry = ds[0]  # Calculate 5 - 3 - 6. -> -4
    assert entry["answer"] == "-4"
    completions = [
        "<answer>-4</answer>",
        "I think so.\n<answer> -4 </answer>",
        "<answer>5</answer>",
        "-4",
        "<answer>-4",
        "<answer>1</answer> no, <answer>-4</answer>",
    ]
    row = rg.record(entry)
    fields = {"entry": [row["entry"]] * 6, "answer": [row["answer"]] * 6}
    got = get_reward("reasoning_gym")(["p"] * 6, completions, **fields)
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    # the library itself: score_answer(extract_answer(c), entry) on the entry as generated
    from reasoning_gym.utils import extract_answer

    assert got == [ds.score_answer(extract_answer(c), entry) for c in completions]
    # the entry as JSON text (a parquet column), and a row without one (missing)
    text = json.dumps(row["entry"])
    assert get_reward("reasoning_gym")(["p"] * 2, completions[:2], entry=[text, None]) == [
        1.0,
        None,
    ]
    # reasoning_gym_plain: the whole completion is the answer; partial credit len(a) / len(c)
    plain = get_reward("reasoning_gym_plain")(
        ["p"] * 3, [" -4\n", "It is -4.", "<answer>-4</answer>"], entry=[row["entry"]] * 3
    )
    assert plain == [1.0, 2 / 9, 2 / 19]
    # the rows of a mixture: each scored by its own task
    rows = [rg.record(e) for e in reasoning_gym.create_dataset("leg_counting", seed=1, size=2)]
    rows.append(rg.record(reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=1)[0]))
    completions = [f"<answer>{r['answer']}</answer>" for r in rows]
    got = get_reward("reasoning_gym")(["p"] * 3, completions, entry=[r["entry"] for r in rows])
    assert got == [1.0, 1.0, 1.0]
    assert get_reward("reasoning_gym")(["p"], ["<answer>0</answer>"], entry=[rows[0]["entry"]]) == [
        0.0
    ]


def test_entries_round_trip_through_json_exactly():
    """ARC's scorer compares grids as tuples: plain JSON (lists) would score a right answer 0.05."""
    value = {"grid": ((1, 2), (3, 4)), "s": {3, 1}, "k": {1: "a", (2, 3): [None, 1.5]}}
    assert from_json(json.loads(json.dumps(to_json(value)))) == value
    entry = reasoning_gym.create_dataset("arc_agi", seed=0, size=1)[0]
    row = rg.record(entry)
    stored = json.loads(json.dumps(row))["entry"]
    completion = f"<answer>{entry['answer']}</answer>"
    assert get_reward("reasoning_gym")(["p"], [completion], entry=[stored]) == [1.0]


def test_a_mixture_keeps_its_weights():
    task = _task(["basic_arithmetic", "leg_counting"], size=400, eval_size=0, weights=(3.0, 1.0))
    rows = [rg.record(e) for e in rg.generate(task, seed=task.seed, size=task.size)]
    specs = [DatasetSpec("basic_arithmetic", 3.0, {}), DatasetSpec("leg_counting", 1.0, {})]
    ref = list(CompositeDataset(CompositeConfig(size=400, seed=0, datasets=specs)))
    assert [from_json(r["entry"]) for r in rows] == ref
    n = sum(r["data_source"] == "basic_arithmetic" for r in rows)
    assert abs(n - 300) < 35  # 4 standard deviations of Binomial(400, 3/4)
    assert {r["data_source"] for r in rows} == {"basic_arithmetic", "leg_counting"}


def test_curriculum_level_sets_the_generators_difficulty():
    """basic_arithmetic's curriculum: level 0 is two terms of one digit."""
    task = _task(["basic_arithmetic"], size=30, eval_size=0, level=0)
    rows = rg.generate(task, seed=0, size=30)
    assert {(e["metadata"]["num_terms"], e["metadata"]["num_digits"]) for e in rows} == {(2, 1)}
    with pytest.raises(ValueError, match="no reasoning-gym curriculum"):
        _task(["acre"], level=1)


def test_bad_names_and_options_are_refused_with_close_names():
    with pytest.raises(ValueError, match="close names: basic_arithmetic"):
        rg.task_names("reasoning_gym:basic_arithmetik")
    with pytest.raises(ValueError, match="not a reasoning-gym task"):
        rg.task_names("reasoning_gym:composite")  # a mixture is named by its tasks
    assert rg.task_names("reverse") is None
    assert rg.task_names("reasoning_gym:leg_counting, basic_arithmetic") == (
        "leg_counting",
        "basic_arithmetic",
    )
    with pytest.raises(ValueError, match="close: max_digits"):
        _task(["basic_arithmetic"], options=("max_digit=2",))
    with pytest.raises(ValueError, match="leg_counting refuses the generator options"):
        _task(["leg_counting"], options=("max_animals=2",))  # below min_animals (3)
    with pytest.raises(ValueError, match="prompt-style 'terse': one of"):
        _task(["leg_counting"], prompt_style="terse")
    with pytest.raises(ValueError, match="name the task"):
        _task(["basic_arithmetic", "leg_counting"], options=("max_digits=2",))
    with pytest.raises(ValueError, match="choose an eval seed >= 2001"):
        _task(["basic_arithmetic"], eval_seed=1500)
    with pytest.raises(ValueError, match="1 --reasoning-gym.weights for 2 tasks"):
        _task(["basic_arithmetic", "leg_counting"], weights=(1.0,))
    from relax.algorithms.grpo.run import GRPORunConfig

    with pytest.raises(ValueError, match="close names"):
        GRPORunConfig(task="reasoning_gym:leg_countin")
    with pytest.raises(ValueError, match="one of reverse"):
        GRPORunConfig(task="reasoning-gym:leg_counting")


def test_model_run_writes_its_rows_and_scores_them_with_reasoning_gym(tmp_path):
    """With --model the rows go to run_dir/task as a --model/--data run: reward reasoning_gym,
    reasoning-gym's system prompt (the model has a chat template)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS
    from text_fixtures import make_model_dir

    from relax.algorithms.grpo.run import GRPORunConfig
    from relax.algorithms.online.setup import reasoning_gym_setup

    options = rg.ReasoningGymTask(size=12, eval_size=4, eval_seed=100, weights=(1.0, 2.0))
    cfg = GRPORunConfig(
        model=str(make_model_dir(tmp_path, "qwen25")),
        task="reasoning_gym:basic_arithmetic,leg_counting",
        reasoning_gym=options,
    )
    out = reasoning_gym_setup(cfg, tmp_path / "run", log=lambda *a: None)
    assert out.reward == ("reasoning_gym",)
    assert out.system_prompt == SYSTEM_PROMPTS["direct"]
    train, held_out = rg.make_splits(cfg.task_config)
    read = [json.loads(line) for line in open(out.data)]
    assert read == train and [json.loads(line) for line in open(out.eval_data)] == held_out
    specs = [DatasetSpec("basic_arithmetic", 1.0, {}), DatasetSpec("leg_counting", 2.0, {})]
    ref = list(CompositeDataset(CompositeConfig(size=12, seed=0, datasets=specs)))
    assert [from_json(r["entry"]) for r in read] == ref


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


TINY = ["--steps", "2", "--batch-size", "4", "--grpo.num-generations", "2", "--eval-every", "0"]
TINY += ["--eval-max-prompts", "8", "--checkpoint-every", "2"]


@pytest.mark.slow  # a supervised phase, then GRPO (compiles a model): ~40 s on 2 CPU cores
def test_grpo_trains_on_reasoning_gym_from_the_command_line(tmp_path):
    """``relax grpo --task reasoning_gym:...`` with no data file: a mixture, its base model, GRPO,
    per-task metrics; then a --model run on that base model's HF directory."""
    run = tmp_path / "builtin"
    options = [
        "--reasoning-gym.options",
        "basic_arithmetic.max_digits=2",
        "leg_counting.max_animals=3",
    ]
    summary = load_example("grpo").main(
        ["--task", "reasoning_gym:basic_arithmetic,leg_counting", "--run-dir", str(run)]
        + ["--reasoning-gym.size", "64", "--reasoning-gym.eval-size", "8"]
        + ["--reasoning-gym.sft-steps", "20", "--reasoning-gym.sft-batch", "8"]
        + ["--max-prompt-tokens", "128", *options, *TINY]
    )
    steps = [m for m in _metrics(run) if "time/step" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["reward_errors"] == 0.0 and 0.0 <= m["reward/reasoning_gym"] <= 1.0
    evals = [m for m in _metrics(run) if "eval/basic_arithmetic/reward" in m]
    assert evals and "eval/leg_counting/reward" in evals[-1]
    assert 0.0 <= summary["after"]["reward"] <= 1.0
    model_run = tmp_path / "model"
    summary = load_example("grpo").main(
        ["--model", str(run / "base_model"), "--task", "reasoning_gym:basic_arithmetic"]
        + ["--run-dir", str(model_run), "--reasoning-gym.size", "32"]
        + ["--reasoning-gym.eval-size", "8", "--grpo.max-new-tokens", "16"]
        + ["--max-prompt-tokens", "64", "--reasoning-gym.options", "max_digits=2", *TINY]
    )
    assert (model_run / "task" / "train.jsonl").exists()
    steps = [m for m in _metrics(model_run) if "time/step" in m]
    assert len(steps) == 2 and all("reward/reasoning_gym" in m for m in steps)
    assert 0.0 <= summary["after"]["reward"] <= 1.0
