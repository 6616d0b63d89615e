"""The offline trainers' command lines (examples/train_*.py) on the built-in task's data through
the real ``--model/--data`` path: each learns (its before/after figure moves the right way),
leaves a run directory like GRPO's, and resumes exactly."""

import json
from pathlib import Path

import jax
import pytest
from conftest import load_example

from relax.algorithms.offline.run import batch_iterator, greedy_accuracy
from relax.models.hf.checkpoint import load_pretrained, save_pretrained
from relax.tasks import reverse
from relax.text.loader import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TASK = reverse.ReverseTask(num_train=1000, num_eval=64)


def write_base(task: reverse.ReverseTask, d: Path):
    """``task``'s base model (it prefers copying to reversing) in ``d / "model"``, an HF directory
    with its tokenizer; returns the model."""
    train, _ = reverse.make_splits(task)
    tokenizer = reverse.build_tokenizer(task, d)
    model = reverse.train_base_model(
        task, tokenizer, train, key=jax.random.key(0), log=lambda *a: None
    )
    save_pretrained(model, d / "model")
    tokenizer.save_pretrained(d / "model")
    return model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The reverse task's base model as an HF directory with its tokenizer (``write_base``)."""
    d = tmp_path_factory.mktemp("offline")
    write_base(TASK, d)
    return d


def data(base: Path, rows_of, name: str) -> list[str]:
    train, eval_ = reverse.write_task_data(TASK, base / name, rows_of)
    return ["--model", str(base / "model"), "--data", train, "--eval-data", eval_]


def test_batch_iterator_resumes_exactly():
    it = batch_iterator(list(range(10)), 4, 3, collate=list)
    next(it)
    state = it.get_state()
    want = [next(it) for _ in range(3)]
    again = batch_iterator(list(range(10)), 4, 3, collate=list)
    again.set_state(state)
    assert [next(again) for _ in range(3)] == want
    with pytest.raises(ValueError, match="3 training examples make no full batch of 4"):
        batch_iterator([1, 2, 3], 4, 0, collate=list)


@pytest.mark.slow
def test_greedy_accuracy_reads_the_column_it_is_given(base):
    """The win rate's figure on rows with no ``answer`` column (a user's preference data): the
    share of greedy completions equal to ``answer_field``, as with the same strings as ``answer``.
    The base model copies, so the copy as ``chosen`` scores and a wrong ``answer`` beside it is
    not read."""
    policy, tok = load_pretrained(base / "model"), load_tokenizer(base / "model")
    _, held_out = reverse.make_splits(TASK)
    rows = held_out[:16]
    pairs = [{"prompt": r["prompt"], "chosen": reverse.copy_of(r)} for r in rows]
    misleading = [{**p, "answer": r["answer"]} for p, r in zip(pairs, rows)]
    as_answer = [{"prompt": p["prompt"], "answer": p["chosen"]} for p in pairs]
    kw = dict(max_new_tokens=12)
    want = greedy_accuracy(policy, tok, as_answer, **kw)
    assert want > 0.5  # the base model's copying behaviour
    assert greedy_accuracy(policy, tok, pairs, answer_field="chosen", **kw) == want
    assert greedy_accuracy(policy, tok, misleading, answer_field="chosen", **kw) == want


@pytest.mark.slow  # make test-all; the capability keeps a faster test
def test_reward_model_learns_and_exports_for_transformers(base, tmp_path):
    run_dir = tmp_path / "run"
    summary = load_example("reward_model").main(
        [
            *data(base, reverse.preference_records, "pairs"),
            "--run-dir",
            str(run_dir),
            "--steps",
            "30",
            "--batch-size",
            "16",
            "--max-prompt-tokens",
            "16",
            "--max-completion-tokens",
            "8",
            "--reward-model.optimizer.learning-rate",
            "1e-3",
            "--checkpoint-every",
            "15",
        ]
    )
    assert summary["after"]["pair_accuracy"] > summary["before"]["pair_accuracy"] + 0.2, summary
    assert json.loads((run_dir / "summary.json").read_text())["after"] == summary["after"]
    report = (
        run_dir / "startup.txt"
    ).read_text()  # the start-up report, as every trainer writes it
    assert "--max-completion-tokens 8 (default 256)" in report and "== first training row" in report
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 30
    config = json.loads((run_dir / "final_hf" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")


def sft_args(base: Path) -> list[str]:
    return [
        *data(base, reverse.sft_records, "sft"),
        "--sft.max-length",
        "32",
        "--batch-size",
        "8",
        "--sft.optimizer.learning-rate",
        "1e-3",
        "--checkpoint-every",
        "2",
        "--eval-max-examples",
        "64",
    ]


@pytest.mark.slow  # make test-all; test_sft_resumes_exactly keeps the command line in make test
def test_sft_learns(base, tmp_path):
    """Packed SFT on the right answers: held-out greedy accuracy rises, the NLL falls."""
    summary = load_example("sft").main(
        [*sft_args(base), "--run-dir", str(tmp_path / "long"), "--steps", "30"]
    )
    assert summary["after"]["greedy/accuracy"] > summary["before"]["greedy/accuracy"] + 0.2, summary
    assert summary["after"]["nll"] < summary["before"]["nll"]


@pytest.mark.slow
def test_sft_resumes_exactly(base, tmp_path):
    """4 steps straight equal 2 steps + --resume to 4 bit for bit (data position included)."""
    args = sft_args(base)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    load_example("sft").main([*args, "--run-dir", str(straight), "--steps", "4"])
    load_example("sft").main([*args, "--run-dir", str(resumed), "--steps", "2"])
    load_example("sft").main([*args, "--run-dir", str(resumed), "--steps", "4", "--resume"])
    a, b = train_lines(straight), train_lines(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and all(a[s] == b[s] for s in a)


@pytest.mark.slow  # make test-all; the capability keeps a faster test
def test_distillation_brings_a_fresh_student_to_its_teacher(base, tmp_path):
    """Built-in style: a fresh 32-wide student learns the base model (teacher) off-policy."""
    from relax.models import ModelConfig, init
    from relax.models.hf.checkpoint import load_pretrained
    from relax.text import load_tokenizer

    teacher = load_pretrained(base / "model")
    c = teacher.config
    student = init(
        ModelConfig(**{**c.__dict__, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8}),
        jax.random.key(5),
        std=0.05,
    )
    save_pretrained(student, base / "student")
    load_tokenizer(base / "model").save_pretrained(base / "student")
    args = data(
        base,
        lambda rs: [
            {k: r[k] for k in ("prompt", "completion")} for r in reverse.unpaired_records(rs, 0)
        ],
        "distill",
    )
    args[1] = str(base / "student")
    summary = load_example("distill").main(
        [
            *args,
            "--teacher",
            str(base / "model"),
            "--run-dir",
            str(tmp_path),
            "--steps",
            "40",
            "--max-prompt-tokens",
            "16",
            "--max-completion-tokens",
            "8",
            "--distill.optimizer.learning-rate",
            "3e-3",
        ]
    )
    assert summary["after"]["kl_to_teacher"] < 0.6 * summary["before"]["kl_to_teacher"], summary
    assert summary["after"]["top1_accuracy"] > summary["before"]["top1_accuracy"] + 0.2


def train_lines(run_dir: Path) -> dict:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {
        l["step"]: {
            k: v
            for k, v in l.items()
            if k not in ("time", "tokens_per_s", "compiles") and not k.startswith("time/")
        }
        for l in lines
        if "loss" in l
    }


@pytest.mark.parametrize(
    "name, loss_type, lr",
    [("dpo", "sigmoid", "5e-5"), pytest.param("orpo", "orpo", "3e-4", marks=pytest.mark.slow)],
)
@pytest.mark.slow
def test_preference_trainers_learn_the_chosen_behaviour(base, tmp_path, name, loss_type, lr):
    """DPO and ORPO on pairs (reverse chosen, copy rejected): held-out preference accuracy and the
    win rate of the chosen behaviour (greedy completion == chosen) both rise."""
    summary = load_example(name).main(
        [
            *data(base, reverse.preference_records, "pairs"),
            "--run-dir",
            str(tmp_path),
            "--steps",
            "60",
            "--dpo.max-prompt-tokens",
            "16",
            "--dpo.max-completion-tokens",
            "8",
            "--eval-max-examples",
            "64",
            "--dpo.optimizer.learning-rate",
            lr,
        ]
    )
    before, after = summary["before"], summary["after"]
    assert after["preference_accuracy"] > before["preference_accuracy"] + 0.5, summary
    assert after["win_rate"] > before["win_rate"] + 0.2, summary


@pytest.mark.slow  # make test-all; the capability keeps a faster test
def test_dpo_with_a_precomputed_reference_matches_the_reference_model(base, tmp_path):
    """--dpo.precompute-reference: reference log-probs computed once, cached beside the data (the
    second run loads them), and the run logs the same metrics as with the reference model."""
    args = [
        *data(base, reverse.preference_records, "pairs-cached"),
        "--steps",
        "3",
        "--dpo.max-prompt-tokens",
        "16",
        "--dpo.max-completion-tokens",
        "8",
        "--eval-max-examples",
        "16",
        "--dpo.optimizer.learning-rate",
        "5e-5",
    ]
    load_example("dpo").main([*args, "--run-dir", str(tmp_path / "model")])
    load_example("dpo").main(
        [*args, "--run-dir", str(tmp_path / "cached"), "--dpo.precompute-reference"]
    )
    assert list((base / "pairs-cached").glob("*.safetensors"))  # the cache beside the data
    a, b = train_lines(tmp_path / "model"), train_lines(tmp_path / "cached")
    for s in (1, 2, 3):
        for k in ("loss", "rewards/margins", "rewards/accuracies"):
            assert a[s][k] == pytest.approx(b[s][k], rel=1e-4, abs=1e-6), (s, k)


@pytest.mark.slow  # make test-all; the capability keeps a faster test
def test_kto_learns_from_unpaired_feedback(base, tmp_path):
    summary = load_example("kto").main(
        [
            *data(base, lambda rs: reverse.unpaired_records(rs, 0), "unpaired"),
            "--run-dir",
            str(tmp_path),
            "--steps",
            "30",
            "--kto.max-prompt-tokens",
            "16",
            "--kto.max-completion-tokens",
            "8",
            "--eval-max-examples",
            "64",
            "--kto.optimizer.learning-rate",
            "5e-5",
        ]
    )
    assert summary["after"]["rewards/margins"] > summary["before"]["rewards/margins"] + 0.2, summary
    assert summary["after"]["win_rate"] > summary["before"]["win_rate"] + 0.2, summary


@pytest.mark.slow
def test_a_run_without_held_out_rows_trains_and_evaluates_nothing(base, tmp_path):
    train, _ = reverse.write_task_data(TASK, base / "no-eval", reverse.preference_records)
    summary = load_example("dpo").main(
        [
            "--model",
            str(base / "model"),
            "--data",
            train,
            "--eval-fraction",
            "0",
            "--run-dir",
            str(tmp_path),
            "--steps",
            "2",
            "--dpo.max-prompt-tokens",
            "16",
            "--dpo.max-completion-tokens",
            "8",
        ]
    )
    assert summary["before"] == {} and summary["after"] == {} and summary["steps"] == 2


@pytest.mark.slow  # LoRA's pieces (adapters-only training and checkpoints, the base as reference) have fast tests in test_lora.py  # noqa: E501
def test_lora_dpo_learns_against_the_base_and_resumes_exactly(base, tmp_path):
    """DPO with --lora.rank: only adapters train (the reference is the base, no copy); the export
    is the merged model plus a PEFT adapter that gives the same logits on the base; 4 steps
    straight equal 2 steps + --resume to 4 (checkpoints hold the adapters only)."""
    import numpy as np

    from relax.models.adapters.peft import load_adapter
    from relax.models.hf.checkpoint import load_pretrained

    args = [
        *data(base, reverse.preference_records, "pairs"),
        "--dpo.max-prompt-tokens",
        "16",
        "--dpo.max-completion-tokens",
        "8",
        "--eval-max-examples",
        "64",
        "--lora.rank",
        "8",
        "--dpo.optimizer.learning-rate",
        "1e-3",
        "--checkpoint-every",
        "2",
    ]
    summary = load_example("dpo").main(
        [*args, "--run-dir", str(tmp_path / "long"), "--steps", "40"]
    )
    assert (
        summary["after"]["preference_accuracy"] > summary["before"]["preference_accuracy"] + 0.5
    ), summary
    assert summary["after"]["win_rate"] > summary["before"]["win_rate"] + 0.2, summary
    final = tmp_path / "long" / "final_hf"
    ids = np.arange(1, 13, dtype=np.int32).reshape(2, 6)
    merged = load_pretrained(final)(ids)
    adapted = load_adapter(load_pretrained(base / "model"), final / "adapter")(ids)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(adapted), atol=2e-5)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    load_example("dpo").main([*args, "--run-dir", str(straight), "--steps", "4"])
    load_example("dpo").main([*args, "--run-dir", str(resumed), "--steps", "2"])
    load_example("dpo").main([*args, "--run-dir", str(resumed), "--steps", "4", "--resume"])
    a, b = train_lines(straight), train_lines(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and all(a[s] == b[s] for s in a)
