"""relax.logging: metrics.jsonl, TensorBoard events, summary.json, progress bar, disabled loggers."""

import glob
import json
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from relax.logging import MetricsLogger, ProgressBar, is_main_process, write_summary


def _read_events(path):
    """Events from a TFRecord file: [len u64][crc u32][data][crc u32] per record."""
    events = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length)
            f.read(4)
            events.append(event_pb2.Event.FromString(data))
    return events


def _tb_scalars(run_dir):
    files = glob.glob(os.path.join(run_dir, "tb", "events.out.tfevents.*"))
    assert len(files) == 1 and os.path.getsize(files[0]) > 0
    scalars = {}
    for event in _read_events(files[0]):
        for value in event.summary.value:
            if value.WhichOneof("value") == "simple_value":
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_metrics_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, enabled=True) as log:
        log.log(0, {"reward": 0.5, "kl": jnp.float32(0.125), "length": np.int64(12),
                    "loss": jnp.asarray([2.0])})
        log.log(1, {"reward": float("nan"), "kl": jnp.inf, "grad_norm": np.float16(1.5),
                    "clipped": True})
        log.log_text("sample", "2 + 2 = 4", step=1)

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {"step", "time", "reward", "kl", "length", "loss"}
    assert first["step"] == 0 and first["reward"] == 0.5 and first["kl"] == 0.125
    assert first["length"] == 12.0 and first["loss"] == 2.0
    assert all(isinstance(first[k], float) for k in ("reward", "kl", "length", "loss"))
    assert abs(first["time"] - second["time"]) < 60 and second["time"] >= first["time"]
    # non-finite values are JSON null, and the file is strict JSON
    assert second["reward"] is None and second["kl"] is None
    assert second["grad_norm"] == 1.5 and second["clipped"] == 1.0
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()

    text = [json.loads(line) for line in (tmp_path / "text.jsonl").read_text().splitlines()]
    assert text == [{"step": 1, "time": text[0]["time"], "tag": "sample", "text": "2 + 2 = 4"}]

    scalars = _tb_scalars(tmp_path)
    assert scalars["reward"][0] == (0, 0.5) and scalars["reward"][1][0] == 1
    assert math.isnan(scalars["reward"][1][1])
    assert scalars["kl"] == [(0, 0.125), (1, math.inf)]
    assert scalars["length"] == [(0, 12.0)]


def test_appends_and_flushes_per_call(tmp_path):
    log = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    log.log(5, {"a": 1.0})
    # flush_every=1: the line is on disk before close
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["a"] == 1.0
    log.close()
    log.close()  # idempotent
    log.log(6, {"a": 2.0})  # after close: a no-op
    assert not (tmp_path / "tb").exists()
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False, flush_every=10) as log:
        log.log(7, {"a": 3.0})
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 7]


def test_bad_metrics_rejected(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log(0, {"step": 1.0})
        with pytest.raises(TypeError, match="'vec'"):
            log.log(0, {"vec": np.zeros(3)})
        with pytest.raises(TypeError, match="'name'"):
            log.log(0, {"name": "abc"})


def test_disabled_logger_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, enabled=False) as log:
        log.log(0, {"reward": 1.0})
        log.log_text("t", "x", step=0)
        log.flush()
    assert not run_dir.exists()
    assert write_summary(run_dir, {"a": 1}, enabled=False) is None
    assert not run_dir.exists()
    with ProgressBar(total=3, enabled=False) as bar:
        bar.update(1, {"reward": 1.0})
        bar.write("hidden")


def test_main_process_default(tmp_path):
    assert is_main_process()  # a single-process test run is process 0
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        assert log.enabled


def test_write_summary_atomic(tmp_path):
    path = write_summary(tmp_path, {"reward": np.float32(0.75), "kl": float("nan"),
                                    "steps": 10, "curve": jnp.arange(3.0), "name": "run",
                                    "nested": {"ok": True, "t": (1, 2)}})
    assert path == os.path.join(tmp_path, "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "reward": 0.75, "kl": None, "steps": 10, "curve": [0.0, 1.0, 2.0], "name": "run",
        "nested": {"ok": True, "t": [1, 2]}}
    # overwriting replaces the file whole and leaves no temporary files behind
    write_summary(tmp_path, {"reward": 1.0})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"reward": 1.0}
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_write_summary_failure_keeps_previous(tmp_path, monkeypatch):
    write_summary(tmp_path, {"v": 1})

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_summary(tmp_path, {"v": 2})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"v": 1}
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_progress_bar_postfix(capsys):
    bar = ProgressBar(total=4, keys=("reward", ("tokens/s", "tok/s"), "kl"), enabled=True,
                      mininterval=0)
    assert bar.postfix({"reward": jnp.float32(0.123456), "tokens/s": 12345.6, "loss": 1.0}) == {
        "reward": "0.1235", "tok/s": "1.235e+04"}
    bar.update(2, {"reward": 0.5, "kl": 0.01})
    bar.update(2)
    bar.close()
    err = capsys.readouterr().err
    assert "4/4" in err and "reward=0.5" in err and "kl=0.01" in err
