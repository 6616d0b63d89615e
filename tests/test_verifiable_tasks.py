"""The built-in verifiable tasks end to end: ``train_grpo.py --task code`` (code_exec in the
sandbox, from a worker pool) and ``--task math`` (math_verify); the pool's scoring overlaps the
reference forward and gives the rewards that scoring in the trainer process gives."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_example

from relax.algorithms.grpo.config import preset
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.batch import step_input
from relax.algorithms.online.step import StepParts
from relax.models import init, small_config
from relax.rewards.functions import RewardFunction
from relax.rewards.isolation import works
from relax.rewards.pool import PoolConfig, RewardPool
from relax.tasks import code, math
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state

NO_SANDBOX = all(
    works(m, 65534, 65534) for m in ("bwrap", "unshare")
)  # neither bwrap nor unshare works here


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# the task runs are slow-only (make test-all): code_exec, math_verify and the tasks' answers have fast tests of
# their own, and the GRPO run on rows with a reward by name is test_run.py's
@pytest.mark.parametrize(
    "task",
    [pytest.param("code", marks=pytest.mark.slow), pytest.param("math", marks=pytest.mark.slow)],
)
def test_grpo_runs_the_builtin_task(task, tmp_path):
    if task == "math":
        pytest.importorskip("math_verify")
    elif NO_SANDBOX:
        pytest.skip("no namespace isolation here: generated code cannot run")
    summary = load_example("grpo").main(
        [
            "--task",
            task,
            "--run-dir",
            str(tmp_path),
            "--steps",
            "2",
            f"--{task}.sft-steps",
            "30",
            "--batch-size",
            "4",
            "--grpo.num-generations",
            "4",
            "--eval-every",
            "0",
            "--eval-max-prompts",
            "8",
            "--checkpoint-every",
            "2",
        ]
    )
    reward = "code_exec" if task == "code" else "math_verify"
    lines = [line for line in _lines(tmp_path) if "time/step" in line]
    assert len(lines) == 2
    for line in lines:
        assert line["reward_errors"] == 0.0 and 0.0 <= line[f"reward/{reward}"] <= 1.0
        assert {"time/score_start", "time/reference", "time/score_finish"} <= set(line)
    rows = [json.loads(r) for r in (tmp_path / "task" / "train.jsonl").read_text().splitlines()]
    assert ("tests" in rows[0]) == (task == "code")
    assert 0.0 <= summary["after"]["reward"] <= 1.0


def test_task_answers_pass_their_own_checks():
    """The data is right: each reference solution passes its tests, each answer verifies, and the
    noisy teachers are sometimes wrong."""
    from relax.rewards.code_exec import CodeExec

    if NO_SANDBOX:
        pytest.skip("no namespace isolation here: generated code cannot run")
    rows, _ = code.make_splits(code.CodeTask())
    rows = rows[:6]
    assert (
        CodeExec()(["p"] * 6, [r["answer"] for r in rows], tests=[r["tests"] for r in rows])
        == [1.0] * 6
    )
    wrong = code.teacher(code.CodeTask(teacher_accuracy=0.0))(rows, np.random.default_rng(0))
    assert any(w != r["answer"] for w, r in zip(wrong, rows))
    mv = pytest.importorskip("relax.rewards.math_answers").MathVerify
    pytest.importorskip("math_verify")
    rows, held_out = math.make_splits(math.MathTask())
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in held_out}
    sample = rows[:9]
    right = [f"\\boxed{{{r['answer']}}}" for r in sample]
    assert mv()(["p"] * 9, right, answer=[r["answer"] for r in sample]) == [1.0] * 9
    off = math.teacher(math.MathTask(teacher_accuracy=0.0))(sample, np.random.default_rng(0))
    assert mv()(["p"] * 9, off, answer=[r["answer"] for r in sample]).count(1.0) <= 1


def _length_reward(prompts, completions, **fields):
    return [float(len(c) % 5) for c in completions]


@pytest.mark.slow  # make test-all; the capability keeps a faster test
def test_pool_scores_between_rollout_and_update_like_the_trainer_process():
    cfg = preset(
        "grpo",
        num_generations=4,
        max_new_tokens=6,
        beta=0.04,
        optimizer=OptimizerConfig(learning_rate=1e-3),
    )
    mcfg = small_config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    ids = jax.random.randint(jax.random.key(2), (4, 8), 0, mcfg.vocab_size)
    batch = step_input(ids, jnp.ones_like(ids), ["x"] * 4, {})
    decode = lambda tokens, mask: [" ".join(map(str, r[m > 0])) for r, m in zip(tokens, mask)]  # noqa: E731
    rf = RewardFunction(_length_reward, name="length")
    outs = []
    with RewardPool([rf], PoolConfig(num_workers=2, chunk_size=3, timeout_s=30.0)) as pool:
        for p in (None, pool):
            state = init_state(
                init(mcfg, jax.random.key(0)),
                cfg.optimizer.make(),
                key=jax.random.key(1),
                with_reference=True,
            )
            step = make_grpo_step(
                cfg,
                StepParts(
                    reward_fns=[rf], decode=decode, eos_ids=(), pad_id=0, pool=p, timeout_s=30.0
                ),
            )
            names = [seg.names for seg in step.segments]
            assert names[1:5] == [("score_start",), ("pack",), ("reference",), ("score_finish",)], (
                names
            )
            outs.append(step(state, batch)[1])
    np.testing.assert_array_equal(
        np.asarray(outs[0].device.batch.rewards), np.asarray(outs[1].device.batch.rewards)
    )
    np.testing.assert_allclose(
        float(outs[0].device.metrics["loss"]), float(outs[1].device.metrics["loss"]), rtol=1e-6
    )
    assert outs[1].host.pending_scores is None and outs[1].host.local_scores is None


@pytest.mark.slow  # TextRewardModel has fast tests (test_reward_model.py); this is the --reward-model wiring
def test_grpo_with_a_reward_model_directory(tmp_path):
    """``--reward-model DIR``: a saved reward model (here with another tokenizer than the
    policy's: a byte-level BPE) scores the decoded completions; its mean is the logged reward."""
    from text_fixtures import make_model_dir

    from relax.models.decoder.transformer import init as init_model
    from relax.models.heads.reward_model import init_reward_model, save_reward_model
    from relax.tasks.base import tiny_llama
    from relax.text import load_tokenizer

    tok = load_tokenizer(make_model_dir(tmp_path / "tok", "llama3"))
    backbone = init_model(
        tiny_llama(tok, hidden_size=32, num_layers=1, max_positions=256), jax.random.key(3)
    )
    rm_dir = save_reward_model(
        init_reward_model(backbone, jax.random.key(4), head_std=1.0, pad_token_id=tok.pad_token_id),
        tmp_path / "rm",
        tokenizer=tok,
    )
    run = tmp_path / "run"
    load_example("grpo").main(
        [
            "--run-dir",
            str(run),
            "--steps",
            "1",
            "--reverse.sft-steps",
            "20",
            "--reward-model",
            str(rm_dir),
            "--reward-weights",
            "0.0",
            "--eval-every",
            "0",
            "--eval-max-prompts",
            "4",
            "--batch-size",
            "4",
            "--checkpoint-every",
            "1",
        ]
    )
    line = next(line for line in _lines(run) if "time/step" in line)
    assert line["reward/exact_match"] >= 0.0 and line["reward/reward_model"] != 0.0
    np.testing.assert_allclose(line["reward"], line["reward/reward_model"], rtol=1e-5)
