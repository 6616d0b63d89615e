"""relax.train.logs: metrics.jsonl, TensorBoard events, summary.json, progress bar, disabled loggers."""

import glob
import json
import math
import os
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from relax.train.logs import MetricsLogger, ProgressBar, is_main_process, write_summary


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
        log.log(
            0,
            {
                "reward": 0.5,
                "kl": jnp.float32(0.125),
                "length": np.int64(12),
                "loss": jnp.asarray([2.0]),
            },
        )
        log.log(
            1,
            {"reward": float("nan"), "kl": jnp.inf, "grad_norm": np.float16(1.5), "clipped": True},
        )
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
    path = write_summary(
        tmp_path,
        {
            "reward": np.float32(0.75),
            "kl": float("nan"),
            "steps": 10,
            "curve": jnp.arange(3.0),
            "name": "run",
            "nested": {"ok": True, "t": (1, 2)},
        },
    )
    assert path == os.path.join(tmp_path, "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "reward": 0.75,
        "kl": None,
        "steps": 10,
        "curve": [0.0, 1.0, 2.0],
        "name": "run",
        "nested": {"ok": True, "t": [1, 2]},
    }
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
    bar = ProgressBar(
        total=4, keys=("reward", ("tokens/s", "tok/s"), "kl"), enabled=True, mininterval=0
    )
    assert bar.postfix({"reward": jnp.float32(0.123456), "tokens/s": 12345.6, "loss": 1.0}) == {
        "reward": "0.1235",
        "tok/s": "1.235e+04",
    }
    bar.update(2, {"reward": 0.5, "kl": 0.01})
    bar.update(2)
    bar.close()
    err = capsys.readouterr().err
    assert "4/4" in err and "reward=0.5" in err and "kl=0.01" in err


# --- resuming a run: logs cut back to the checkpoint's step ------------------------------------


def _lines(path):
    return path.read_bytes().splitlines(keepends=True)


def _run(log, steps, offset=0.0):
    """Log training metrics at ``steps``, eval metrics at even steps, text at steps 2 and 5."""
    for step in steps:
        log.log(step, {"loss": step + offset, "reward": -step - offset})
        if step % 2 == 0:
            log.log(step, {"eval/reward": 10 * step + offset})
        if step in (2, 5):
            log.log_text("sample", f"step {step} run {offset}", step=step)


def _all_events(run_dir):
    """(file name, events) per event file of ``run_dir/tb``, in TensorBoard's (name) order."""
    files = sorted(glob.glob(os.path.join(run_dir, "tb", "*tfevents*")))
    return [(os.path.basename(f), _read_events(f)) for f in files]


def _purged_scalars(run_dir):
    """tag -> [(step, value)] as TensorBoard shows it, applying its purge rule independently.

    Files are read in name order; a ``SessionLog.START`` event at step ``p`` drops every event
    read so far with ``step >= p`` (TensorBoard's EventAccumulator, ``purge_orphaned_data``).
    """
    scalars = {}
    for _, events in _all_events(run_dir):
        for event in events:
            if (
                event.HasField("session_log")
                and event.session_log.status == event_pb2.SessionLog.START
            ):
                scalars = {
                    tag: [(s, v) for s, v in points if s < event.step]
                    for tag, points in scalars.items()
                }
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def _first_non_version_event(events):
    return next(e for e in events if not e.HasField("file_version"))


def test_resume_cuts_logs_back_to_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, enabled=True) as log:
        _run(log, range(1, 7))
        assert log.dropped == {"metrics.jsonl": 0, "text.jsonl": 0}
    first_metrics, first_text = _lines(tmp_path / "metrics.jsonl"), _lines(tmp_path / "text.jsonl")

    with MetricsLogger(tmp_path, enabled=True, resume_step=4) as log:
        # steps 5, 6 and the eval at 6 go from metrics.jsonl; the text at step 5 from text.jsonl
        assert log.dropped == {"metrics.jsonl": 3, "text.jsonl": 1}
        _run(log, range(5, 9), offset=0.5)

    metrics = _lines(tmp_path / "metrics.jsonl")
    records = [json.loads(line) for line in metrics]
    kinds = [(r["step"], "eval" if "eval/reward" in r else "train") for r in records]
    assert kinds == [
        (s, k) for s in range(1, 9) for k in ("train", "eval") if k == "train" or s % 2 == 0
    ]
    assert metrics[:6] == first_metrics[:6]  # steps 1-4 of the first run, byte for byte
    assert [r["loss"] for r in records if "loss" in r] == [1, 2, 3, 4, 5.5, 6.5, 7.5, 8.5]

    text = _lines(tmp_path / "text.jsonl")
    assert text[0] == first_text[0]
    assert [json.loads(line)["text"] for line in text] == ["step 2 run 0.0", "step 5 run 0.5"]

    # TensorBoard: a second, later-sorting event file that opens with START at step 5 ...
    (name1, events1), (name2, events2) = _all_events(tmp_path)
    start = _first_non_version_event(events2)
    assert start.session_log.status == event_pb2.SessionLog.START and start.step == 5
    assert not any(e.HasField("session_log") for e in events1)
    # ... without which steps 5 and 6 would show twice; with it each tag has each step once
    raw_steps = [
        e.step
        for _, evs in _all_events(tmp_path)
        for e in evs
        if any(v.tag == "loss" for v in e.summary.value)
    ]
    assert sorted(raw_steps) == [1, 2, 3, 4, 5, 5, 6, 6, 7, 8]
    scalars = _purged_scalars(tmp_path)
    assert scalars["loss"] == [(s, s + (0.5 if s > 4 else 0)) for s in range(1, 9)]
    assert scalars["reward"] == [(s, -s - (0.5 if s > 4 else 0)) for s in range(1, 9)]
    assert scalars["eval/reward"] == [(2, 20), (4, 40), (6, 60.5), (8, 80.5)]


def test_resume_drops_torn_last_line(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as log:
        _run(log, range(1, 7))
    kept = _lines(tmp_path / "metrics.jsonl")
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 7, "lo')  # killed mid-write
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=6) as log:
        assert log.dropped["metrics.jsonl"] == 1
        log.log(7, {"loss": 7.0})
    lines = _lines(tmp_path / "metrics.jsonl")
    assert lines[:-1] == kept and all(line.endswith(b"\n") for line in lines)
    assert [json.loads(line)["step"] for line in lines][-3:] == [6, 6, 7]


def test_resume_drops_lines_that_are_not_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [b'{"step":1,"a":1.0}\n', b'{"step":2,"a":2.0}\n']
    path.write_bytes(
        good[0]
        + b"not json\n"
        + b'{"a":1}\n'
        + b'{"step":"2"}\n'
        + b"[1]\n"
        + b"\n"
        + good[1]
        + b'{"step":3,"a":3.0}\n'
        + b'{"step":1,"late":1}\n'
    )
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=2) as log:
        assert log.dropped["metrics.jsonl"] == 6
    assert _lines(path) == good + [b'{"step":1,"late":1}\n']  # step <= 2 wherever it stands


def test_append_mode_cuts_only_a_torn_last_line(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as log:
        _run(log, range(1, 4))
    kept = _lines(tmp_path / "metrics.jsonl")
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 4, "lo')
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as log:
        assert log.dropped == {"metrics.jsonl": 1, "text.jsonl": 0}
        log.log(2, {"loss": 2.5})  # no resume_step: nothing is cut back, lines are appended
    lines = _lines(tmp_path / "metrics.jsonl")
    assert lines[:-1] == kept and [json.loads(x)["step"] for x in lines] == [1, 2, 2, 3, 2]


def test_resume_minus_one_empties_logs(tmp_path):
    with MetricsLogger(tmp_path, enabled=True) as log:
        _run(log, range(0, 3))
    with MetricsLogger(tmp_path, enabled=True, resume_step=-1) as log:
        assert log.dropped == {"metrics.jsonl": 5, "text.jsonl": 1}
        assert (tmp_path / "metrics.jsonl").read_bytes() == b""
        assert (tmp_path / "text.jsonl").read_bytes() == b""
        log.log(0, {"loss": 9.0})
    assert [json.loads(x)["loss"] for x in _lines(tmp_path / "metrics.jsonl")] == [9.0]
    start = _first_non_version_event(_all_events(tmp_path)[-1][1])
    assert start.session_log.status == event_pb2.SessionLog.START and start.step == 0
    assert _purged_scalars(tmp_path)["loss"] == [(0, 9.0)]


def test_resume_rewrite_is_crash_safe(tmp_path, monkeypatch):
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as log:
        _run(log, range(1, 5))
    os.chmod(tmp_path / "metrics.jsonl", 0o640)
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=3) as log:
        assert log.dropped == {"metrics.jsonl": 2, "text.jsonl": 0}
    assert os.stat(tmp_path / "metrics.jsonl").st_mode & 0o777 == 0o640  # rewrites keep the mode
    before = (tmp_path / "metrics.jsonl").read_bytes()
    inode = os.stat(tmp_path / "metrics.jsonl").st_ino
    # nothing to drop: the file is not rewritten
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=3) as log:
        assert log.dropped == {"metrics.jsonl": 0, "text.jsonl": 0}
    assert os.stat(tmp_path / "metrics.jsonl").st_ino == inode

    def killed(src, dst):
        raise KeyboardInterrupt  # stands in for a kill between the temp write and the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=2)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "text.jsonl"]


def test_event_files_never_collide_and_sort_in_order(tmp_path, monkeypatch):
    """tensorboardX names event files by the second: reopening within it must not truncate."""
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.25)
    with MetricsLogger(tmp_path, enabled=True) as log:
        _run(log, range(1, 5))
    with MetricsLogger(tmp_path, enabled=True) as log:  # plain reopen, same second
        log.log(5, {"loss": 5.0})
    with MetricsLogger(tmp_path, enabled=True, resume_step=3) as log:  # resume, same second
        _run(log, range(4, 7), offset=0.5)
    with MetricsLogger(tmp_path, enabled=True, resume_step=5) as log:  # and again
        log.log(6, {"loss": 6.75})
    files = _all_events(tmp_path)
    assert len(files) == 4
    starts = [[e.step for e in evs if e.HasField("session_log")] for _, evs in files]
    assert starts == [[], [], [4], [6]]  # name order == creation order
    assert _purged_scalars(tmp_path)["loss"] == [
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 4.5),
        (5, 5.5),
        (6, 6.75),
    ]
