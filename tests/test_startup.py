"""What a run says and does before it trains, on ragged data: prompts over the budget counted and
dropped (never cut in silence), one compiled step whatever bucket a batch's prompts need, and the
start-up report (printed, ``startup.txt``, ``config.json``) naming the longest rows."""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import load_example
from test_parallel import run_worker

from relax.models import ModelConfig, init
from relax.models.hf.checkpoint import save_pretrained
from relax.text import load_tokenizer
from relax.text.sentencepiece_model import Tokenizer, train_sentencepiece
from relax.train import fits

BUDGET = 40  # buckets 16, 32, 40


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    """A tiny model, a character tokenizer, and prompts of 3 to 38 tokens plus two over the budget."""
    d = tmp_path_factory.mktemp("ragged")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdef"), n)) for n in rng.integers(2, 37, size=40)]
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
        max_position_embeddings=128,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.bos_id,
        pad_token_id=tok.pad_id,
    )
    save_pretrained(init(cfg, jax.random.key(0), std=0.1), d / "model")
    words[7], words[19] = "abc" * 20, "fed" * 16  # over the budget
    rows = [{"prompt": w + "=", "answer": w[::-1]} for w in words]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    run_tok = load_tokenizer(tok_path)  # what --tokenizer loads
    lengths = [
        len(run_tok.encode(r["prompt"], add_special_tokens=True)) for r in rows
    ]  # the tokenizer's own count
    return d, lengths


def _run(ragged, run_dir, *extra):
    return load_example("grpo").main(_argv(ragged, run_dir, *extra))


def _argv(ragged, run_dir, *extra) -> list[str]:
    d, _ = ragged
    return [
        "--model",
        str(d / "model"),
        "--tokenizer",
        str(d / "tok.model"),
        "--data",
        str(d / "train.jsonl"),
        "--eval-data",
        str(d / "eval.jsonl"),
        "--run-dir",
        str(run_dir),
        "--steps",
        "4",
        "--batch-size",
        "4",
        "--max-prompt-tokens",
        str(BUDGET),
        "--grpo.num-generations",
        "2",
        "--grpo.max-new-tokens",
        "4",
        "--eval.num-samples",
        "1",
        "--reward-workers",
        "0",
        "--reward",
        "exact_match",
        "--checkpoint-every",
        "4",
        "--no-export-hf",
        *extra,
    ]


def _train_lines(run_dir):
    lines = [
        json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return [line for line in lines if "loss" in line]


@pytest.mark.slow
def test_ragged_data_compiles_once_and_over_budget_rows_are_counted_and_named(
    ragged, tmp_path, capsys
):
    d, lengths = ragged
    over = sorted(((n, i + 1) for i, n in enumerate(lengths) if n > BUDGET), reverse=True)
    kept = [n for n in lengths if n <= BUDGET]
    assert len(over) == 2 and min(kept) < 16 < 32 < max(kept)  # the data spans every bucket
    summary = _run(ragged, tmp_path / "run")
    lines = _train_lines(tmp_path / "run")
    # compiled before step 1 (relax.algorithms.online.ahead): the packed update has one layout
    # whatever the lengths
    assert len(lines) >= 3 and all(line["compiles"] == 0 for line in lines)
    assert all(line["prompts_over_budget"] == 2 for line in lines)
    assert summary["prompts_over_budget"] == 2
    assert summary["data"]["train"] | {"prompt_tokens": None} == {
        "rows": 40,
        "kept": 38,
        "prompts_over_budget": 2,
        "dropped": 2,
        "overlong": "drop",
        "max_prompt_tokens": BUDGET,
        "prompt_tokens": None,
    }
    assert summary["data"]["train"]["prompt_tokens"]["p50"] == int(
        np.percentile(lengths, 50, method="higher")
    )
    report = (tmp_path / "run" / "startup.txt").read_text()
    (n0, row0), (n1, row1) = over
    assert (
        f"2 of 40 training prompts are over --max-prompt-tokens {BUDGET}: {d / 'train.jsonl'} row {row0} "
        f"({n0} tokens), {d / 'train.jsonl'} row {row1} ({n1} tokens); dropped" in report
    )
    assert f"every batch padded to {BUDGET} prompt tokens" in report
    assert "completions packed across groups into bins of 2 x (prompt + budget) slots" in report
    assert "--max-prompt-tokens 40 (default 512)" in report and "stop tokens: " in report
    assert report.splitlines()[0] in capsys.readouterr().out  # printed too
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["max_prompt_tokens"] == BUDGET and config["overlong"] == "drop"


# each batch padded to its own bucket (the completions packed into bins: one layout per bucket)
PER_BATCH = ("--pad-to", "batch", "--overlong", "truncate")


@pytest.mark.slow
def test_padding_each_batch_to_its_own_bucket_compiles_again(ragged, tmp_path):
    """The contrast that makes the tests around it mean something: per-batch buckets recompile
    when a later batch meets a bucket (without the programs compiled ahead)."""
    _run(ragged, tmp_path / "run", *PER_BATCH, "--no-compile-ahead")
    lines = _train_lines(tmp_path / "run")
    assert sum(line["compiles"] for line in lines[1:]) > 0
    report = (tmp_path / "run" / "startup.txt").read_text()
    assert "cut to fit (--overlong truncate)" in report
    assert "== compiled ahead\n  off (--no-compile-ahead)" in report


DENSE_BINS = ("--grpo.packing.mode", "on", "--grpo.train-attention", "dense")


@pytest.mark.slow
@pytest.mark.parametrize("bins", [(), DENSE_BINS], ids=["block-sparse", "dense-mask"])
def test_every_bucket_is_compiled_before_the_first_step(ragged, tmp_path, bins):
    """The same run (its batches meet new buckets after step 1: the test above) with every
    program compiled at start-up, completions of varied lengths packed into bins (their
    attention the block-sparse loop, or one fused kernel per bin over its mask): not one
    compile in any step, and the start-up report names each program, its bucket and its
    seconds."""
    _run(ragged, tmp_path / "run", *PER_BATCH, *bins)
    lines = _train_lines(tmp_path / "run")
    assert [line["compiles"] for line in lines] == [0.0] * 4
    assert len({line["completion_length"] for line in lines}) > 1
    assert all(line["pack_bins"] >= 1 for line in lines)
    report = (tmp_path / "run" / "startup.txt").read_text()
    section = report[report.index("== compiled ahead") :].splitlines()
    assert re.fullmatch(
        r"  11 programs lowered and compiled in [\d.]+ s \(\d+ compile thread\(s\);.*", section[1]
    )
    for length in (16, 32, 40):  # the buckets of the kept prompts (3 to 40 tokens, cut to 40)
        for program in ("rollout", "reference", "advantage+update"):
            assert re.search(
                rf"^  {re.escape(program)} \[prompts {length}\]: [\d.]+ s{ALLOCATES}$", report, re.M
            )
    assert re.search(
        rf"^  eval sampled \[held-out, 3 prompts of 40\]: [\d.]+ s{ALLOCATES}$", report, re.M
    )


ALLOCATES = r", allocates [\d.]+ [MG]iB per device"


@pytest.mark.slow
def test_a_run_whose_programs_cannot_fit_stops_before_its_first_step(ragged, tmp_path, monkeypatch):
    """The same run on a device that has less free memory than its update allocates (its free
    memory reported as 1 KiB): it stops once its programs are compiled, before any step, naming
    the program and the flags that make it smaller; the start-up report is written first."""
    free = []

    def one_kib(devices):
        free.append(devices)
        return 1 << 10, "a device with 1 KiB free", len(devices)

    monkeypatch.setattr(fits, "free_bytes", lambda devices, memory_mb: one_kib(devices))
    with pytest.raises(fits.DoesNotFit) as e:
        _run(ragged, tmp_path / "run", *PER_BATCH)
    report = (tmp_path / "run" / "startup.txt").read_text()
    need = re.search(
        r"^  advantage\+update \[prompts 16\]: [\d.]+ s, allocates ([\d.]+ MiB)", report, re.M
    )
    assert need and float(need.group(1).split()[0]) > 0
    message = str(e.value)
    assert f"advantage+update [prompts 16] needs {need.group(1)} per device" in message
    assert "0.0 MiB are free (a device with 1 KiB free)" in message
    assert "--grpo.grad-accum N" in message and "relax plan grpo" in message
    assert free and all(d == [jax.devices()[0]] for d in free)  # the devices it runs on
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


MESH_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from conftest import load_example, use_compile_cache
use_compile_cache()
load_example("grpo").main(json.loads(sys.argv[1]))
"""


@pytest.mark.slow
def test_on_a_mesh_every_bucket_is_compiled_before_the_first_step(ragged, tmp_path):
    """The same run on a mesh of two devices (``relax.parallel.ShardedStep``, in a process of
    its own): its programs, and the placement of the host stages' arrays on the mesh, compiled
    before the first step."""
    script = tmp_path / "run.py"
    script.write_text(MESH_RUN.format(tests=str(Path(__file__).parent)))
    argv = _argv(ragged, tmp_path / "run", *PER_BATCH, "--parallel.mesh", "data=2")
    run_worker(script, [json.dumps(argv)], devices=2, timeout=600)
    assert [line["compiles"] for line in _train_lines(tmp_path / "run")] == [0.0] * 4


def test_overlong_reject_refuses_before_any_compute(ragged, tmp_path):
    d, lengths = ragged
    first = next(i + 1 for i, n in enumerate(lengths) if n > BUDGET)
    with pytest.raises(
        ValueError, match=rf"train\.jsonl: row {first}: prompt has {lengths[first - 1]} tokens"
    ):
        _run(ragged, tmp_path / "run", "--overlong", "reject")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_help_shows_both_sets_of_defaults(capsys):
    example = load_example("grpo")
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "The defaults below are those of the built-in task (no --model)" in out
    assert "--grpo.optimizer.learning-rate: 0.001 -> 1e-06" in out
    assert "--grpo.max-new-tokens: 8 -> 128" in out


def test_steps_0_and_one_generation_are_not_silent(ragged, tmp_path, capsys):
    example = load_example("grpo")
    with pytest.raises(SystemExit):
        example.parse_args(["--steps", "0"])
    assert "--steps 0 trains nothing" in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert example.parse_args(["--steps", "0", "--eval-only"]).steps == 0
    with pytest.warns(UserWarning, match="num_generations=1: the 'grpo' advantage is relative"):
        example.parse_args(["--grpo.num-generations", "1"])


def test_missing_reward_column_is_found_before_any_compute(ragged, tmp_path):
    """code_exec reads each row's tests: a row without them stops the run at load, naming it."""
    with pytest.raises(KeyError, match=r"train\.jsonl.*row 1.*'tests'"):
        _run(ragged, tmp_path / "run", "--reward", "code_exec")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_data_with_no_prompt_within_the_budget_is_refused_naming_the_rows(ragged, tmp_path):
    d, lengths = ragged
    with pytest.raises(
        ValueError,
        match=r"no training prompt is within --max-prompt-tokens 2: WARNING: 40 of 40 "
        r"training prompts are over --max-prompt-tokens 2: .*train\.jsonl row",
    ):
        _run(ragged, tmp_path / "run", "--max-prompt-tokens", "2")
