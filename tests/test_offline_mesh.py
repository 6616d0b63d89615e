"""The trainers besides GRPO and PPO (tests/test_parallel.py) on a mesh (``--parallel.mesh``): SFT,
DPO (and SimPO, its reference-free loss), ORPO, KTO, reward-model training, distillation and the
agent trainer (a user's environment from ``--env``), each run through its command line for two
steps on one device and on a three-axis mesh of 8 simulated devices (``data=2,fsdp=2,tensor=2``:
batch rows over data x fsdp, heads and MLP over tensor), log the same training and held-out
metrics to rounding; so does the three-stage ``rlhf`` pipeline (SFT, a reward model, PPO against
it) with ``--parallel.mesh``. And a GRPO/PPO run's ``--reward-model`` on that mesh: its weights
laid out by the sharding rules, its scores those of one device.

Eight simulated devices need ``--xla_force_host_platform_device_count`` before jax starts: one
subprocess (this file as a script) runs every trainer both ways and writes JSON, as
tests/test_parallel.py does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
MESH = "data=2,fsdp=2,tensor=2"
RTOL, ATOL = 2e-4, 2e-5  # float32 sums in another order over 8 devices, after an Adam step
SKIP = ("time", "tokens_per_s", "compiles")  # wall-clock figures
LENGTHS = ("--max-prompt-tokens", "16", "--max-completion-tokens", "8")
EXPERT_MESH = "expert=2,fsdp=2,tensor=2"  # a mixture of experts' experts split two ways
PAIR_LENGTHS = ("--dpo.max-prompt-tokens", "16", "--dpo.max-completion-tokens", "8")


def _lines(run_dir: Path) -> dict[str, dict]:
    """Every metrics.jsonl line by step (``train`` / ``eval`` lines apart), wall-clock keys left out."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        kind = "eval" if any(k.startswith("eval/") for k in row) else "train"
        out[f"{kind} {row['step']}"] = {
            k: v
            for k, v in row.items()
            if k not in SKIP and not k.startswith("time/") and isinstance(v, int | float)
        }
    return out


def _random_base(task, root: Path):
    """An untrained model of ``task``'s shape with its tokenizer, in ``root / "model"``."""
    import jax

    from relax.models import init
    from relax.models.hf.checkpoint import save_pretrained
    from relax.tasks import reverse

    tokenizer = reverse.build_tokenizer(task, root)
    model = init(reverse.model_config(task, tokenizer), jax.random.key(0))
    save_pretrained(model, root / "model")
    tokenizer.save_pretrained(root / "model")
    return model


def _trainers(root: Path, trained: bool = True, agent: bool = True) -> dict[str, list[str]]:
    """Each trainer's command line on the reverse task's data, from a base model built once
    (``trained``: the task's base model, else an untrained one of its shape); ``agent``: the
    agent trainer's too."""
    import jax
    from test_offline import write_base

    from relax.models import ModelConfig, init
    from relax.models.hf.checkpoint import save_pretrained
    from relax.tasks import reverse

    task = reverse.ReverseTask(num_train=200, num_eval=16)
    base = write_base(task, root) if trained else _random_base(task, root)
    tokenizer = reverse.build_tokenizer(
        task, root
    )  # the base's, again: for the student's directory
    c = base.config
    student = init(
        ModelConfig(**{**c.__dict__, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8}),
        jax.random.key(5),
        std=0.05,
    )
    save_pretrained(student, root / "student")
    tokenizer.save_pretrained(root / "student")

    def data(rows_of, name: str, model: str = "model") -> list[str]:
        paths = reverse.write_task_data(task, root / name, rows_of)
        return ["--model", str(root / model), "--data", paths[0], "--eval-data", paths[1]]

    unpaired = lambda rs: reverse.unpaired_records(rs, 0)  # noqa: E731
    prompts_and_completions = lambda rs: [  # noqa: E731
        {k: r[k] for k in ("prompt", "completion")} for r in unpaired(rs)
    ]
    pairs = data(reverse.preference_records, "pairs")
    evaluated = ("--eval-max-examples", "8")
    return {
        "sft": [*data(reverse.sft_records, "sft"), "--sft.max-length", "32", *evaluated],
        "dpo": [*pairs, *PAIR_LENGTHS, *evaluated],
        "orpo": [*pairs, *PAIR_LENGTHS, *evaluated],  # reference-free, its NLL term on
        "dpo-simpo": [*pairs, *PAIR_LENGTHS, "--dpo.loss-type", "simpo", *evaluated],
        "kto": [
            *data(unpaired, "unpaired"),
            *("--kto.max-prompt-tokens", "16", "--kto.max-completion-tokens", "8", *evaluated),
        ],
        "reward_model": [*pairs, *LENGTHS, *evaluated],
        "distill": [
            *data(prompts_and_completions, "distill", model="student"),
            *("--teacher", str(root / "model"), *LENGTHS, *evaluated),
        ],
        **({"agent": _agent(root, sft_steps=60 if trained else 30)} if agent else {}),
    }


def _agent(root: Path, sft_steps: int) -> list[str]:
    """The agent trainer on test_agent_run's ``Graded`` environment (a module in ``root``, on the
    path) and a model that ends its turns (a short supervised phase): rewards that differ, and
    two turns where the first ends in time."""
    from test_agent_run import GUESS_ENV, write_model

    (root / "mesh_envs.py").write_text(GUESS_ENV)
    sys.path.insert(0, str(root))
    rows = root / "agent_rows.jsonl"
    # one row in five has a longer prompt (another bucket): the agent compiles both ahead
    rows.write_text(
        "".join(json.dumps({"answer": 10 + i, "words": 8 * (i % 5 == 0)}) + "\n" for i in range(40))
    )
    model = write_model(root / "agent", sft_steps=sft_steps)
    return [
        *("--model", str(model), "--data", str(rows), "--eval-fraction", "0.2"),
        *("--env", "mesh_envs:Graded", "--grpo.num-generations", "2", "--grpo.beta", "0.04"),
        *("--grpo.max-new-tokens", "48", "--agent.max-turn-tokens", "8", "--agent.max-turns", "2"),
        *("--eval-max-rows", "8", "--grpo.optimizer.learning-rate", "1e-3"),
    ]


def _moe_sft(root: Path) -> list[str]:
    """SFT of an untrained mixture of experts of the reverse task's shape (4 experts, 2 per
    token): its router's auxiliary losses and load figures are metrics too."""
    from relax.tasks import reverse

    task = reverse.ReverseTask(num_train=200, num_eval=16, num_experts=4)
    _random_base(task, root / "moe")
    paths = reverse.write_task_data(task, root / "moe-sft", reverse.sft_records)
    return [
        *("--model", str(root / "moe" / "model"), "--data", paths[0], "--eval-data", paths[1]),
        *(
            "--sft.max-length",
            "32",
            "--eval-max-examples",
            "8",
            "--steps",
            "2",
            "--batch-size",
            "8",
        ),
    ]


def reward_model_case(root: Path) -> dict:
    """``--reward-model``'s scorer (``reward_functions``) on one device and on the mesh: the
    scores of a few samples, and how the mesh lays out the reward model's weights."""
    import jax

    from relax import parallel
    from relax.algorithms.online.config import OnlineRunConfig
    from relax.algorithms.online.rewards import reward_functions
    from relax.models.heads.reward_model import init_reward_model, save_reward_model
    from relax.models.hf.checkpoint import load_pretrained
    from relax.text import load_tokenizer

    tokenizer = load_tokenizer(root / "model")
    rm = init_reward_model(
        load_pretrained(root / "model"), jax.random.key(4), head_std=1.0, pad_token_id=0
    )
    cfg = OnlineRunConfig(
        reward_model=str(save_reward_model(rm, root / "rm", tokenizer=tokenizer)), reward=()
    )
    prompts, completions = ["abc=", "ba=", "cab="] * 4, ["cba", "ab", "bac", "c"] * 3
    one = reward_functions(cfg)[-1].fn
    sharded = reward_functions(cfg, parallel.make_mesh(MESH))[-1].fn
    return {
        "one": one(prompts, completions),
        "mesh": sharded(prompts, completions),
        "wq_spec": str(sharded.model.backbone.layers.wq.sharding.spec),
    }


def rlhf_case(root: Path) -> dict:
    """``examples/rlhf.py`` (test_rlhf's tiny pipeline: SFT, a reward model, PPO against it) on one
    device and with ``--parallel.mesh``: each stage's held-out figures before and after."""
    from test_rlhf import rlhf_main, tiny

    out = {}
    for where, flags in (("one", []), ("mesh", ["--parallel.mesh", MESH])):
        summary = rlhf_main()([*tiny(root / f"rlhf-{where}"), *flags])
        out[where] = {
            f"{s['stage']} {f['metric']}": [f["before"], f["after"]]
            for s in summary["stages"]
            for f in s["figures"]
        }
    return out


def _without_eval(args: list[str]) -> list[str]:
    """``args`` with nothing held out (no evaluation: the fast case checks one training step)."""
    out, skip = [], False
    for a in args:
        if skip or a in (
            "--eval-data",
            "--eval-fraction",
            "--eval-max-examples",
            "--eval-max-rows",
        ):
            skip = not skip
            continue
        out.append(a)
    return [*out, "--eval-fraction", "0"]


def example(name: str) -> str:
    """The trainer a case of ``_trainers`` runs: ``dpo-simpo`` is ``train_dpo.py`` with its flags."""
    return name.split("-")[0]


def _one_and_mesh(name: str, argv: list[str], root: Path, mesh: str = MESH) -> dict:
    """``examples/train_<name>.py argv`` on one device and on ``mesh``: each run's metrics lines."""
    from conftest import load_example

    runs = {}
    for where, flags in (("one", []), ("mesh", ["--parallel.mesh", mesh])):
        run_dir = root / f"{name}-{where}"
        load_example(example(name)).main([*argv, *flags, "--run-dir", str(run_dir)])
        runs[where] = _lines(run_dir)
    return runs


def fast_worker(out_path: str, root: str) -> None:
    """One training step of every trainer on one device and on the mesh, nothing evaluated or
    exported: the fast case of each."""
    from conftest import use_compile_cache

    use_compile_cache()
    results = {}
    for name, args in _trainers(Path(root), trained=False).items():
        common = [*_without_eval(args), "--steps", "1", "--batch-size", "8", "--no-export-hf"]
        common += ["--checkpoint-every", "1"]
        results[name] = _one_and_mesh(name, common, Path(root))
    Path(out_path).write_text(json.dumps(results))


def worker(out_path: str, root: str) -> None:
    import jax
    from conftest import load_example, use_compile_cache

    from relax.parallel import ShardingError

    use_compile_cache()
    assert jax.device_count() == 8, jax.devices()
    trainers = _trainers(Path(root))
    results = {"rm_scorer": reward_model_case(Path(root)), "rlhf": rlhf_case(Path(root))}
    for name, args in trainers.items():
        common = [*args, "--steps", "2", "--batch-size", "8"]
        results[name] = _one_and_mesh(name, common, Path(root))
    results["sft-moe"] = _one_and_mesh("sft-moe", _moe_sft(Path(root)), Path(root), EXPERT_MESH)
    on_policy = [
        *trainers["distill"],
        "--distill.mode",
        "on_policy",
        "--distill.max-new-tokens",
        "8",
    ]
    results["distill_on_policy"] = {}
    for where, flags in (
        ("one", []),
        ("mesh", ["--parallel.mesh", MESH]),
        ("sampler", ["--parallel.sampler-devices", "4", "--parallel.mesh", "data=2,tensor=2"]),
    ):
        run_dir = Path(root) / f"distill-on-policy-{where}"
        load_example("distill").main(
            [*on_policy, "--steps", "2", "--batch-size", "8", *flags, "--run-dir", str(run_dir)]
        )
        results["distill_on_policy"][where] = _lines(run_dir)
        results.setdefault("distill_on_policy_compiles", {})[where] = [
            json.loads(line)["compiles"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"compiles"' in line
        ]
    try:  # SFT samples nothing: a sampler mesh would only take devices from training
        sft = [*trainers["sft"], "--steps", "1", "--batch-size", "8"]
        load_example("sft").main(
            [*sft, "--parallel.sampler-devices", "4", "--run-dir", str(Path(root) / "sampler")]
        )
        results["sampler_devices_error"] = None
    except ShardingError as e:
        results["sampler_devices_error"] = str(e)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    {"fast": fast_worker, "full": worker}[sys.argv[1]](*sys.argv[2:])
else:
    import numpy as np
    import pytest
    from test_parallel import run_worker

    TRAINERS = ("sft", "dpo", "orpo", "dpo-simpo", "kto", "reward_model", "distill", "agent")

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        d = tmp_path_factory.mktemp("offline_mesh")
        run_worker(HERE, ["full", str(d / "results.json"), str(d)], timeout=900.0)
        return json.loads((d / "results.json").read_text())

    @pytest.fixture(scope="module")
    def fast_results(tmp_path_factory):
        d = tmp_path_factory.mktemp("offline_mesh_fast")
        run_worker(HERE, ["fast", str(d / "results.json"), str(d)], timeout=900.0)
        return json.loads((d / "results.json").read_text())

    @pytest.mark.parametrize("name", TRAINERS)
    @pytest.mark.slow
    def test_one_step_on_a_mesh_equals_one_device(fast_results, name):
        """The fast case of each trainer: its first step's loss and every metric."""
        one, mesh = fast_results[name]["one"], fast_results[name]["mesh"]
        assert set(one) == set(mesh) == {"train 1"}, (one, mesh)
        assert set(mesh["train 1"]) == set(one["train 1"]) and "loss" in one["train 1"]
        for key, value in one["train 1"].items():
            np.testing.assert_allclose(
                mesh["train 1"][key], value, rtol=RTOL, atol=ATOL, err_msg=f"{name}: {key}"
            )

    @pytest.mark.slow  # one 8-device worker runs ten short runs: minutes on 2 cores
    def test_a_trainer_that_samples_nothing_refuses_sampler_devices(results):
        assert "--parallel.sampler-devices" in results["sampler_devices_error"]

    @pytest.mark.slow
    def test_a_reward_model_is_sharded_on_the_mesh_and_scores_alike(results):
        got = results["rm_scorer"]
        assert "tensor" in got["wq_spec"] and "fsdp" in got["wq_spec"], got["wq_spec"]
        np.testing.assert_allclose(got["mesh"], got["one"], rtol=RTOL, atol=ATOL)
        assert len(set(np.round(got["one"], 4))) > 1  # the samples score apart

    @pytest.mark.slow
    def test_on_policy_distillation_on_a_mesh_and_a_sampler_mesh_equals_one_device(results):
        """GKD's on-policy mode samples from the student every step: on the trainer mesh, and on
        4 sampler devices with the student trained on the other 4, it logs what one device logs."""
        runs = results["distill_on_policy"]
        one = runs["one"]
        assert {"train 1", "train 2"} <= set(one), one
        # compiled before the first step, on a mesh and beside a sampler mesh too
        assert results["distill_on_policy_compiles"] == {w: [0.0, 0.0] for w in runs}
        for where in ("mesh", "sampler"):
            assert set(runs[where]) == set(one), where
            for line, want in one.items():
                for key, value in want.items():
                    np.testing.assert_allclose(
                        runs[where][line][key],
                        value,
                        rtol=RTOL,
                        atol=ATOL,
                        err_msg=f"{where} {line}: {key}",
                    )

    @pytest.mark.slow
    def test_moe_sft_with_experts_split_equals_one_device(results):
        """SFT of a mixture of experts on ``expert=2,fsdp=2,tensor=2`` (the experts split two
        ways, the batch over expert x fsdp) logs what one device logs, its routers' figures too."""
        one, mesh = results["sft-moe"]["one"], results["sft-moe"]["mesh"]
        assert set(one) == set(mesh) and {"train 1", "train 2"} <= set(one), (one, mesh)
        assert any(k.startswith("moe/") for k in one["train 1"]), one["train 1"]
        for line, want in one.items():
            assert set(mesh[line]) == set(want), line
            for key, value in want.items():
                np.testing.assert_allclose(
                    mesh[line][key], value, rtol=RTOL, atol=ATOL, err_msg=f"{line}: {key}"
                )

    @pytest.mark.slow
    def test_rlhf_on_a_mesh_equals_one_device(results):
        one, mesh = results["rlhf"]["one"], results["rlhf"]["mesh"]
        assert set(one) == set(mesh) and {"sft log_likelihood", "ppo reward"} <= set(one), one
        for key, value in one.items():
            np.testing.assert_allclose(mesh[key], value, rtol=RTOL, atol=ATOL, err_msg=key)

    @pytest.mark.slow
    @pytest.mark.parametrize("name", TRAINERS)
    def test_offline_trainer_on_a_mesh_equals_one_device(results, name):
        one, mesh = results[name]["one"], results[name]["mesh"]
        assert set(one) == set(mesh) and {"train 1", "train 2"} <= set(one), (one, mesh)
        assert any(k.startswith("eval") for k in one), one  # held-out figures before and after
        if name == "agent":  # trajectories that score apart and go on after a first turn
            assert one["train 1"]["reward_std"] > 0 and one["train 1"]["turns"] > 1, one
        for line, want in one.items():
            assert set(mesh[line]) == set(want), (name, line)
            for key, value in want.items():
                np.testing.assert_allclose(
                    mesh[line][key], value, rtol=RTOL, atol=ATOL, err_msg=f"{name} {line}: {key}"
                )
