"""The run loop end to end on a tiny "real" setup (HF directory, sentencepiece file, jsonl data):
CLI flags, exact resume (after kill -9, from a damaged checkpoint, after SIGTERM), pending saves
on a crash, non-finite stops, eval-only, artifacts, and bad-input errors.

Faults that must end the interpreter (kill -9, an exception at top level) run this file as a
script (``fault`` mode): a reward function counts the training calls and fails at the given one.
"""

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from conftest import load_example

from relax.algorithms.online.batch import HostRecord, Sampled
from relax.algorithms.online.stages import make_score
from relax.compose import WithHost
from relax.models import ModelConfig, init
from relax.models.hf.checkpoint import save_pretrained
from relax.objectives.registry import GSPOLossConfig
from relax.rewards.functions import RewardError
from relax.text.sentencepiece_model import Tokenizer, train_sentencepiece
from relax.train.checkpoint import CheckpointCorruptError, Checkpointer
from relax.train.health import NonFiniteError
from relax.train.preemption import Preempted

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdef"), rng.integers(2, 5))) for _ in range(64)]
    tok_path = train_sentencepiece(
        [w + "=" for w in words], d / "tok", vocab_size=12, model_type="char"
    )
    tok = Tokenizer(tok_path)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.bos_id,
        pad_token_id=tok.pad_id,
    )
    save_pretrained(init(cfg, jax.random.key(0), std=0.1), d / "model")
    rows = [{"prompt": w + "=", "answer": w[::-1], "data_source": f"len{len(w)}"} for w in words]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:48]))
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[48:]))
    return d


def _args(setup, run_dir, steps, *extra):
    return [
        "--model",
        str(setup / "model"),
        "--tokenizer",
        str(setup / "tok.model"),
        "--data",
        str(setup / "train.jsonl"),
        "--eval-data",
        str(setup / "eval.jsonl"),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--batch-size",
        "4",
        "--max-prompt-tokens",
        "16",
        "--grpo.num-generations",
        "4",
        "--grpo.max-new-tokens",
        "5",
        "--grpo.beta",
        "0.04",
        "--grpo.optimizer.learning-rate",
        "1e-2",
        "--checkpoint-every",
        "2",
        "--eval.num-samples",
        "2",
        "--eval-max-prompts",
        "3",
        "--reward",
        "overlap",
        "--reward-workers",
        "0",  # the fault-injecting reward counts its calls in the trainer process
        "--preset",
        "grpo",
        *extra,
    ]


def _train_lines(run_dir):
    lines = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    out = {}
    for l in lines:
        if "loss" in l:  # training lines (evaluation lines carry eval/ keys only)
            out[l["step"]] = {
                k: v
                for k, v in l.items()
                if k not in ("time", "tokens_per_s", "compiles") and not k.startswith("time/")
            }
    return out


TRAIN_COMPLETIONS = (
    16  # 4 prompts x 4 completions; evaluation calls score 3 or 6 (--eval-max-prompts 3)
)


def overlap(prompts, completions, answer, **fields):
    """A dense reward for the untrained model (exact match is always 0 there): the share of the
    answer's letters that the completion contains."""
    return [len(set(c) & set(a)) / len(set(a)) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module", autouse=True)
def overlap_reward():
    """``--reward overlap`` for this module's runs."""
    from relax.rewards import builtin

    builtin.BUILTIN_REWARDS["overlap"] = overlap
    yield
    del builtin.BUILTIN_REWARDS["overlap"]


def faulty_reward(fault: str, at: int):
    """``overlap`` that fails at its ``at``-th training call: ``kill9`` / ``raise`` / ``sigterm``."""
    calls = []

    def reward(prompts, completions, **fields):
        if len(completions) == TRAIN_COMPLETIONS:
            calls.append(1)
            if len(calls) == at:
                if fault == "raise":
                    raise RuntimeError(f"reward broke at training call {at}")
                os.kill(os.getpid(), signal.SIGKILL if fault == "kill9" else signal.SIGTERM)
        return overlap(prompts, completions, **fields)

    return reward


def _run_fault(setup, run_dir, fault: str, at: int, *extra) -> subprocess.CompletedProcess:
    args = _args(setup, run_dir, 4, *extra)
    return subprocess.run(
        [sys.executable, __file__, "fault", fault, str(at), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _steps_logged(run_dir) -> list[int]:
    return [
        json.loads(l)["step"] for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]


def _flip_bytes(checkpoint_dir: Path) -> None:
    """Flip 64 bytes in the middle of the largest file of a checkpoint's state item."""
    f = max(
        (p for p in (checkpoint_dir / "state").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    f.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    """An uninterrupted 4-step run (checkpoints at 2 and 4) and its summary."""
    run_dir = tmp_path_factory.mktemp("straight")
    return run_dir, load_example("grpo").main(_args(setup, run_dir, 4))


@pytest.mark.slow
def test_resume_after_kill_9_leaves_logs_as_if_never_stopped(setup, straight, tmp_path):
    run_dir, summary = straight
    assert set(summary) >= {"before", "after", "steps", "export"}
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "final_hf" / "config.json").exists() and (
        run_dir / "final_hf" / "tokenizer.model"
    ).exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2",
        "4",
    ]
    assert "pass@1" in summary["after"] and any(
        k.startswith("len") and k.endswith("/pass@1") for k in summary["after"]
    )

    killed = tmp_path / "killed"
    proc = _run_fault(
        setup, killed, "kill9", 4
    )  # dies in step 4: steps 1-3 logged, checkpoint 2 saved
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert _steps_logged(killed) == [0, 1, 2, 3]  # the "before" evaluation, then training lines
    before = json.loads((killed / "summary.json").read_text())[
        "before"
    ]  # written as soon as it exists

    resumed = load_example("grpo").main(_args(setup, killed, 4, "--resume"))
    assert _steps_logged(killed) == [
        0,
        1,
        2,
        3,
        4,
        4,
    ]  # each step once; 4 = its line + the "after" evaluation
    assert (
        resumed["before"] == before == summary["before"]
    )  # the first run's; nothing evaluated at step 2
    a, b = _train_lines(run_dir), _train_lines(killed)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [1, 2, 3, 4]
    assert all(
        a[step]["grad_norm"] > 0 for step in a
    )  # the weights move: the comparison is not vacuous
    compiles = {
        l["step"]: l["compiles"]
        for l in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in l
    }
    assert all(
        compiles[s] == 0 for s in (1, 2, 3, 4)
    )  # static shapes, every program compiled before step 1 (relax.algorithms.online.ahead)
    for step in (1, 2, 3, 4):
        assert a[step] == b[step], step  # bit for bit: JSON floats round-trip exactly
    assert resumed["after"] == summary["after"]

    only = load_example("grpo").main(_args(setup, killed, 4, "--resume", "--eval-only"))
    assert only["step"] == 4 and "pass@1" in only["eval_only"]


PIPELINED = ("--async.staleness", "1", "--async.correction.kind", "tis")


@pytest.mark.slow  # make test-all; the capability keeps a faster test
def test_pipelined_run_resumes_after_kill_9_bit_for_bit(setup, straight, tmp_path):
    """``--async.staleness 1``: killed while batch 5 is scored (update 4 dispatched), resumed
    from the newest checkpoint, whose sampler copy of the version before it re-samples the batch
    in flight as the first run did."""
    every = ("--checkpoint-every", "1")
    run_dir = tmp_path / "straight"
    summary = load_example("grpo").main(_args(setup, run_dir, 6, *PIPELINED, *every))
    assert summary["staleness_histogram"] == {"0": 1, "1": 5}
    killed = tmp_path / "killed"
    proc = _run_fault(setup, killed, "kill9", 5, *PIPELINED, *every, "--steps", "6")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert _steps_logged(killed) == [0, 1, 2, 3]
    saved = [p.name for p in (killed / "checkpoints").iterdir() if p.name.isdigit()]
    assert (
        {"1", "2"} <= set(saved) <= {"1", "2", "3"}
    )  # the save of 3 may still have been under way
    load_example("grpo").main(_args(setup, killed, 6, "--resume", *PIPELINED, *every))
    a, b = _train_lines(run_dir), _train_lines(killed)
    assert [a[step]["staleness"] for step in sorted(a)] == [0] + [
        1
    ] * 5  # batch 1 on-policy, then one behind
    assert all(
        a[step]["is_weight_max"] > 1 for step in range(2, 7)
    )  # the weights moved: stale samples
    for step in range(1, 7):
        assert a[step] == b[step], step
    sync = _train_lines(straight[0])
    assert sync[1]["reward"] == a[1]["reward"]  # batch 1: the same weights, key and samples
    assert any(
        sync[step]["reward"] != a[step]["reward"] for step in (2, 3, 4)
    )  # then: older weights


@pytest.mark.slow
def test_crash_completes_the_pending_checkpoint(setup, tmp_path):
    """A reward that raises at step 3, while step 2's asynchronous save is in flight, ends the
    interpreter; checkpoint 2 must be whole and verify."""
    proc = _run_fault(setup, tmp_path, "raise", 3)
    assert proc.returncode == 1 and "reward broke at training call 3" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert "cannot schedule new futures" not in proc.stderr
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["2"], names  # committed, no orbax-checkpoint-tmp left behind
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.latest_step() == 2


@pytest.mark.slow
def test_damaged_checkpoint_stops_resume_unless_fallback_is_asked(setup, straight, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(straight[0], run_dir)
    _flip_bytes(run_dir / "checkpoints" / "4")
    with pytest.raises(CheckpointCorruptError, match=r"step 4"):
        load_example("grpo").main(_args(setup, run_dir, 4, "--resume"))
    assert (run_dir / "checkpoints" / "4").exists()  # reported, left where it is
    load_example("grpo").main(_args(setup, run_dir, 4, "--resume", "--resume-fallback"))
    assert (run_dir / "damaged_checkpoints" / "4").exists()
    a, b = _train_lines(straight[0]), _train_lines(run_dir)
    assert all(a[step] == b[step] for step in (1, 2, 3, 4))  # steps 3-4 trained again, identically
    assert _steps_logged(run_dir).count(3) == 1


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_finishes(setup, straight, tmp_path, monkeypatch):
    from relax.rewards import builtin

    monkeypatch.setitem(builtin.BUILTIN_REWARDS, "overlap", faulty_reward("sigterm", 3))
    with pytest.raises(Preempted, match="saved as checkpoint 3"):
        load_example("grpo").main(_args(setup, tmp_path, 4))
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is put back
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2, 3]
    load_example("grpo").main(_args(setup, tmp_path, 4, "--resume"))
    a, b = _train_lines(straight[0]), _train_lines(tmp_path)
    assert all(a[step] == b[step] for step in (1, 2, 3, 4))


@pytest.mark.slow
def test_consecutive_non_finite_steps_stop_the_run(setup, tmp_path):
    """A model whose finite weights overflow in its forward: every step is skipped; the run stops
    after the limit, naming the first non-finite quantity, and exports nothing. A model with a NaN
    weight does not even load (the file and tensor named)."""
    import jax.numpy as jnp

    from relax.models.hf.checkpoint import HFFormatError, load_pretrained

    model = load_pretrained(setup / "model")
    nan = tmp_path / "nan_model"
    save_pretrained(
        eqx.tree_at(lambda m: m.layers.w_up, model, model.layers.w_up.at[1, 3, 5].set(jnp.nan)), nan
    )
    with pytest.raises(
        HFFormatError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' holds 1 non-finite"
    ):
        load_pretrained(nan)
    bad = tmp_path / "overflowing_model"
    save_pretrained(
        eqx.tree_at(lambda m: m.layers.w_up, model, model.layers.w_up.at[1].set(3e38)), bad
    )
    args = _args(setup, tmp_path / "run", 6, "--health.max-consecutive-skips", "2")
    args[args.index("--model") + 1] = str(bad)
    with pytest.raises(
        NonFiniteError,
        match=r"2 optimizer steps in a row were skipped.*iteration 1 with "
        r"non-finite old_logprobs",
    ):
        load_example("grpo").main(args)
    assert _steps_logged(tmp_path / "run")[-1] == 2 and not (tmp_path / "run" / "final_hf").exists()


def test_bad_run_config_names_the_flag(setup, capsys):
    example = load_example("grpo")
    with pytest.raises(SystemExit):  # tyro prints the config's error and exits with status 2
        example.main(["--model", str(setup / "model")])  # no --data
    assert "--model needs --data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.main(
            _args(setup, setup / "x", 1, "--reward", "exact_match", "--reward-weights", "1", "2")
        )
    assert "reward-weights" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        example.main(_args(setup, setup / "x", 1)[:-2] + ["--preset", "nope"])


def test_preset_flag_sets_algorithm_defaults_in_both_modes(setup):
    """--preset picks the algorithm with and without --model; explicit --grpo.* flags still win."""
    example = load_example("grpo")
    builtin = example.parse_args(["--preset", "dapo"])
    assert builtin.preset == "dapo"
    assert (builtin.grpo.loss_type, builtin.grpo.policy_loss.epsilon_high, builtin.grpo.beta) == (
        "dapo",
        0.28,
        0.0,
    )
    assert builtin.grpo.zero_std_groups == "drop" and builtin.grpo.mask_truncated_completions
    assert builtin.grpo.generation.max_new_tokens == 8  # the built-in task's size stays
    assert example.parse_args([]).grpo.loss_type == "grpo"
    for flag in (
        "--grpo.policy-loss.epsilon-high",
        "--grpo.epsilon-high",
    ):  # the loss's option; the old name warns
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            real = example.parse_args(
                _args(setup, setup / "x", 1)[:-2] + ["--preset=gspo", flag, "5e-4"]
            )
        assert [w.category for w in caught if issubclass(w.category, FutureWarning)] == (
            [FutureWarning] if flag == "--grpo.epsilon-high" else []
        ), flag
        loss = real.grpo.policy_loss
        assert type(loss) is GSPOLossConfig, flag
        assert (loss.importance, loss.epsilon_low, loss.epsilon_high) == ("sequence", 3e-4, 5e-4), (
            flag
        )


def test_missing_data_field_names_file_row_field(setup, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "ab=", "answer": "ba"}) + "\n" + json.dumps({"prompt": "cd="}) + "\n"
    )
    example = load_example("grpo")
    args = _args(setup, tmp_path / "r", 1)
    args[args.index("--data") + 1] = str(bad)
    with pytest.raises(KeyError, match=r"bad\.jsonl.*row 2.*answer"):
        example.main(args)


@pytest.mark.parametrize(
    "style", ["qwen25", pytest.param("llama3", marks=pytest.mark.slow)]
)  # templates: test_text_*
@pytest.mark.slow
def test_model_directory_with_tokenizer_json_trains_and_exports_for_transformers(tmp_path, style):
    """``--model DIR`` alone: the tokenizer.json and chat template come from DIR (Qwen2.5 style:
    no BOS anywhere; Llama 3 style: the template writes the BOS); chat-message prompts go through
    the template; the export loads in transformers (tokenizer and model) and round-trips."""
    transformers = pytest.importorskip("transformers")
    from text_fixtures import make_model_dir

    from relax.text import load_tokenizer

    d = make_model_dir(tmp_path, style)
    tok = load_tokenizer(d)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_ids,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    save_pretrained(init(cfg, jax.random.key(0), std=0.1), d)
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)}
        for i in range(8)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    summary = load_example("grpo").main(
        [
            "--model",
            str(d),
            "--data",
            str(tmp_path / "train.jsonl"),
            "--run-dir",
            str(run_dir),
            "--steps",
            "1",
            "--batch-size",
            "4",
            "--max-prompt-tokens",
            "128",
            "--grpo.num-generations",
            "2",
            "--grpo.max-new-tokens",
            "4",
            "--reward",
            "numeric_match",
            "--eval-fraction",
            "0.25",
            "--eval.num-samples",
            "1",
            "--export-every",
            "1",
        ]
    )
    assert summary["steps"] == 1
    assert load_tokenizer(run_dir / "hf" / "step-1").encode("a b") == tok.encode(
        "a b"
    )  # exported on request
    export = run_dir / "final_hf"
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    ours = load_tokenizer(export)
    messages = rows[0]["prompt"]
    want = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert want == list(
        hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    assert want.count(tok.bos_token_id) == (1 if style == "llama3" else 0)  # never a second BOS
    assert (
        ours.encode("a b c") == hf_tok.encode("a b c") and ours.eos_token_ids == tok.eos_token_ids
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert model.config.vocab_size == tok.vocab_size


def test_raising_reward_function_names_function_and_sample():
    def broken(prompts, completions, **fields):
        return [1.0 / (len(c) - 3) for c in completions]  # ZeroDivisionError on 3-token completions

    stage = make_score([broken], lambda t, m: [" ".join(map(str, r[m > 0])) for r, m in zip(t, m)])
    tokens = np.array([[[1, 2, 3], [1, 2, 3]]])
    mask = np.array([[[1, 1, 0], [1, 0, 0]]])
    ids = np.ones((1, 2), np.int32)
    rollout = Sampled(
        prompt_ids=ids,
        prompt_mask=ids,
        tokens=tokens,
        mask=mask,
        old_logprobs=np.zeros(tokens.shape),
        lengths=mask.sum(-1),
        finished=np.ones((1, 2), bool),
        policy_version=np.zeros((1, 2), np.int32),
    )
    with pytest.raises(RewardError, match="broken"):
        stage(None, WithHost(rollout, HostRecord(prompts=["q"], fields={})))


def test_summary_table_reads_nulls_as_nan():
    """A resumed run's "before" comes back from JSON, where a NaN metric is null."""
    from relax.train.run import summary_table

    table = summary_table(
        {"success": 0.25, "success_with_tool": None}, {"success": 0.75, "success_with_tool": 0.5}
    )
    assert "+0.500" in table.splitlines()[1] and "nan" in table.splitlines()[2]


PARTIAL = (
    "--async.staleness",
    "2",
    "--async.partial",
    "2",
    "--async.correction.kind",
    "tis",
    "--grpo.max-new-tokens",
    "6",
)


@pytest.mark.slow  # make test-all; tests/test_partial_rollout.py resumes the pipeline in process
def test_partial_rollout_run_resumes_after_kill_9_bit_for_bit(setup, tmp_path):
    """``--async.partial 2``: each batch sampled over two rollouts (the batches in progress are in
    the checkpoint's data state); killed with -9 at the fourth training reward call, resumed: the
    same run."""
    every = ("--checkpoint-every", "1")
    run_dir = tmp_path / "straight"
    summary = load_example("grpo").main(_args(setup, run_dir, 6, *PARTIAL, *every))
    assert summary["staleness_histogram"] == {
        "0": 1,
        "1": 1,
        "2": 4,
    }  # oldest tokens: v(i - 1), v(i) = i - 1
    killed = tmp_path / "killed"
    proc = _run_fault(setup, killed, "kill9", 4, *PARTIAL, *every, "--steps", "6")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    load_example("grpo").main(_args(setup, killed, 6, "--resume", *PARTIAL, *every))
    a, b = _train_lines(run_dir), _train_lines(killed)
    assert [a[step]["staleness"] for step in sorted(a)] == [0, 1, 2, 2, 2, 2]
    assert a[1]["partial/calls"] == 2 and all(a[step]["partial/calls"] == 1 for step in range(2, 7))
    for step in range(1, 7):
        assert a[step] == b[step], step


if __name__ == "__main__":
    if sys.argv[1] != "fault":
        raise SystemExit(f"unknown mode {sys.argv[1:]}")
    from relax.rewards import builtin

    builtin.BUILTIN_REWARDS["overlap"] = faulty_reward(sys.argv[2], int(sys.argv[3]))
    load_example("grpo").main(sys.argv[4:])
