"""Multi-host runs on one machine: two CPU processes (2 devices each) joined by
``relax.parallel.distributed.initialize`` over a loopback coordinator run one GRPO iteration on the global
``fsdp=2,tensor=2`` mesh (parameters sharded ACROSS the processes, gloo collectives), each
feeding its own half of the prompts; over three iterations (the KL term on, Adam's default eps)
their metrics and tokens must match a single-process run of the same global batch. Both processes
also save and restore a checkpoint collectively.
SFT from its command line on the same two-process mesh logs what one device logs, and GRPO with
partial rollouts (stopped and resumed mid-way) samples and logs what one device does.
Plus the failure modes: an unreachable coordinator, a missing peer, incomplete settings.
Every subprocess has a bounded timeout; nothing can hang the suite.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import test_parallel as tp  # noqa: E402  (the shared GRPO case and worker helpers)

TIMEOUT_S = 150
GLOBAL_MESH = "fsdp=2,tensor=2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_worker(pid: int, n: int, port: int, out: str, ckpt: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    tp.use_compile_cache()
    from relax.parallel import distributed
    from relax.train.logs import is_main_process

    distributed.initialize(f"127.0.0.1:{port}", n, pid, timeout_s=60)
    assert (
        jax.process_count() == n and jax.device_count() == 2 * n and jax.local_device_count() == 2
    )
    rows = tp.PROMPTS // n
    result = tp.run_case(GLOBAL_MESH, rows=slice(pid * rows, (pid + 1) * rows), checkpoint_dir=ckpt)
    result.update(process_index=jax.process_index(), main=is_main_process())
    Path(out).write_text(json.dumps(result))


def sft_worker(run_dir: str, root: str, *flags: str) -> None:
    """``relax sft`` on a random model and the reverse task's rows, two steps, with ``flags``
    (the parallel ones); jax's CPU device count from ``RELAX_TEST_CPU_DEVICES``."""
    import os

    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ.get("RELAX_TEST_CPU_DEVICES", "1")))
    tp.use_compile_cache()
    from conftest import load_example

    data = Path(root) / "sft"
    load_example("sft").main(
        [
            *("--model", str(Path(root) / "model"), "--data", str(data / "train.jsonl")),
            *("--eval-data", str(data / "eval.jsonl"), "--eval-max-examples", "4"),
            *("--steps", "2", "--batch-size", "8", "--sft.max-length", "32"),
            *("--run-dir", run_dir, *flags),
        ]
    )


def single_worker(out: str) -> None:
    tp.use_compile_cache()
    Path(out).write_text(json.dumps(tp.run_case(None)))


def partial_worker(pid: int, n: int, port: int, out: str) -> None:
    """``test_partial_rollout.grpo_case`` (GRPO with partial rollouts, stopped and resumed
    mid-way) as process ``pid`` of ``n`` on the global mesh, feeding its rows of the prompts;
    ``n = 1``: one process, one device."""
    import jax

    jax.config.update("jax_num_cpu_devices", 2 if n > 1 else 1)
    tp.use_compile_cache()
    from relax.parallel import distributed

    if n > 1:
        distributed.initialize(f"127.0.0.1:{port}", n, pid, timeout_s=60)
    import test_partial_rollout as tpr

    if n == 1:
        result = tpr.grpo_case()
    else:
        rows = slice(pid * tp.PROMPTS // n, (pid + 1) * tp.PROMPTS // n)
        result = tpr.grpo_case(GLOBAL_MESH, rows=rows, resume_at=tpr.RESUME_AT)
    Path(out).write_text(json.dumps(result))


if __name__ != "__main__":
    import numpy as np
    import pytest

    from relax.parallel import distributed

    def _spawn(args, devices=1, env=None):
        env = {**tp.worker_env(devices), **(env or {})}
        return subprocess.Popen(
            [sys.executable, str(HERE), *args],
            env=env,
            cwd=tp.ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def _finish(procs, timeout):
        outputs, deadline = [], time.monotonic() + timeout
        try:
            for p in procs:
                out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
                outputs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return outputs

    def test_two_processes_match_a_single_process_run(tmp_path):
        port = free_port()
        files = [tmp_path / f"proc{i}.json" for i in range(2)]
        procs = [
            _spawn(["process", str(i), "2", str(port), str(files[i]), str(tmp_path / "ckpt")])
            for i in range(2)
        ]
        procs.append(_spawn(["single", str(tmp_path / "single.json")]))
        outputs = _finish(procs, TIMEOUT_S)
        for p, out in zip(procs, outputs):
            assert p.returncode == 0, out[-6000:]
        parts = [json.loads(f.read_text()) for f in files]
        single = json.loads((tmp_path / "single.json").read_text())
        assert [p["process_index"] for p in parts] == [0, 1] and [p["main"] for p in parts] == [
            True,
            False,
        ]
        # each process sampled its own half of the prompts; together they are the global batch
        for i in range(tp.ITERATIONS):
            assert parts[0]["tokens"][i] + parts[1]["tokens"][i] == single["tokens"][i], i
            for part in parts:  # metrics are global (replicated): the same on both processes
                for k, want in single["metrics"][i].items():
                    np.testing.assert_allclose(
                        part["metrics"][i][k],
                        want,
                        rtol=tp.RTOL,
                        atol=tp.ATOL,
                        err_msg=f"iteration {i}: {k}",
                    )
        for part in parts:
            assert (
                part["checkpoint_roundtrip"]
                and part["restored_sharding"] == "P(None, 'fsdp', 'tensor')"
            )

    def _sft_setup(root: Path) -> None:
        """A random model with the reverse task's tokenizer, and SFT rows of the task."""
        import jax

        from relax.models import ModelConfig, init
        from relax.models.hf.checkpoint import save_pretrained
        from relax.tasks import reverse

        task = reverse.ReverseTask(num_train=64, num_eval=8)
        tokenizer = reverse.build_tokenizer(task, root)
        plain = {"vocab_size": tokenizer.vocab_size, "qkv_bias": False, "qk_norm": False}  # llama's
        config = ModelConfig(**{**tp.MODEL, **plain})
        save_pretrained(init(config, jax.random.key(0), std=0.1), root / "model")
        tokenizer.save_pretrained(root / "model")
        reverse.write_task_data(task, root / "sft", reverse.sft_records)

    @pytest.mark.slow  # three short runs in subprocesses
    def test_sft_on_two_processes_logs_what_one_device_logs(tmp_path):
        """``relax sft`` on the global ``fsdp=2,tensor=2`` mesh of two processes (each collating
        its half of a step's rows) logs the training and held-out metrics of a one-device run."""
        _sft_setup(tmp_path)
        port = free_port()
        flags = ["--parallel.mesh", GLOBAL_MESH, "--parallel.coordinator", f"127.0.0.1:{port}"]
        procs = [
            _spawn(
                [
                    "sft",
                    str(tmp_path / "two"),
                    str(tmp_path),
                    *flags,
                    "--parallel.num-processes",
                    "2",
                    "--parallel.process-id",
                    str(i),
                ],
                env={"RELAX_TEST_CPU_DEVICES": "2"},
            )
            for i in range(2)
        ]
        procs.append(_spawn(["sft", str(tmp_path / "one"), str(tmp_path)]))
        outputs = _finish(procs, 2 * TIMEOUT_S)
        for p, out in zip(procs, outputs):
            assert p.returncode == 0, out[-6000:]
        assert "2 process(es)" in outputs[0]
        lines = {
            run: [
                json.loads(l) for l in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
            ]
            for run in ("one", "two")
        }
        assert len(lines["one"]) == len(lines["two"]) >= 4  # evals before and after, 2 steps
        for want, got in zip(lines["one"], lines["two"]):
            assert want["step"] == got["step"]
            for k, v in want.items():
                if k.startswith("time") or k in ("tokens_per_s", "compiles", "step"):
                    continue
                if isinstance(v, int | float):
                    np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=2e-5, err_msg=k)

    @pytest.mark.slow  # three pipelined runs in subprocesses
    def test_partial_rollouts_on_two_processes_match_one_device(tmp_path):
        """GRPO with partial rollouts (``--async.partial 2``) on the global ``fsdp=2,tensor=2``
        mesh, each process feeding its half of the prompts, stopped after 2 updates and resumed
        from the data state: both processes hold the same batches in progress (process 0 writes
        them to checkpoints), and together they sample the tokens of a one-device run and log its
        metrics to rounding."""
        import test_partial_rollout as tpr

        port = free_port()
        files = [tmp_path / f"proc{i}.json" for i in range(3)]
        procs = [_spawn(["partial", str(i), "2", str(port), str(files[i])]) for i in range(2)]
        procs.append(_spawn(["partial", "0", "1", "0", str(files[2])]))
        outputs = _finish(procs, 2 * TIMEOUT_S)
        for p, out in zip(procs, outputs):
            assert p.returncode == 0, out[-6000:]
        first, second, single = (json.loads(f.read_text()) for f in files)
        assert first["data_state"] == second["data_state"] and first["data_state"]["in_progress"]
        assert first["metrics"] == second["metrics"]  # global (replicated) values
        tokens = [a + b for a, b in zip(first["tokens"], second["tokens"])]
        tpr.assert_same_updates({**first, "tokens": tokens}, single, "two processes")

    def test_unreachable_coordinator_fails_after_the_timeout_naming_it():
        port = free_port()  # nothing listens there
        t0 = time.monotonic()
        with pytest.raises(
            distributed.CoordinatorError,
            match=rf"process 1: cannot reach the jax.distributed "
            rf"coordinator at 127.0.0.1:{port} within 2s",
        ):
            distributed.initialize(f"127.0.0.1:{port}", 2, 1, timeout_s=2)
        assert time.monotonic() - t0 < 10

    @pytest.mark.slow  # the timeout path is tested fast by the unreachable-coordinator case
    def test_missing_peer_ends_the_coordinator_process_instead_of_hanging(tmp_path):
        proc = _spawn(["alone", str(free_port())])
        t0 = time.monotonic()
        (out,) = _finish([proc], 90)
        assert proc.returncode != 0, out[-3000:]
        assert time.monotonic() - t0 < 90
        assert (
            "relax: joining 2 processes through coordinator 127.0.0.1" in out
            and "DEADLINE_EXCEEDED" in out
        ), out[-3000:]

    def test_incomplete_settings_name_what_is_missing(monkeypatch):
        monkeypatch.setenv("RELAX_COORDINATOR", "127.0.0.1:1234")
        monkeypatch.delenv("RELAX_NUM_PROCESSES", raising=False)
        monkeypatch.delenv("RELAX_PROCESS_ID", raising=False)
        with pytest.raises(
            ValueError, match="coordinator 127.0.0.1:1234 given without num_processes/process_id"
        ):
            distributed.initialize()
        monkeypatch.setenv("RELAX_NUM_PROCESSES", "two")
        with pytest.raises(ValueError, match="RELAX_NUM_PROCESSES='two' is not an integer"):
            distributed.initialize()
        with pytest.raises(ValueError, match=r"process_id=2 is not in \[0, num_processes=2\)"):
            distributed.initialize("127.0.0.1:1234", 2, 2)
        with pytest.raises(ValueError, match="'nohost' is not host:port"):
            distributed.initialize("nohost", 2, 0)
        monkeypatch.delenv("RELAX_COORDINATOR")
        monkeypatch.delenv("RELAX_NUM_PROCESSES")
        assert distributed.initialize() is False  # nothing configured: a single-process run


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "process":
        process_worker(int(args[0]), int(args[1]), int(args[2]), args[3], args[4])
    elif mode == "single":
        single_worker(args[0])
    elif mode == "partial":
        partial_worker(int(args[0]), int(args[1]), int(args[2]), args[3])
    elif mode == "sft":
        sft_worker(*args)
    elif mode == "alone":  # process 0 of 2 whose peer never comes
        from relax.parallel import distributed as d

        d.initialize(f"127.0.0.1:{args[0]}", 2, 0, timeout_s=3)
        print("initialised without its peer?!")
    else:
        raise SystemExit(f"unknown mode {mode}")
