"""Multi-host runs on one machine: two CPU processes (2 devices each) joined by
``relax.parallel.distributed.initialize`` over a loopback coordinator run one GRPO iteration on the global
``fsdp=2,tensor=2`` mesh (parameters sharded ACROSS the processes, gloo collectives), each
feeding its own half of the prompts; over three iterations (the KL term on, Adam's default eps)
their metrics and tokens must match a single-process run of the same global batch. Both processes
also save and restore a checkpoint collectively.
Every offline trainer from its command line (SFT, DPO, KTO, reward models, distillation) and the
agent trainer on a user's environment (each process sampling its own rows on its own copy of the
policy) on a two-process mesh of four devices each logs what one device logs, a ``--reward-model`` scores
alike; GRPO with partial rollouts (stopped and resumed mid-way) samples and logs what one device does.
Plus the failure modes: an unreachable coordinator, a missing peer, a peer late at a barrier,
incomplete settings.
Every subprocess has a bounded timeout; nothing can hang the suite.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import test_parallel as tp  # noqa: E402  (the shared GRPO case and worker helpers)

TIMEOUT_S = 150
GLOBAL_MESH = "fsdp=2,tensor=2"
TRAINERS_MESH = "data=2,fsdp=2,tensor=2"  # two processes of four devices


def _padded(run: dict) -> dict:
    """A one-process run's record without its packing metrics (a multi-process run trains on
    padded completions: relax.algorithms.online.stages.make_packing)."""
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith("pack_")}  # noqa: E731
    return {**run, "metrics": [drop(m) for m in run["metrics"]]}


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


def trainers_worker(root: str, *flags: str) -> None:
    """Every offline trainer's and the agent trainer's command line (``root/trainers.json``, from
    ``test_offline_mesh._trainers``) for two steps with ``flags`` (the parallel ones) into
    ``root/<run>/<trainer>``, ``<run>`` from ``RELAX_TEST_RUN``; then a ``--reward-model``'s scores
    of a few samples on the run's mesh (``reward_functions``) into ``root/<run>/rm<process>.json``.
    jax's CPU device count from ``RELAX_TEST_CPU_DEVICES``."""
    import os

    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ.get("RELAX_TEST_CPU_DEVICES", "1")))
    tp.use_compile_cache()
    import test_offline_mesh as tom
    from conftest import load_example

    from relax.algorithms.online.config import OnlineRunConfig
    from relax.algorithms.online.rewards import reward_functions
    from relax.parallel import make_mesh

    sys.path.insert(0, root)  # the agent's environment module (test_offline_mesh._agent)
    out = Path(root) / os.environ["RELAX_TEST_RUN"]
    trainers = json.loads((Path(root) / "trainers.json").read_text())
    for name, args in trainers.items():
        common = [*args, "--steps", "2", "--batch-size", "8"]
        load_example(tom.example(name)).main([*common, "--run-dir", str(out / name), *flags])
    spec = flags[flags.index("--parallel.mesh") + 1] if "--parallel.mesh" in flags else None
    mesh = None if spec is None else make_mesh(spec)
    cfg = OnlineRunConfig(reward_model=str(Path(root) / "rm"), reward=())
    scorer = reward_functions(cfg, mesh)[-1].fn
    sharding = jax.tree.leaves(scorer.model)[0].sharding
    from relax.algorithms.agent.step import longest_prompt

    (out / f"rm{jax.process_index()}.json").write_text(
        json.dumps(
            {
                "scores": scorer(["abc=", "ba=", "cab=", "c="], ["cba", "ab", "bac", "c"]),
                "devices": len(sharding.device_set),
                # the agent's prompts' width: the longest of every process's (process i: 5 + 30 i)
                "longest": longest_prompt(5 + 30 * jax.process_index()),
            }
        )
    )


def images_worker(root: str, *flags: str) -> None:
    """``examples/train_grpo.py`` on image prompts of the tiny Qwen2.5-VL
    (``test_vlm_mesh.cli_args``) with ``flags`` into ``root/<RELAX_TEST_RUN>``; jax's CPU device
    count from ``RELAX_TEST_CPU_DEVICES``."""
    import os

    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ.get("RELAX_TEST_CPU_DEVICES", "1")))
    tp.use_compile_cache()
    import test_vlm_mesh as tvm
    from conftest import load_example

    from relax.rewards.builtin import BUILTIN_REWARDS

    BUILTIN_REWARDS["row_tied"] = _row_tied
    run_dir = Path(root) / os.environ["RELAX_TEST_RUN"]
    args = [*tvm.cli_args(Path(root)), "--reward", "row_tied", "--run-dir", str(run_dir)]
    load_example("grpo").main([*args, *flags])


def _row_tied(prompts, completions, answer, **fields):
    """A reward of each completion and its own row's answer (not of the batch as a whole): a row
    that got another row's image would score, and so train, otherwise. The prompts' texts are
    all the same; their images and answers differ."""
    return [float(len(c) % 3 == int(a) % 3) for c, a in zip(completions, answer)]


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


LATE_S = 35  # more than gloo's 30 s wait for a peer's first collective


def late_worker(pid: int, port: int, out: str) -> None:
    """Process 1 reaches the barrier ``LATE_S`` seconds after process 0 (as a slower compile
    would); then both gather their ids through a device collective."""
    import jax

    from relax.parallel import distributed

    distributed.initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=60)
    assert jax.device_count() == 2  # the backend up (its start waits for every process)
    if pid == 1:
        time.sleep(LATE_S)
    t0 = time.monotonic()
    distributed.barrier("late peer")
    waited = time.monotonic() - t0
    ids = distributed.all_rows(np.asarray([jax.process_index()]))
    Path(out).write_text(json.dumps({"waited": waited, "ids": ids.tolist()}))


if __name__ != "__main__":
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

    @pytest.mark.slow
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
                for k, want in _padded(single)["metrics"][i].items():
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

    def _two_and_one(mode: str, root: Path, timeout: float, *extra: str) -> None:
        """Worker ``mode`` on ``root`` as two processes of four devices on ``TRAINERS_MESH``
        (``RELAX_TEST_RUN=two``) and as one process of one device (``one``), side by side, both
        with the flags ``extra``; each must succeed."""
        port = free_port()
        flags = [
            *extra,
            "--parallel.mesh",
            TRAINERS_MESH,
            "--parallel.coordinator",
            f"127.0.0.1:{port}",
        ]
        two = {"RELAX_TEST_CPU_DEVICES": "4", "RELAX_TEST_RUN": "two"}
        procs = [
            _spawn(
                [mode, str(root), *flags, "--parallel.num-processes", "2"]
                + ["--parallel.process-id", str(i)],
                env=two,
            )
            for i in range(2)
        ]
        procs.append(_spawn([mode, str(root), *extra], env={"RELAX_TEST_RUN": "one"}))
        outputs = _finish(procs, timeout)
        for p, out in zip(procs, outputs):
            assert p.returncode == 0, out[-6000:]
        assert "2 process(es)" in outputs[0]

    def _trainers_setup(root: Path) -> None:
        """Every offline trainer's and the agent's command line on untrained models of the reverse task
        (``test_offline_mesh._trainers``) in ``root/trainers.json``, and a reward model in ``root/rm``."""
        import jax
        import test_offline_mesh as tom

        from relax.models.heads.reward_model import init_reward_model, save_reward_model
        from relax.models.hf.checkpoint import load_pretrained
        from relax.text import load_tokenizer

        trainers = tom._trainers(root, trained=False)
        trainers = {  # held-out metrics for SFT and the agent; the others' on a mesh: test_offline_mesh
            k: v if k in ("sft", "agent") else tom._without_eval(v) for k, v in trainers.items()
        }
        (root / "trainers.json").write_text(json.dumps(trainers))
        rm = init_reward_model(
            load_pretrained(root / "model"), jax.random.key(4), head_std=1.0, pad_token_id=0
        )
        save_reward_model(rm, root / "rm", tokenizer=load_tokenizer(root / "model"))

    @pytest.mark.slow  # two steps of eight trainer cases in three subprocesses
    def test_trainers_on_two_processes_log_what_one_device_logs(tmp_path):
        """SFT, DPO, KTO, reward-model training, distillation and the agent trainer on the global
        ``data=2,fsdp=2,tensor=2`` mesh of two processes of four devices (each collating its half
        of a step's rows) log the training metrics of a one-device run (SFT: and its held-out
        ones; the agent: and its held-out success); a GRPO run's
        ``--reward-model`` scores alike, held once per process over its four devices."""
        _trainers_setup(tmp_path)
        _two_and_one("trainers", tmp_path, 4 * TIMEOUT_S)
        names = json.loads((tmp_path / "trainers.json").read_text())
        assert set(names) == {
            "sft",
            "dpo",
            "orpo",
            "dpo-simpo",
            "kto",
            "reward_model",
            "distill",
            "agent",
        }
        for name in names:
            lines = {
                run: [
                    json.loads(x)
                    for x in (tmp_path / run / name / "metrics.jsonl").read_text().splitlines()
                ]
                for run in ("one", "two")
            }
            # 2 steps (SFT: and evaluations before and after)
            assert len(lines["one"]) == len(lines["two"]) >= 2, name
            # every trainer compiles its step (the agent: and its rollout) ahead, every process
            compiles = [x["compiles"] for x in lines["two"] if "compiles" in x]
            assert compiles == [0.0, 0.0], name
            for want, got in zip(lines["one"], lines["two"]):
                assert want["step"] == got["step"]
                for k, v in want.items():
                    if k.startswith("time") or k in ("tokens_per_s", "compiles", "step"):
                        continue
                    if isinstance(v, int | float):
                        np.testing.assert_allclose(
                            got[k], v, rtol=2e-4, atol=2e-5, err_msg=f"{name}: {k}"
                        )
        one = json.loads((tmp_path / "one" / "rm0.json").read_text())
        for i in range(2):
            got = json.loads((tmp_path / "two" / f"rm{i}.json").read_text())
            np.testing.assert_allclose(got["scores"], one["scores"], rtol=2e-4, atol=2e-5)
            assert got["devices"] == 4 and one["devices"] == 1  # this process's devices
            assert got["longest"] == 35 and one["longest"] == 5

    @pytest.mark.slow  # two short image runs in three subprocesses
    @pytest.mark.parametrize("extra", [(), ("--train-vision",)], ids=["frozen", "train-vision"])
    def test_image_prompts_on_two_processes_log_what_one_device_logs(tmp_path, extra):
        """GRPO on image prompts of the tiny Qwen2.5-VL on the global ``data=2,fsdp=2,tensor=2``
        mesh of two processes of four devices: each process encodes its own rows' images on its
        own devices (the vision part there) and the step takes them as global arrays; the
        held-out prompts, which every process holds whole, are encoded by each and replicated.
        The training and held-out metrics are a one-device run's, with a reward of each row's own
        answer (``_row_tied``: images given to the wrong rows would score otherwise).
        ``--train-vision``: every process gathers every process's images for the tower in the
        step (``relax.parallel.pixels``), and the held-out images are encoded by the state's
        tower."""
        import test_vlm_mesh as tvm

        tvm.write_setup(tmp_path)
        _two_and_one("images", tmp_path, 2 * TIMEOUT_S, *extra)
        one, two = (tvm._lines(tmp_path / run) for run in ("one", "two"))
        assert set(one) == set(two) == {"eval 0", "train 1", "train 2", "eval 2"}, (one, two)
        for line, want in one.items():
            assert set(two[line]) == set(want), line
            for k, v in want.items():
                np.testing.assert_allclose(
                    two[line][k], v, rtol=2e-4, atol=2e-5, err_msg=f"{line}: {k}"
                )

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
        tpr.assert_same_updates({**first, "tokens": tokens}, _padded(single), "two processes")

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

    @pytest.mark.slow  # a peer 35 s late
    def test_a_barrier_waits_for_a_peer_later_than_a_collective_would(tmp_path):
        """``distributed.barrier`` waits on the coordination service: a process 35 s late (as
        one whose compiles ran slower) is waited for, and the collective after the barrier
        gathers both processes. A collective in its place (the previous barrier,
        ``sync_global_devices``) gives up on a peer after gloo's 30 s."""
        port = free_port()
        procs = [_spawn(["late", str(i), str(port), str(tmp_path / f"{i}.json")]) for i in (0, 1)]
        outs = _finish(procs, 120)
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
        first, second = (json.loads((tmp_path / f"{i}.json").read_text()) for i in (0, 1))
        assert first["ids"] == second["ids"] == [0, 1]
        assert first["waited"] > LATE_S - 5 > second["waited"]

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
    elif mode == "trainers":
        trainers_worker(*args)
    elif mode == "images":
        images_worker(*args)
    elif mode == "late":
        late_worker(int(args[0]), int(args[1]), args[2])
    elif mode == "alone":  # process 0 of 2 whose peer never comes
        from relax.parallel import distributed as d

        d.initialize(f"127.0.0.1:{args[0]}", 2, 0, timeout_s=3)
        print("initialised without its peer?!")
    else:
        raise SystemExit(f"unknown mode {mode}")
