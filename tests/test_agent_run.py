"""``examples/train_agent.py``: the built-in calculator task end to end (fast: a tiny supervised
phase and two steps), and (slow) the default run learning to use the tool."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_agent  # noqa: E402

FAST = [
    "--task.sft-steps",
    "20",
    "--task.sft-batch",
    "8",
    "--task.num-train",
    "64",
    "--task.num-eval",
    "8",
    "--steps",
    "2",
    "--batch-size",
    "2",
    "--grpo.num-generations",
    "2",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "2",
    "--no-export-hf",
]


@pytest.mark.parametrize(
    "algorithm", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)]
)  # PPO: test_agent_step
@pytest.mark.slow
def test_train_agent_runs(tmp_path, algorithm):
    extra = (
        ["--ppo.num-generations", "2", "--ppo.max-new-tokens", "64", "--ppo.critic", "shared"]
        if algorithm == "ppo"
        else []
    )
    summary = train_agent.main(
        FAST + extra + ["--algorithm", algorithm, "--run-dir", str(tmp_path / "run")]
    )
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["steps"] == 2 and set(summary["before"]) >= {"success", "tool_use", "turns"}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "turns" in x]
    assert len(trained) == 2 and all(x["sampled_tokens"] > 0 for x in trained)
    report = (
        tmp_path / "run" / "startup.txt"
    ).read_text()  # the start-up report, as every trainer writes it
    assert (
        "== tools" in report
        and "multiply: Multiply two integers." in report
        and "--steps 2" in report
    )
    assert json.loads((tmp_path / "run" / "config.json").read_text())["algorithm"] == algorithm


@pytest.mark.slow
def test_train_agent_learns_to_use_the_tool(tmp_path):
    summary = train_agent.main(["--run-dir", str(tmp_path / "run")])
    before, after = summary["before"], summary["after"]
    assert after["success"] >= before["success"] + 0.3 and after["tool_use"] > before["tool_use"]
    assert summary["run_time_s"] < 600


def _parse(argv):
    return train_agent.cli(
        train_agent.AgentRunConfig, default=train_agent.builtin_defaults(), args=argv
    )


def test_builtin_budgets_fit_the_model_and_an_overflow_names_the_flag():
    from relax.algorithms.agent.run import AgentRunConfig
    from relax.algorithms.cli.configure import configure
    from relax.algorithms.ppo.config import PPOConfig
    from relax.tasks.agent import max_positions

    for algorithm in (
        "grpo",
        "ppo",
    ):  # the README's `--algorithm ppo --ppo.critic shared` among them
        cfg = _parse(["--algorithm", algorithm, "--ppo.critic", "shared"])
        assert cfg.algorithm_config.generation.max_new_tokens == 64 < max_positions(cfg.task)
    with pytest.raises(
        ValueError,
        match=r"--ppo.max-new-tokens 256 leaves no room for the prompt: .* 256 positions",
    ):
        AgentRunConfig(algorithm="ppo", ppo=configure(PPOConfig, max_new_tokens=256))
    assert (
        _parse(["--lora.rank", "4", "--lora.alpha", "8"]).lora.rank == 4
    )  # every trainer takes --lora.*


@pytest.mark.slow
def test_train_agent_trains_lora_adapters(tmp_path):
    fast = [a for a in FAST if a != "--no-export-hf"]
    summary = train_agent.main(
        fast + ["--lora.rank", "4", "--lora.alpha", "8", "--run-dir", str(tmp_path / "run")]
    )
    assert summary["steps"] == 2
    final = tmp_path / "run" / "final_hf"
    assert (final / "config.json").exists()  # the merged model
    config = json.loads(
        (final / "adapter" / "adapter_config.json").read_text()
    )  # the adapters, PEFT's format
    assert config["r"] == 4 and config["lora_alpha"] == 8


GUESS_ENV = '''
from relax.environments import StepResult


class Guess:
    """docs/agents.md's environment: guess the number, told higher or lower."""

    def reset(self, row):
        self.target = int(row["answer"])
        return [{"role": "user", "content": "Guess my number between 1 and 100."}]

    def step(self, action):
        text = action.text.strip()
        if not text.isdigit():
            return StepResult([{"role": "user", "content": "A number, please."}], reward=0.0, done=False)
        if int(text) == self.target:
            return StepResult([], reward=1.0, done=True)
        hint = "Higher." if int(text) < self.target else "Lower."
        return StepResult([{"role": "user", "content": hint}], reward=0.0, done=False)


class Graded:
    """Two turns, each scored by its sampled ids (rewards that differ even for an untrained
    model); a row's ``words`` make its prompt longer."""

    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": f"Say {row['answer']}." + " more" * row.get("words", 0)}]

    def step(self, action):
        self.turn += 1
        score = (sum(action.token_ids) % 7) / 6
        if self.turn >= 2:
            return StepResult([], reward=score, done=True)
        return StepResult([{"role": "user", "content": "Again."}], reward=score, done=False)


def not_an_env():
    return 42
'''


def write_model(directory: Path, sft_steps: int = 0) -> Path:
    """A tiny model with the agent task's ChatML tokenizer, as an HF directory (its vocabulary
    padded to a multiple of 8, so that it splits over a mesh's tensor axis): untrained, or after
    ``sft_steps`` of the task's supervised phase (it then ends its turns with a stop token)."""
    import dataclasses

    import jax

    from relax.models.decoder.transformer import init
    from relax.models.hf.checkpoint import save_pretrained
    from relax.tasks import agent as agent_task

    task = agent_task.AgentTask(num_train=64, num_eval=4, sft_steps=sft_steps, sft_batch=16)
    tokenizer = agent_task.build_tokenizer(task, directory / "tok")
    config = agent_task.model_config(task, tokenizer)
    config = dataclasses.replace(config, vocab_size=-(-config.vocab_size // 8) * 8)
    train, _ = agent_task.make_splits(task)
    model = (
        agent_task.train_base_model(
            task, tokenizer, train, key=jax.random.key(0), log=lambda *a: None, config=config
        )
        if sft_steps
        else init(config, jax.random.key(0))
    )
    save_pretrained(model, directory / "model")
    tokenizer.save_pretrained(directory / "model")
    return directory / "model"


@pytest.mark.slow
def test_train_agent_runs_a_users_environment_from_the_command_line(tmp_path, monkeypatch):
    (tmp_path / "guess_env.py").write_text(GUESS_ENV)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"answer": 10 + i}) + "\n" for i in range(12)))
    model = write_model(tmp_path)
    monkeypatch.chdir(tmp_path)  # the module is found in the working directory
    argv = ["--model", str(model), "--data", str(data), "--eval-fraction", "0.25"]
    argv += ["--steps", "1", "--batch-size", "2", "--grpo.num-generations", "2"]
    argv += [
        "--grpo.max-new-tokens",
        "48",
        "--agent.max-turn-tokens",
        "8",
        "--agent.max-turns",
        "2",
    ]
    with pytest.raises(ValueError, match=r"--env 'guess_env:not_an_env': int has neither"):
        train_agent.main(argv + ["--env", "guess_env:not_an_env", "--run-dir", "bad"])
    with pytest.raises(ValueError, match=r"--env 'no_such_module:Guess': cannot import"):
        train_agent.main(argv + ["--env", "no_such_module:Guess", "--run-dir", "bad"])
    summary = train_agent.main(
        argv + ["--env", "guess_env:Guess", "--no-export-hf", "--run-dir", str(tmp_path / "run")]
    )
    assert summary["steps"] == 1 and set(summary["before"]) >= {"success", "reward", "turns"}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "sampled_tokens" in x]
    assert len(trained) == 1 and trained[0]["turns"] >= 1 and trained[0]["sampled_tokens"] > 0
    report = (tmp_path / "run" / "startup.txt").read_text()
    assert "9 training rows, 3 held out (rows from" in report and "guess_env:Guess" in report


def test_a_sampler_mesh_is_refused():
    """Trajectories are sampled on the trainer mesh (each process on its own devices,
    ``relax.parallel.local``), between the environments' host steps: no separate sampler mesh."""
    with pytest.raises(SystemExit):  # tyro's usage error
        train_agent.main(FAST + ["--parallel.sampler-devices", "2"])


def test_lora_vision_is_refused(capsys):
    """The agent trainer takes text models: adapters on a vision tower are refused by name."""
    with pytest.raises(SystemExit):  # tyro's usage error
        train_agent.main(FAST + ["--lora.rank", "4", "--lora.vision"])
    assert "--lora.vision adapts a vision tower" in capsys.readouterr().err


RAGGED_ENV = '''
from relax.environments import StepResult


class Ragged:
    """Prompts as long as a row's ``words`` say; observations that grow turn by turn; a
    trajectory ends when its turn's ids sum to a multiple of 3, or after 3 turns."""

    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": f"Say {row['answer']}." + " more" * row["words"]}]

    def step(self, action):
        self.turn += 1
        if self.turn >= 3 or sum(action.token_ids) % 3 == 0:
            return StepResult([], reward=float(self.turn), done=True)
        again = "Again" + " and again" * (6 * self.turn)
        return StepResult([{"role": "user", "content": again}], reward=0.0, done=False)
'''


@pytest.mark.slow
def test_every_program_compiles_before_the_first_step(tmp_path, monkeypatch):
    """A user's environment with prompts of three buckets, observations of several chunks and
    trajectories that end at different turns (the batch compacted down to 2 rows): the start-up
    compiles the step and every rollout program, and no step or evaluation compiles anything."""
    from relax.algorithms.agent import evaluate
    from relax.environments import rollout
    from relax.train.run import CompileCounter

    (tmp_path / "ragged_env.py").write_text(RAGGED_ENV)
    rows = [{"answer": 10 + i, "words": (0, 3, 10)[i % 3]} for i in range(16)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = write_model(tmp_path, sft_steps=30)  # it ends its turns
    monkeypatch.chdir(tmp_path)
    widths, appends, evals = [], [], []
    pad = rollout._pad_prompts
    monkeypatch.setattr(rollout, "_pad_prompts", lambda p, w, i: widths.append(w) or pad(p, w, i))
    chunk = rollout._append_chunk
    monkeypatch.setattr(
        rollout, "_append_chunk", lambda *a: appends.append(a[4].shape[0]) or chunk(*a)
    )
    call = evaluate.HeldOut.__call__

    def counted(self, *args):
        with CompileCounter() as compiles:
            out = call(self, *args)
        evals.append(compiles.count)
        return out

    monkeypatch.setattr(evaluate.HeldOut, "__call__", counted)
    argv = ["--model", str(model), "--data", "rows.jsonl", "--env", "ragged_env:Ragged"]
    argv += ["--eval-fraction", "0.25", "--steps", "4", "--eval-every", "2"]
    argv += ["--batch-size", "2", "--grpo.num-generations", "4", "--grpo.max-new-tokens", "96"]
    argv += ["--agent.max-turn-tokens", "8", "--agent.max-turns", "3", "--agent.min-rows", "2"]
    train_agent.main(argv + ["--no-export-hf", "--run-dir", str(tmp_path / "run")])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["compiles"] for x in lines if "compiles" in x] == [0.0] * 4
    assert evals == [0, 0, 0]
    # the test means something: steps of two widths, observations of two chunks, compactions
    report = (tmp_path / "run" / "startup.txt").read_text()
    assert "rollout compact 8 to 4" in report and "rollout compact 4 to 2" in report
    assert len(set(widths)) >= 2 and max(appends) == 8 and min(appends) <= 4
    assert sum(x["observation_tokens"] for x in lines if "compiles" in x) > 0
