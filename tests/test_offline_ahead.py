"""The offline trainers' step compiled before the first step (``relax.algorithms.offline.ahead``):
no compile in any step, the start-up report listing the program with what it allocates, and a
run whose program cannot fit its device's free memory stopped before its first step, naming the
trainer's own flags."""

import json
import re
from pathlib import Path

import jax
import pytest
from conftest import load_example

from relax.algorithms.offline.ahead import offline_hint
from relax.train import fits

SMALL = ["--steps", "2", "--eval-max-examples", "0"]  # nothing held out: no evaluation


def _compiles(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["compiles"] for line in lines if '"compiles"' in line]


@pytest.mark.slow
def test_sft_compiles_nothing_in_its_steps_and_reports_its_program(tmp_path):
    load_example("sft").main([*SMALL, "--run-dir", str(tmp_path / "ahead")])
    assert _compiles(tmp_path / "ahead") == [0.0, 0.0]
    report = (tmp_path / "ahead" / "startup.txt").read_text()
    section = report[report.index("== compiled ahead") :].splitlines()
    assert re.fullmatch(r"  1 programs lowered and compiled in [\d.]+ s .*", section[1])
    assert re.fullmatch(
        r"  update \[a training batch\]: [\d.]+ s, allocates [\d.]+ MiB per device", section[2]
    )
    assert len(section) == 3  # nothing held out: no evaluation to compile later
    # the contrast: compiled when first called, the first step compiles
    load_example("sft").main([*SMALL, "--no-compile-ahead", "--run-dir", str(tmp_path / "off")])
    assert _compiles(tmp_path / "off")[0] >= 1


@pytest.mark.slow
def test_a_reward_model_whose_update_cannot_fit_stops_before_its_first_step(tmp_path, monkeypatch):
    monkeypatch.setattr(
        fits, "free_bytes", lambda devices, memory_mb: (1 << 10, "1 KiB free", len(devices))
    )
    with pytest.raises(fits.DoesNotFit) as e:
        load_example("reward_model").main([*SMALL, "--run-dir", str(tmp_path / "run")])
    report = (tmp_path / "run" / "startup.txt").read_text()
    need = re.search(
        r"^  (\S+) \[a training batch\]: [\d.]+ s, allocates ([\d.]+ MiB)", report, re.M
    )
    assert need
    message = str(e.value)
    assert f"{need.group(1)} [a training batch] needs {need.group(2)} per device" in message
    assert "--reward-model.grad-accum N" in message and "relax plan rm --target" in message
    assert "fewer rows (--batch-size)" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran
    assert jax.device_count() == 1


def test_each_offline_trainer_s_hint_names_its_own_flags():
    assert "--dpo.grad-accum N" in offline_hint("orpo") and "relax plan orpo" in offline_hint(
        "orpo"
    )
    assert "--kto.remat" in offline_hint("kto") and "relax plan kto" in offline_hint("kto")
    assert "--distill.grad-accum N" in offline_hint("distill")
