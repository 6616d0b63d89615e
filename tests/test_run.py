"""The run loop end to end on a tiny "real" setup (HF directory, sentencepiece file, jsonl data):
CLI flags, exact resume, eval-only, artifacts, and bad-input errors."""

import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from relax.models import ModelConfig, init
from relax.models.hf import save_pretrained
from relax.rewards.functions import RewardError
from relax.tokenizer import Tokenizer, train_sentencepiece
from relax.train.grpo import make_score

ROOT = Path(__file__).resolve().parents[1]


def _load_example():
    spec = importlib.util.spec_from_file_location("train_grpo", ROOT / "examples" / "train_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdef"), rng.integers(2, 5))) for _ in range(64)]
    tok_path = train_sentencepiece([w + "=" for w in words], d / "tok", vocab_size=12, model_type="char")
    tok = Tokenizer(tok_path)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=64, eos_token_id=tok.eos_id,
                      bos_token_id=tok.bos_id, pad_token_id=tok.pad_id)
    save_pretrained(init(cfg, jax.random.key(0), std=0.1), d / "model")
    rows = [{"prompt": w + "=", "answer": w[::-1], "data_source": f"len{len(w)}"} for w in words]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:48]))
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[48:]))
    return d


def _args(setup, run_dir, steps, *extra):
    return ["--model", str(setup / "model"), "--tokenizer", str(setup / "tok.model"),
            "--data", str(setup / "train.jsonl"), "--eval-data", str(setup / "eval.jsonl"),
            "--run-dir", str(run_dir), "--steps", str(steps), "--batch-size", "4", "--max-prompt-tokens", "16",
            "--grpo.num-generations", "4", "--grpo.max-new-tokens", "5", "--grpo.beta", "0.04",
            "--grpo.optimizer.learning-rate", "1e-2", "--checkpoint-every", "2", "--eval.num-samples", "2",
            "--preset", "grpo", *extra]


def _train_lines(run_dir):
    lines = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    out = {}
    for l in lines:
        if "loss" in l:  # training lines (evaluation lines carry eval/ keys only)
            out[l["step"]] = {k: v for k, v in l.items() if k != "time" and not k.startswith("time/")
                              and k != "tokens_per_s"}
    return out


def test_resume_is_bit_exact_and_artifacts_exist(setup, tmp_path):
    example = _load_example()
    straight = tmp_path / "straight"
    summary = example.main(_args(setup, straight, 4))
    assert set(summary) >= {"before", "after", "steps", "export"}
    assert (straight / "summary.json").exists() and (straight / "metrics.jsonl").exists()
    assert list((straight / "tb").glob("events.out.tfevents.*"))
    assert (straight / "final_hf" / "config.json").exists() and (straight / "final_hf" / "tokenizer.model").exists()
    assert sorted(p.name for p in (straight / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    assert "pass@1" in summary["after"] and "len2/pass@1" in summary["after"]

    resumed = tmp_path / "resumed"
    example.main(_args(setup, resumed, 2))
    example.main(_args(setup, resumed, 4, "--resume"))
    a, b = _train_lines(straight), _train_lines(resumed)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert a[step] == b[step], step  # bit for bit: JSON floats round-trip exactly

    only = example.main(_args(setup, resumed, 4, "--resume", "--eval-only"))
    assert only["step"] == 4 and "pass@1" in only["eval_only"]


def test_bad_run_config_names_the_flag(setup, capsys):
    example = _load_example()
    with pytest.raises(SystemExit):  # tyro prints the config's error and exits with status 2
        example.main(["--model", str(setup / "model")])
    assert "--model needs --tokenizer and --data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.main(_args(setup, setup / "x", 1, "--reward", "exact_match", "--reward-weights", "1", "2"))
    assert "reward-weights" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        example.main(_args(setup, setup / "x", 1)[:-2] + ["--preset", "nope"])


def test_preset_flag_sets_algorithm_defaults_in_both_modes(setup):
    """--preset picks the algorithm with and without --model; explicit --grpo.* flags still win."""
    example = _load_example()
    builtin = example.parse_args(["--preset", "dapo"])
    assert builtin.preset == "dapo"
    assert (builtin.grpo.loss_type, builtin.grpo.epsilon_high, builtin.grpo.beta) == ("dapo", 0.28, 0.0)
    assert builtin.grpo.zero_std_groups == "drop" and builtin.grpo.mask_truncated_completions
    assert builtin.grpo.max_new_tokens == 8  # the built-in task's size stays
    assert example.parse_args([]).grpo.loss_type == "grpo"
    real = example.parse_args(_args(setup, setup / "x", 1)[:-2] + ["--preset=gspo", "--grpo.epsilon-high", "5e-4"])
    assert (real.grpo.importance_sampling_level, real.grpo.epsilon_low, real.grpo.epsilon_high) == (
        "sequence", 3e-4, 5e-4)


def test_missing_data_field_names_file_row_field(setup, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ab=", "answer": "ba"}) + "\n" + json.dumps({"prompt": "cd="}) + "\n")
    example = _load_example()
    args = _args(setup, tmp_path / "r", 1)
    args[args.index("--data") + 1] = str(bad)
    with pytest.raises(KeyError, match=r"bad\.jsonl.*row 2.*answer"):
        example.main(args)


def test_raising_reward_function_names_function_and_sample():
    def broken(prompts, completions, **fields):
        return [1.0 / (len(c) - 3) for c in completions]  # ZeroDivisionError on 3-token completions

    stage = make_score([broken], lambda t, m: [" ".join(map(str, r[m > 0])) for r, m in zip(t, m)])
    tokens = np.array([[[1, 2, 3], [1, 2, 3]]])
    mask = np.array([[[1, 1, 0], [1, 0, 0]]])
    batch = {"tokens": tokens, "mask": mask, "prompts": ["q"], "fields": {}}
    with pytest.raises(RewardError, match="broken"):
        stage(None, batch)
