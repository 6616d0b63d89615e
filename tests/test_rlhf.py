"""The three-stage RLHF pipeline (``examples/rlhf.py``, ``relax.algorithms.rlhf.run``): stages chained
through their exports, every stage's held-out figures in one summary, the pipeline's own flags
refused on a stage, and (slow) the no-argument run where each stage's figure rises."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_TASK = [
    "--sft.reverse.num-train",
    "64",
    "--sft.reverse.num-eval",
    "8",
    "--sft.reverse.hidden-size",
    "16",
    "--sft.reverse.num-layers",
    "1",
    "--sft.reverse.sft-steps",
    "2",
    "--sft.reverse.sft-batch",
    "8",
]


def rlhf_main():
    spec = importlib.util.spec_from_file_location("rlhf_example", ROOT / "examples" / "rlhf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def tiny(run_dir: Path) -> list[str]:
    """Two steps a stage on a tiny reverse task, each stage's checkpoints every 2 steps."""
    flags = ["--run-dir", str(run_dir), *TINY_TASK]
    for stage in ("sft", "reward-model", "ppo"):
        flags += [
            f"--{stage}.steps",
            "2",
            f"--{stage}.batch-size",
            "4",
            f"--{stage}.checkpoint-every",
            "2",
            f"--{stage}.eval-every",
            "0",
        ]
    return flags + [
        "--reward-model.max-prompt-tokens",
        "8",
        "--reward-model.max-completion-tokens",
        "8",
    ]


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory):
    """The pipeline on the built-in task, tiny: ``(run dir, summary)``."""
    root = tmp_path_factory.mktemp("rlhf") / "run"
    return root, rlhf_main()(tiny(root))


@pytest.mark.slow
def test_the_stages_are_chained_and_the_summary_has_every_stage(builtin_run):
    root, summary = builtin_run
    assert [s["stage"] for s in summary["stages"]] == ["sft", "reward_model", "ppo"]
    assert json.loads((root / "summary.json").read_text()) == summary
    config = {
        name: json.loads((root / name / "config.json").read_text())
        for name in ("sft", "reward_model", "ppo")
    }
    assert config["sft"]["model"] is None  # the built-in task's base model
    assert (
        config["reward_model"]["model"] == config["ppo"]["model"] == str(root / "sft" / "final_hf")
    )
    assert config["ppo"]["reward_model"] == str(root / "reward_model" / "final_hf")
    assert config["ppo"]["reward"] == []  # the reward model is the only reward
    assert config["reward_model"]["data"] == str(root / "data" / "preferences.jsonl")
    assert config["ppo"]["eval_data"] == str(root / "data" / "prompts.eval.jsonl")
    rm = json.loads((root / "reward_model" / "final_hf" / "config.json").read_text())
    assert rm["architectures"][0].endswith("ForSequenceClassification")
    metrics = {s["stage"]: [f["metric"] for f in s["figures"]] for s in summary["stages"]}
    assert metrics == {
        "sft": ["greedy/accuracy", "log_likelihood"],
        "reward_model": ["pair_accuracy"],
        "ppo": ["greedy/reward", "reward", "verifier/accuracy"],
    }
    for stage in summary["stages"]:
        assert stage["export"] == str(root / stage["stage"] / "final_hf")
        for f in stage["figures"]:
            assert (
                f["better"] == "higher"
                and isinstance(f["before"], float)
                and isinstance(f["after"], float)
            )
    sft = {f["metric"]: f for f in summary["stages"][0]["figures"]}
    stage1 = json.loads((root / "sft" / "summary.json").read_text())
    assert sft["log_likelihood"]["before"] == -stage1["before"]["nll"]
    ppo = {f["metric"]: f for f in summary["stages"][2]["figures"]}
    # stage 3 starts from stage 1's export: the verifier's "before" is SFT's "after" (same prompts, greedy)
    assert ppo["verifier/accuracy"]["before"] == sft["greedy/accuracy"]["after"]


@pytest.mark.slow
def test_user_data_with_grpo(builtin_run, tmp_path):
    """--model DIR --data DIR (its three files and their held-out files) with --algorithm grpo: the
    real-model defaults, shrunk by flags; the same chaining and summary."""
    from relax.algorithms.rlhf.run import builtin_pairs
    from relax.tasks import reverse
    from relax.tasks.base import write_jsonl

    task = reverse.ReverseTask(num_train=64, num_eval=8)
    data = tmp_path / "data"
    for rows, suffix in zip(reverse.make_splits(task), (".jsonl", ".eval.jsonl")):
        write_jsonl(reverse.sft_records(rows), data / f"sft{suffix}")
        write_jsonl(builtin_pairs(task, rows, seed=0), data / f"preferences{suffix}")
        write_jsonl(rows, data / f"prompts{suffix}")
    root = tmp_path / "run"
    flags = [
        "--model",
        str(builtin_run[0] / "sft" / "base_model"),
        "--data",
        str(data),
        "--run-dir",
        str(root),
        "--algorithm",
        "grpo",
        "--sft.sft.max-length",
        "32",
        "--sft.eval-max-new-tokens",
        "8",
        "--reward-model.max-prompt-tokens",
        "8",
        "--reward-model.max-completion-tokens",
        "8",
        "--grpo.max-prompt-tokens",
        "16",
        "--grpo.grpo.max-new-tokens",
        "8",
        "--grpo.grpo.num-generations",
        "2",
    ]
    for stage in ("sft", "reward-model", "grpo"):
        flags += [
            f"--{stage}.steps",
            "2",
            f"--{stage}.batch-size",
            "4",
            f"--{stage}.checkpoint-every",
            "2",
        ]
    summary = rlhf_main()(flags)
    assert [s["stage"] for s in summary["stages"]] == ["sft", "reward_model", "grpo"]
    config = {
        name: json.loads((root / name / "config.json").read_text())
        for name in ("sft", "reward_model", "grpo")
    }
    assert config["sft"]["model"] == flags[1] and config["sft"]["data"] == str(data / "sft.jsonl")
    assert config["sft"]["eval_data"] == str(data / "sft.eval.jsonl")
    assert (
        config["reward_model"]["model"] == config["grpo"]["model"] == str(root / "sft" / "final_hf")
    )
    assert config["grpo"]["reward_model"] == str(root / "reward_model" / "final_hf")
    assert config["grpo"]["eval_data"] == str(data / "prompts.eval.jsonl")
    assert config["reward_model"]["max_prompt_tokens"] == 8 and config["grpo"]["reward"] == []
    assert [f["metric"] for f in summary["stages"][2]["figures"]] == [
        "greedy/reward",
        "reward",
        "verifier/accuracy",
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--reward-model.eval-data", "x"], "--reward-model.eval-data is set by the RLHF pipeline"),
        (["--ppo.reward-model", "x"], "--ppo.reward-model is set by the RLHF pipeline"),
        (["--sft.run-dir", "x"], "--sft.run-dir is set by the RLHF pipeline"),
        (["--ppo.reverse.num-train", "10"], "--sft.reverse"),
        (["--algorithm", "grpo", "--grpo.data", "x"], "--grpo.data is set by the RLHF pipeline"),
        (["--sft.parallel.mesh", "fsdp=2"], "--sft.parallel is set by the RLHF pipeline"),
    ],
)
def test_the_flags_the_pipeline_sets_are_refused_on_a_stage(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        rlhf_main()(["--run-dir", str(tmp_path), *flags])
    assert not (tmp_path / "sft").exists()  # refused before any stage ran


def test_user_data_needs_model_and_every_file(tmp_path, capsys):
    with pytest.raises(SystemExit):  # tyro's usage error
        rlhf_main()(["--run-dir", str(tmp_path), "--model", "m"])
    assert "--model and --data go together" in capsys.readouterr().err
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(FileNotFoundError, match="has no preferences.jsonl"):
        rlhf_main()(
            ["--run-dir", str(tmp_path / "run"), "--model", "m", "--data", str(tmp_path / "data")]
        )


@pytest.mark.slow
def test_a_failing_stage_is_named(tmp_path):
    with pytest.raises(Exception) as info:
        rlhf_main()([*tiny(tmp_path), "--sft.no-export-hf"])
    assert "RLHF stage 1/3 (sft) failed" in "\n".join(getattr(info.value, "__notes__", []))
    assert "no exported model" in str(info.value)


@pytest.mark.slow  # about 4 minutes on 2 CPU cores
def test_the_no_argument_run_raises_every_stage_figure(tmp_path):
    """``python examples/rlhf.py``, nothing else: each stage's held-out figures rise by more than noise
    (200 held-out rows: 0.1 of an accuracy is 20 rows), stage 3's by the verifier too."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rlhf.py")],
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((tmp_path / "runs" / "rlhf-reverse" / "summary.json").read_text())
    figures = {(s["stage"], f["metric"]): f for s in summary["stages"] for f in s["figures"]}
    margins = {
        ("sft", "greedy/accuracy"): 0.2,
        ("sft", "log_likelihood"): 0.05,
        ("reward_model", "pair_accuracy"): 0.2,
        ("ppo", "greedy/reward"): 1.0,
        ("ppo", "reward"): 1.0,
        ("ppo", "verifier/accuracy"): 0.1,
    }
    assert set(figures) == set(margins)
    for key, margin in margins.items():
        assert figures[key]["after"] > figures[key]["before"] + margin, (key, figures[key])
    assert "RLHF (runs/rlhf-reverse): held-out figures" in done.stdout
