"""Meshes and sharding rules (relax.parallel): specs, parameter shard shapes, the GRPO step on
every mesh == on one device, separate sampler/trainer meshes, memory options, bad input.

Multi-device checks need ``--xla_force_host_platform_device_count=8`` before jax starts, so they
run in ONE subprocess (this file run as a script, ``worker`` mode) whose JSON results the tests
below read; the in-process tests use one device and ``AbstractMesh``es.

Tolerance (documented in the README): sampled tokens are identical on every mesh (each
completion has its own key, and logits differ by ~1e-6 only through reduction order); losses
and metrics agree to ``rtol=2e-5, atol=5e-6`` over three GRPO iterations with the KL term
(``beta=0.04``) and Adam's default ``eps=1e-8``. While the policy is the reference the KL term
and its gradient are exactly zero (``relax.train.update``), so it adds no difference of its own;
what remains is Adam's: a gradient component within round-off of zero gets a step
``lr * g / (|g| + eps)`` whose size round-off decides, so the weights differ by a few 1e-3 of
the learning rate (``WEIGHT_ATOL``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from conftest import (  # cheap XLA:CPU codegen; the suite's compile cache
    FAST_COMPILE,
    use_compile_cache,
)

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
MODEL = dict(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    qkv_bias=True,
    qk_norm=True,
)
PROMPTS, PROMPT_LEN = 8, 8
MESHES = (
    "data=8",
    "data=2,fsdp=2,tensor=2",
)  # pure data; all three axes (fsdp=8: the shard-shape test)
RTOL, ATOL = 2e-5, 5e-6
LEARNING_RATE = 1e-2
WEIGHT_ATOL = 5e-3 * LEARNING_RATE  # after ITERATIONS Adam steps (module docstring)
ITERATIONS = 3


# ------------------------------------------------------------------ the shared GRPO case


def _decode(tokens, mask):
    return [" ".join(str(t) for t, m in zip(row, mr) if m) for row, mr in zip(tokens, mask)]


def fives(prompts, completions, **fields):
    """Deterministic reward: share of token 5, scaled by the row's ``weight`` field."""
    return [w * c.split().count("5") / 6 for c, w in zip(completions, fields["weight"])]


def global_batch():
    rng = np.random.default_rng(0)
    ids = np.zeros((PROMPTS, PROMPT_LEN), np.int32)
    mask = np.zeros((PROMPTS, PROMPT_LEN), np.int32)
    for i, n in enumerate([8, 5, 3, 7, 2, 6, 4, 8]):
        ids[i, PROMPT_LEN - n :] = rng.integers(1, MODEL["vocab_size"], n)
        mask[i, PROMPT_LEN - n :] = 1
    return ids, mask


def local_batch(rows: slice = slice(None)):
    from relax.algorithms.online.batch import step_input

    ids, mask = global_batch()
    weights = [1.0 + i / 8 for i in range(PROMPTS)]
    return step_input(
        ids[rows], mask[rows], [f"p{i}" for i in range(PROMPTS)][rows], {"weight": weights[rows]}
    )


def run_case(
    mesh=None,
    *,
    sampler_devices=0,
    iterations=ITERATIONS,
    rows=slice(None),
    master_weights=False,
    param_dtype=None,
    checkpoint_dir=None,
    beta=0.04,
    lora_rank=0,
    eos_ids=(),
    packing="auto",
):
    """Iterations of the composed GRPO step (sharded when ``mesh``/``sampler_devices``); returns
    per-iteration metrics and this process's sampled tokens, and the compiles after iteration 1."""
    import jax
    import jax.numpy as jnp

    from relax import parallel
    from relax.algorithms.grpo.config import preset
    from relax.algorithms.grpo.step import make_grpo_step
    from relax.algorithms.online.step import StepParts
    from relax.data.completion_layout import PackingConfig
    from relax.models import ModelConfig, init
    from relax.parallel import distributed
    from relax.passes import choose_passes
    from relax.train.optimizer import OptimizerConfig
    from relax.train.state import init_state

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: (
            compiles.append(event) if event.endswith("backend_compile_duration") else None
        )
    )
    policy = init(ModelConfig(**MODEL), jax.random.key(0), std=0.1)
    if param_dtype is not None:
        policy = jax.tree.map(lambda x: x.astype(param_dtype), policy)
    if lora_rank:
        from relax.models.adapters.operations import add_lora
        from relax.models.layers.lora import LoRAConfig

        policy = add_lora(policy, LoRAConfig(rank=lora_rank), jax.random.key(3))
    cfg = preset(
        "grpo",
        num_generations=4,
        max_new_tokens=6,
        beta=beta,
        packing=PackingConfig(packing, bin_tokens=24),
        optimizer=OptimizerConfig(learning_rate=LEARNING_RATE, master_weights=master_weights),
    )
    opt = cfg.optimizer.make()
    state = init_state(policy, opt, key=jax.random.key(1), with_reference=beta > 0)
    wq0 = np.asarray(policy.layers.wq).astype(np.float32)  # the step donates the state's buffers
    trainer, sampler = parallel.ParallelConfig(mesh=mesh, sampler_devices=sampler_devices).meshes()
    passes = choose_passes(batch_shards=1 if trainer is None else parallel.batch_shards(trainer))
    step = make_grpo_step(
        cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=eos_ids, pad_id=0, passes=passes)
    )
    segments = [s.names for s in step.segments]
    if trainer is not None:
        step = parallel.ShardedStep(step, state, trainer, sampler_mesh=sampler)
        state = step.place(state)
        segments = [s.names for s in step.segments]
    out = {"metrics": [], "tokens": [], "segments": segments, "weights": []}
    for i in range(iterations):
        before = len(compiles)
        state, batch = step(state, local_batch(rows))
        out["metrics"].append({k: float(v) for k, v in batch.device.metrics.items()})
        out["tokens"].append(distributed.to_local(batch.device.batch.tokens).tolist())
        if jax.process_count() == 1:  # a few weights after every iteration
            out["weights"].append(
                {
                    name: np.asarray(x, np.float32).tolist()
                    for name, x in (("wq", state.policy.layers.wq), ("embed", state.policy.embed))
                }
            )
        if i > 0:
            out["compiles_after_first"] = len(compiles) - before
    out["policy_dtype"] = str(state.policy.layers.wq.dtype)
    master = getattr(state.opt_state, "master", None)
    if master is not None:
        out["master_dtype"] = str(master.layers.wq.dtype)
        out["master_moved"] = bool(np.any(np.asarray(master.layers.wq) != wq0))
    if checkpoint_dir is not None:  # collective save + restore: every process calls both
        from relax.train.checkpoint import Checkpointer

        with Checkpointer(checkpoint_dir, async_save=False) as ck:
            ck.save(iterations, state, config={"mesh": mesh}, force=True)
            restored, _, _ = ck.restore(target=state)
        same = jax.tree.map(
            lambda a, b: (
                bool(jnp.all(a == b)) if not jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else True
            ),
            state,
            restored,
        )
        out["checkpoint_roundtrip"] = all(jax.tree.leaves(same))
        out["restored_sharding"] = str(restored.policy.layers.wq.sharding.spec)
    return out


def _shard_shapes(spec: str, lora: bool = False) -> dict:
    import jax

    from relax import parallel
    from relax.models import ModelConfig, init
    from relax.train.optimizer import OptimizerConfig
    from relax.train.state import init_state

    mesh = parallel.make_mesh(spec)
    from relax.models.adapters.operations import add_lora
    from relax.models.layers.lora import LoRAConfig

    policy = init(ModelConfig(**{**MODEL, "o_bias": True, "mlp_bias": True}), jax.random.key(0))
    if lora:
        policy = add_lora(policy, LoRAConfig(rank=4), jax.random.key(1))
    opt = OptimizerConfig(master_weights=True).make()
    state = init_state(policy, opt, key=jax.random.key(1), with_reference=True)
    state = jax.device_put(state, parallel.state_shardings(state, mesh))
    shapes = {}
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        shapes[jax.tree_util.keystr(path)] = [
            list(x.shape),
            list(x.addressable_shards[0].data.shape),
        ]
    return shapes


def make_cli_setup(d: Path) -> None:
    """A tiny HF model directory, sentencepiece tokenizer and jsonl data (as tests/test_run.py)."""
    import jax

    from relax.models import ModelConfig, init
    from relax.models.hf.checkpoint import save_pretrained
    from relax.text.sentencepiece_model import Tokenizer, train_sentencepiece

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdef"), rng.integers(2, 5))) for _ in range(48)]
    tok = Tokenizer(
        train_sentencepiece([w + "=" for w in words], d / "tok", vocab_size=12, model_type="char")
    )
    cfg = ModelConfig(
        **{
            **MODEL,
            "qkv_bias": False,
            "qk_norm": False,
            "vocab_size": tok.vocab_size,
            "eos_token_id": tok.eos_id,
            "bos_token_id": tok.bos_id,
            "pad_token_id": tok.pad_id,
        }
    )
    save_pretrained(init(cfg, jax.random.key(0), std=0.1), d / "model")
    rows = [{"prompt": w + "=", "answer": w[::-1]} for w in words]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[40:]))


def cli_run(d: Path, algorithm: str = "grpo") -> dict:
    """examples/train_<algorithm>.py on separate sampler (4 devices) and trainer (fsdp=2,tensor=2)
    meshes; GRPO pipelined (``--async.staleness 1``: the rollout of batch 2 on the sampler's
    devices while update 1 runs, checkpoints with the sampler's copy of version 0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"train_{algorithm}", ROOT / "examples" / f"train_{algorithm}.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    run_dir = d / f"run-{algorithm}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun (run_worker) starts afresh
    flags = {
        "grpo": [
            "--grpo.num-generations",
            "2",
            "--grpo.max-new-tokens",
            "4",
            "--grpo.beta",
            "0.04",
            "--preset",
            "grpo",
            "--async.staleness",
            "1",
        ],
        "ppo": ["--ppo.num-generations", "2", "--ppo.max-new-tokens", "4", "--ppo.kl-coef", "0.05"],
    }[algorithm]
    summary = example.main(
        [
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
            "2",
            "--batch-size",
            "8",
            "--max-prompt-tokens",
            "16",
            "--checkpoint-every",
            "1",
            "--eval.num-samples",
            "1",
            *flags,
            "--parallel.mesh",
            "fsdp=2,tensor=2",
            "--parallel.sampler-devices",
            "4",
        ]
    )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "summary_keys": sorted(summary),
        "train_keys": sorted({k for x in lines if "loss" in x for k in x}),
        "checkpoints": sorted(
            p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()
        ),
        "exported": (run_dir / "final_hf" / "config.json").exists(),
    }


def _attention_all_gathers(per_step_from_mesh: bool, attention: str = "group") -> int:
    """all-gathers in the compiled training forward+backward on a data=8 mesh (batch sharded,
    params replicated), traced under the mesh as ShardedStep does (or outside it), with the
    given training attention (``dense`` is the GPU path, here through XLA's implementation)."""
    import contextlib
    import re

    import jax
    import jax.numpy as jnp

    from relax import parallel
    from relax.models import ModelConfig, init
    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs

    mesh = parallel.make_mesh("data=8")
    model = jax.device_put(init(ModelConfig(**MODEL), jax.random.key(0)), parallel.replicated(mesh))
    ids = jax.device_put(jnp.ones((8, 4), jnp.int32), parallel.batch_sharding(mesh))
    comp = jax.device_put(jnp.ones((8, 2, 3), jnp.int32), parallel.batch_sharding(mesh))
    fn = jax.jit(
        jax.grad(
            lambda m, i, c: jnp.sum(
                completion_logprobs(
                    m, i, jnp.ones_like(i), c, jnp.ones_like(c), ForwardPass(attention=attention)
                )
            )
        )
    )
    with jax.set_mesh(mesh) if per_step_from_mesh else contextlib.nullcontext():
        text = fn.lower(model, ids, comp).compile().as_text()
    return len(re.findall(r"= \S+ all-gather(?:-start)?\(", text))


def worker(out_path: str, cli_dir: str) -> None:
    import jax

    use_compile_cache()
    assert jax.device_count() == 8, jax.devices()
    t0 = time.perf_counter()
    results = {
        "shards": {spec: _shard_shapes(spec) for spec in ("data=2,fsdp=2,tensor=2", "fsdp=8")},
        "runs": {"single": run_case(None)},
    }
    for spec in MESHES:
        results["runs"][spec] = run_case(spec)
    results["runs"]["no_kl"] = run_case(MESHES[-1], iterations=1, beta=0.0)
    results["runs"]["split"] = run_case("data=2,fsdp=2", sampler_devices=4)
    for packing in ("on", "off"):  # completions that end at token 3: ragged lengths
        results["runs"][f"ragged_{packing}"] = run_case(
            MESHES[-1], iterations=2, eos_ids=(3,), packing=packing
        )
    results["runs"]["ragged_single"] = run_case(None, iterations=2, eos_ids=(3,), packing="off")
    results["runs"]["lora_single"] = run_case(None, iterations=2, lora_rank=4)
    results["runs"]["lora_mesh"] = run_case(MESHES[-1], iterations=2, lora_rank=4)
    results["lora_shards"] = _shard_shapes("data=2,fsdp=2,tensor=2", lora=True)
    results["attention_all_gathers"] = {
        "under_mesh": _attention_all_gathers(True),
        "no_mesh": _attention_all_gathers(False),
        "dense_under_mesh": _attention_all_gathers(True, "dense"),
    }
    results["seconds"] = time.perf_counter() - t0
    Path(out_path).write_text(json.dumps(results))


def cli_worker(out_path: str, cli_dir: str) -> None:
    """The command-line runs on sampler + trainer meshes, in a process of their own (apart, a
    hang here fails these two tests, not the eleven above): XLA:CPU's collectives deadlock now
    and then in them (``run_worker``'s ``rerun_on_deadlock``)."""
    use_compile_cache()
    results = {"cli": cli_run(Path(cli_dir)), "ppo_cli": cli_run(Path(cli_dir), "ppo")}
    Path(out_path).write_text(json.dumps(results))


# XLA:CPU aborts a process whose collective's participants have not all arrived after this long.
# A deadlock, not a slow device: one device of a program waits at its all-reduce on channel 1 while
# three wait at its all-gather on channel 74 and the fourth never comes, after 300 s as after 40 s
# (sessions 31 to 34: the GRPO or the PPO command-line run on sampler + trainer meshes, in full
# suites and once beside one other test process; five runs with nothing beside them did not). In
# the two programs of those runs that have both channels, the all-reduce is inside a while loop
# and the all-gather outside it or in another loop: XLA:CPU's runtime can reach them in
# different orders on different devices. Relax's programs are the ones a GPU or TPU runs.
COLLECTIVE_WAIT = "--xla_cpu_collective_call_terminate_timeout_seconds=120"
DEADLOCK = "Termination timeout for"  # XLA:CPU's message when it aborts a stuck collective


def worker_env(devices: int = 1) -> dict:
    flags = f"--xla_force_host_platform_device_count={devices} {COLLECTIVE_WAIT} {FAST_COMPILE}"
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}


def run_worker(
    script: Path,
    args: list[str],
    *,
    devices: int = 8,
    timeout: float = 900.0,
    rerun_on_deadlock: bool = False,
):
    """Run ``script args`` with ``devices`` simulated CPU devices; raise with its output on failure.
    (The mesh worker compiles every mesh's programs: 5+ minutes on a loaded 2-core host with a
    cold compile cache.) With ``rerun_on_deadlock`` (a worker that starts afresh when run again)
    a run XLA:CPU aborted at a deadlocked collective (``COLLECTIVE_WAIT``) is run once more, with
    a warning; any other failure, or a second deadlock, fails."""
    env = worker_env(devices)
    for attempt in range(2 if rerun_on_deadlock else 1):
        proc = subprocess.run(
            [sys.executable, str(script), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        if not (proc.returncode and DEADLOCK in proc.stderr and rerun_on_deadlock):
            break
        stuck = next(line for line in proc.stderr.splitlines() if DEADLOCK in line)
        warnings.warn(
            f"{script.name} {args}: XLA:CPU deadlocked ({stuck[-300:]}); run {attempt + 2}",
            stacklevel=2,
        )
    if proc.returncode:
        raise AssertionError(
            f"{script.name} {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


# ------------------------------------------------------------------ multi-device (subprocess)

if __name__ != "__main__":
    import jax
    import jax.numpy as jnp
    import pytest

    from relax import parallel
    from relax.models import ModelConfig, init
    from relax.parallel.mesh import MeshSpec, ShardingError

    @pytest.fixture(scope="module")
    def mesh_results(tmp_path_factory):
        d = tmp_path_factory.mktemp("mesh")
        make_cli_setup(d)
        run_worker(HERE, ["worker", str(d / "results.json"), str(d)], rerun_on_deadlock=True)
        return json.loads((d / "results.json").read_text())

    @pytest.fixture(scope="module")
    def cli_results(tmp_path_factory):
        d = tmp_path_factory.mktemp("cli")
        make_cli_setup(d)
        run_worker(HERE, ["cli_worker", str(d / "results.json"), str(d)], rerun_on_deadlock=True)
        return json.loads((d / "results.json").read_text())

    def _assert_metrics_close(got, want, what):
        assert set(got) == set(want), what
        for k in want:
            np.testing.assert_allclose(
                got[k], want[k], rtol=RTOL, atol=ATOL, err_msg=f"{what}: {k}"
            )

    @pytest.mark.slow
    def test_parameter_shards_have_the_expected_shapes(mesh_results):
        s = mesh_results["shards"][
            "data=2,fsdp=2,tensor=2"
        ]  # fsdp=2 splits D=32, tensor=2 heads/mlp/vocab
        expect = {
            ".policy.embed": [8, 16],
            ".policy.lm_head": [8, 16],
            ".policy.norm": [16],
            ".policy.layers.wq": [2, 16, 16],
            ".policy.layers.wk": [2, 16, 8],
            ".policy.layers.wo": [2, 16, 16],
            ".policy.layers.w_gate": [2, 16, 32],
            ".policy.layers.w_down": [2, 32, 16],
            ".policy.layers.attn_norm": [2, 16],
            ".policy.layers.bq": [2, 16],
            ".policy.layers.bk": [2, 8],
            ".policy.layers.bo": [2, 16],
            ".policy.layers.b_up": [2, 32],
            ".policy.layers.q_norm": [2, 8],
            ".ref.layers.wq": [2, 16, 16],
            ".step": [],
            ".key": [2],
        }
        for name, shard in expect.items():
            assert s[name][1] == shard, (name, s[name])
        # optimizer moments and float32 master weights are sharded exactly like their parameters
        moments = {
            k: v for k, v in s.items() if k.startswith(".opt_state") and k.endswith("layers.w_up")
        }
        assert len(moments) == 3 and all(v[1] == [2, 16, 32] for v in moments.values()), moments
        # under pure FSDP over 8 devices every array with a model-width (embed) axis is split 8
        # ways (parameters, moments, master weights, reference); only the per-layer vectors without
        # one (biases of the heads / MLP, q/k norms: L x heads) and scalars stay whole
        small = ("bq", "bk", "bv", "b_gate", "b_up", "q_norm", "k_norm")
        checked = 0
        for name, (shape, shard) in mesh_results["shards"]["fsdp=8"].items():
            if name.endswith(small) or len(shape) == 0 or name == ".key":
                continue
            assert np.prod(shard) * 8 == np.prod(shape), (name, shape, shard)
            checked += 1
        assert (
            checked == 5 * 14
        )  # policy, ref, master, mu, nu x the 14 parameters with an embed axis

    def _assert_same_run(run, base, what):
        for i in range(ITERATIONS):
            assert run["tokens"][i] == base["tokens"][i], (what, i)
            _assert_metrics_close(run["metrics"][i], base["metrics"][i], f"{what} iteration {i}")
        assert base["metrics"][0]["kl"] == 0.0 and run["metrics"][0]["kl"] == 0.0, (
            what
        )  # policy == reference
        for name, w in base["weights"][-1].items():
            np.testing.assert_allclose(
                run["weights"][-1][name], w, rtol=0, atol=WEIGHT_ATOL, err_msg=f"{what}: {name}"
            )

    @pytest.mark.slow
    def test_grpo_iteration_is_the_same_on_every_mesh(mesh_results):
        """Three iterations with the KL term and Adam's default eps (module docstring)."""
        runs = mesh_results["runs"]
        for spec in MESHES:
            _assert_same_run(runs[spec], runs["single"], spec)

    @pytest.mark.slow
    def test_lora_on_a_mesh_matches_one_device_and_shards_like_its_weights(mesh_results):
        runs = mesh_results["runs"]
        for i, want in enumerate(runs["lora_single"]["metrics"]):
            _assert_metrics_close(runs["lora_mesh"]["metrics"][i], want, f"lora iteration {i}")
        assert runs["lora_single"]["metrics"][0]["kl"] == 0.0  # B = 0: the policy is its base
        assert runs["lora_single"]["metrics"][1]["kl"] > 0.0
        np.testing.assert_array_equal(
            runs["lora_mesh"]["weights"][-1]["wq"], runs["lora_mesh"]["weights"][0]["wq"]
        )
        s = mesh_results[
            "lora_shards"
        ]  # A [L, D=32, r=4] splits D over fsdp; B [L, r, out] its out over tensor
        assert s[".policy.layers.lora.wq.a"] == [[2, 32, 4], [2, 16, 4]]
        assert s[".policy.layers.lora.wq.b"] == [[2, 4, 32], [2, 4, 16]]
        assert s[".policy.layers.lora.w_down.a"] == [[2, 64, 4], [2, 32, 4]]
        assert s[".policy.layers.lora.w_down.b"] == [[2, 4, 32], [2, 4, 16]]
        assert ".ref.layers.wq" not in s and not any(
            k.startswith(".opt_state") and k.endswith("layers.wq") for k in s
        )

    @pytest.mark.slow
    def test_kl_term_is_exactly_zero_while_the_policy_is_the_reference(mesh_results):
        """At the first iteration the policy is the reference: the KL term must add exactly
        nothing, so the weights after the step are bitwise those of a run without it. (Before,
        the reference log-probs came from another pass layout, and on a mesh the KL gradient was
        round-off that Adam turned into 1e-4 steps on embedding rows with no other gradient.)"""
        with_kl, without = mesh_results["runs"][MESHES[-1]], mesh_results["runs"]["no_kl"]
        assert with_kl["metrics"][0]["kl"] == 0.0
        for name, w in without["weights"][0].items():
            assert np.array_equal(np.asarray(with_kl["weights"][0][name]), np.asarray(w)), name

    @pytest.mark.slow
    def test_ragged_rollouts_on_a_mesh_equal_one_device(mesh_results):
        """Completions that end at token 3: the sampler compacts its decode batch (relax.rollout.
        compaction, rows a multiple of the 4 batch shards) on the mesh as on one device."""
        one, mesh = mesh_results["runs"]["ragged_single"], mesh_results["runs"]["ragged_off"]
        assert one["tokens"] == mesh["tokens"]
        for i, (got, want) in enumerate(zip(mesh["metrics"], one["metrics"])):
            _assert_metrics_close(got, want, f"ragged iteration {i}")

    @pytest.mark.slow
    def test_packed_update_on_a_mesh_equals_the_padded_one(mesh_results):
        """Completions packed across groups into bins (relax.models.forward.completion_packing) on
        the 3-axis mesh: the same samples and metrics as padded, over two iterations."""
        on, off = mesh_results["runs"]["ragged_on"], mesh_results["runs"]["ragged_off"]
        assert on["tokens"] == off["tokens"]
        assert on["metrics"][0]["pack_fill"] > 0.5, on["metrics"][0]  # packed
        for i, (got, want) in enumerate(zip(on["metrics"], off["metrics"])):
            _assert_metrics_close(
                {k: v for k, v in got.items() if not k.startswith("pack_")}, want, f"ragged {i}"
            )
        for name, w in off["weights"][-1].items():
            np.testing.assert_allclose(
                on["weights"][-1][name], w, rtol=0, atol=WEIGHT_ATOL, err_msg=name
            )

    @pytest.mark.slow
    def test_separate_sampler_and_trainer_meshes_match(mesh_results):
        split, base = mesh_results["runs"]["split"], mesh_results["runs"]["single"]
        assert split["segments"][:2] == [["weight_transfer"], ["rollout"]], split["segments"]
        _assert_same_run(split, base, "split")

    @pytest.mark.slow
    def test_cli_runs_on_sampler_and_trainer_meshes(cli_results):
        cli = cli_results["cli"]
        assert {"before", "after", "export"} <= set(cli["summary_keys"]) and cli["exported"]
        assert {
            "time/produce",
            "time/collect",
            "staleness",
            "is_weight_mean",
            "tokens_per_s",
            "loss",
        } <= set(cli["train_keys"])
        assert cli["checkpoints"] == ["1", "2"]

    @pytest.mark.slow
    def test_ppo_cli_runs_on_sampler_and_trainer_meshes(cli_results):
        """PPO's step (critic and reference sharded like the policy) runs on a mesh: it trains,
        checkpoints and exports, and logs its critic metrics."""
        cli = cli_results["ppo_cli"]
        assert cli["checkpoints"] == ["1", "2"] and cli["exported"]
        assert {
            "critic/vf_mse",
            "critic/grad_norm",
            "explained_variance",
            "time/weight_transfer",
        } <= set(cli["train_keys"])

    @pytest.mark.slow
    def test_training_attention_loops_over_local_groups_on_a_mesh(mesh_results):
        """Traced under the mesh, the per-group attention loop takes one local group per device:
        nothing is gathered. Outside it, the loop over the sharded prompt axis gathers. The dense
        (GPU) layout is per completion row: nothing is gathered either."""
        got = mesh_results["attention_all_gathers"]
        assert got["under_mesh"] == 0 and got["no_mesh"] > 0 and got["dense_under_mesh"] == 0, got

    @pytest.mark.slow
    def test_second_iteration_compiles_nothing(mesh_results):
        for name, run in mesh_results["runs"].items():
            if name == "no_kl":  # one iteration only
                continue
            assert run["compiles_after_first"] == 0, name  # explicit shardings: stable layouts

    # ------------------------------------------------------------------ in-process

    def test_rows_are_prompts_or_packed_rows():
        """A batch's rows (the axis split over the batch axes): its prompts, else its packed rows
        (an SFT batch), else none (a sharded step refuses it)."""
        from relax.data.packing import PackedBatch
        from relax.parallel.mesh import prompt_rows

        rows = np.zeros((6, 5), np.int32)
        assert prompt_rows({"prompt_ids": rows[:4], "ids": rows}) == 4
        assert prompt_rows(PackedBatch(ids=rows, segment_ids=rows, loss_mask=rows)) == 6
        assert prompt_rows({"tokens": rows}) is None
        mesh = parallel.make_mesh("data=1")
        placed = parallel.place_batch(PackedBatch(ids=rows, segment_ids=rows, loss_mask=rows), mesh)
        assert placed.ids.sharding.spec == parallel.batch_sharding(mesh).spec

    def test_mesh_spec_parsing():
        assert MeshSpec.parse("data=2,fsdp=4,tensor=1").shape == (
            2,
            1,
            4,
            1,
        )  # (data, expert, fsdp, tensor)
        assert MeshSpec.parse(" tensor=2 , data=2").shape == (2, 1, 1, 2)
        assert MeshSpec.parse("").shape == (1, 1, 1, 1)
        assert MeshSpec.parse("fsdp=-1,tensor=2").resolve(8).shape == (1, 1, 4, 2)
        assert str(MeshSpec.parse("fsdp=4")) == "data=1,expert=1,fsdp=4,tensor=1"
        for bad, msg in [
            ("data=2,model=2", "'model=2'"),
            ("data=x", "not an integer"),
            ("data=2,data=2", "twice"),
            ("data=0", "must be >= 1"),
            ("data=-1,fsdp=-1", "one may be -1"),
            ("data", "<axis>=<size>"),
        ]:
            with pytest.raises(ShardingError, match=msg):
                MeshSpec.parse(bad)

    def test_a_process_copy_keeps_the_model_axes_that_fit_its_devices():
        """``relax.parallel.local``: a process's own mesh keeps tensor, expert and fsdp where
        they divide its devices (a divisor of an axis a parameter splits over splits it too),
        replicates the rest over ``data``; on one process its mesh is the whole mesh."""
        from relax.parallel.local import local_mesh, local_shape

        want = {"data": 1, "expert": 1, "fsdp": 2, "tensor": 2}
        assert local_shape({"data": 2, "fsdp": 2, "tensor": 2}, 4) == want
        assert local_shape({"fsdp": 8}, 4) == {"data": 1, "expert": 1, "fsdp": 4, "tensor": 1}
        assert local_shape({"tensor": 8, "fsdp": 2}, 4)["tensor"] == 4
        assert local_shape({"tensor": 3, "fsdp": 2}, 4) == {
            "data": 2,
            "expert": 1,
            "fsdp": 2,
            "tensor": 1,
        }
        assert local_shape({"expert": 4, "tensor": 2, "fsdp": 2}, 8) == {
            "data": 1,
            "expert": 4,
            "fsdp": 1,
            "tensor": 2,
        }
        mesh = parallel.make_mesh("fsdp=-1")
        assert set(local_mesh(mesh).devices.flat) == set(mesh.devices.flat)

    def test_mesh_that_does_not_fit_the_devices_names_spec_and_count():
        n = jax.device_count()
        with pytest.raises(
            ShardingError,
            match=rf"mesh data=2,expert=1,fsdp={n},tensor=1 needs 2 x 1 x {n} x 1 = "
            rf"{2 * n} devices, but {n} ",
        ):  # whatever the device count
            parallel.make_mesh(f"data=2,fsdp={n}")
        with pytest.raises(ShardingError, match="do not divide"):
            MeshSpec.parse("data=3,fsdp=-1").resolve(8)
        assert parallel.make_mesh("fsdp=-1").shape == {
            "data": 1,
            "expert": 1,
            "fsdp": n,
            "tensor": 1,
        }

    def _abstract(data=1, fsdp=1, tensor=1):
        return jax.sharding.AbstractMesh((data, 1, fsdp, tensor), parallel.AXES)  # expert=1

    def test_every_parameter_has_logical_axes_and_default_specs():
        cfg = ModelConfig(**{**MODEL, "o_bias": True, "mlp_bias": True, "sandwich_norms": True})
        from relax.models.adapters.operations import add_lora
        from relax.models.layers.lora import LoRAConfig

        model = jax.eval_shape(
            lambda: add_lora(init(cfg, jax.random.key(0)), LoRAConfig(rank=2), jax.random.key(1))
        )
        from relax.models.config.sharding import LOGICAL_AXES, path_name

        names = {path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(model)}
        moe = ModelConfig(
            **{
                **MODEL,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "shared_expert_size": 16,
                "dense_layers": (0,),
            }
        )  # experts, shared expert, dense MLP
        with pytest.warns(
            UserWarning, match="router are not adapted"
        ):  # LoRA's all-linear on a MoE model
            moe_lora = jax.eval_shape(
                lambda: add_lora(
                    init(moe, jax.random.key(0)), LoRAConfig(rank=2), jax.random.key(1)
                )
            )
        names |= {path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(moe_lora)}
        assert names == set(
            LOGICAL_AXES
        )  # every parameter the model can have, LoRA factors and experts included
        mesh = _abstract(2, 2, 2)
        spec = lambda n: parallel.partition_spec(
            n,
            getattr(model.layers, n.split(".")[1]).shape if "." in n else getattr(model, n).shape,
            mesh,
            cfg,
        )
        P = jax.sharding.PartitionSpec
        assert spec("embed") == P("tensor", "fsdp") and spec("lm_head") == P("tensor", "fsdp")
        assert spec("layers.wq") == P(None, "fsdp", "tensor") and spec("layers.wo") == P(
            None, "tensor", "fsdp"
        )
        assert spec("layers.w_down") == P(None, "tensor", "fsdp") and spec("layers.q_norm") == P(
            None, None
        )
        assert spec("norm") == P("fsdp")
        assert parallel.partition_spec("layers.wq", (2, 32, 32), _abstract(8), cfg) == P(
            None, None, None
        )
        with pytest.raises(ShardingError, match="layers.extra has no logical axes"):
            parallel.partition_spec("layers.extra", (2, 3), mesh, cfg)

    @pytest.mark.parametrize(
        "mesh_kw, overrides, match",
        [
            (
                dict(tensor=3),
                dict(vocab_size=24),
                r"layers.wq \(2, 32, 32\): dimension 2 \(q_heads, 4 heads x 8\) does not split over mesh axis tensor=3",
            ),
            (
                dict(tensor=4),
                {},
                r"layers.wk \(2, 32, 16\): dimension 2 \(kv_heads, 2 heads x 8\) does not split over mesh axis tensor=4",  # noqa: E501
            ),
            (
                dict(fsdp=3),
                {},
                r"embed \(16, 32\): dimension 1 \(embed, size 32\) does not split over mesh axis fsdp=3",
            ),
            # 16 % 4 == 0 but 2 heads cannot be split 4 ways: the split must fall on head boundaries
            (
                dict(tensor=4),
                dict(num_heads=2, num_kv_heads=2, vocab_size=16),
                r"layers.wq .*2 heads x 8.*tensor=4",
            ),
            (
                dict(tensor=2),
                dict(vocab_size=15),
                r"embed \(15, 32\): dimension 0 \(vocab, size 15\).*tensor=2",
            ),
        ],
    )
    def test_axis_that_does_not_divide_its_dimension_names_parameter_dim_axis(
        mesh_kw, overrides, match
    ):
        from relax.models.config.sharding import path_name

        cfg = ModelConfig(**{**MODEL, **overrides})
        model = jax.eval_shape(lambda: init(cfg, jax.random.key(0)))
        mesh = _abstract(**mesh_kw)
        with pytest.raises(ShardingError, match=match):
            jax.tree_util.tree_map_with_path(
                lambda p, x: parallel.partition_spec(path_name(p), x.shape, mesh, cfg), model
            )

    def test_rules_can_replicate_a_logical_axis():
        rules = tuple((k, None) if k == "vocab" else (k, v) for k, v in parallel.DEFAULT_RULES)
        spec = parallel.partition_spec("embed", (15, 32), _abstract(tensor=2, fsdp=2), None, rules)
        assert spec == jax.sharding.PartitionSpec(None, "fsdp")

    def test_rule_naming_a_missing_mesh_axis_is_an_error_not_replication():
        rules = tuple((k, "fdsp") if k == "embed" else (k, v) for k, v in parallel.DEFAULT_RULES)
        with pytest.raises(
            ShardingError, match=r"rule 'embed' -> 'fdsp': the mesh has no axis 'fdsp'"
        ):
            parallel.partition_spec("embed", (16, 32), _abstract(fsdp=2), None, rules)

    def test_batch_that_does_not_split_over_data_fsdp_is_an_error():
        from relax.parallel.step import check_batch

        with pytest.raises(
            ShardingError, match=r"--batch-size=6 prompts do not split over data x fsdp = 4 x 1"
        ):
            check_batch(6, _abstract(data=4))
        check_batch(8, _abstract(data=4, tensor=2))

    def test_offload_reference_without_a_mesh_is_an_error_naming_the_flag():
        with pytest.raises(
            ValueError, match=r"--parallel.offload-reference needs a mesh.*--parallel.mesh"
        ):
            parallel.ParallelConfig(offload_reference=True)
        for ok in (
            dict(mesh="fsdp=-1"),
            dict(sampler_devices=1),
        ):  # a mesh: accepted (the step decides further)
            assert parallel.ParallelConfig(offload_reference=True, **ok).offload_reference

    def test_offload_reference_is_a_warned_no_op_on_cpu():
        from relax.algorithms.grpo.config import preset
        from relax.algorithms.grpo.step import make_grpo_step
        from relax.algorithms.online.step import StepParts
        from relax.passes import choose_passes
        from relax.train.optimizer import OptimizerConfig
        from relax.train.state import init_state

        cfg = preset("grpo", num_generations=2, max_new_tokens=2, beta=0.04)
        opt = OptimizerConfig().make()
        state = init_state(
            init(ModelConfig(**MODEL), jax.random.key(0)),
            opt,
            key=jax.random.key(1),
            with_reference=True,
        )
        mesh = parallel.make_mesh("fsdp=-1")
        step = make_grpo_step(
            cfg,
            StepParts(
                reward_fns=[fives],
                decode=_decode,
                eos_ids=(),
                pad_id=0,
                passes=choose_passes(batch_shards=parallel.batch_shards(mesh)),
            ),
        )
        with pytest.warns(
            UserWarning, match="offload_reference: cpu devices have no separate pinned_host"
        ):
            sharded = parallel.ShardedStep(step, state, mesh, offload_reference=True)
        assert not sharded.offload
        assert [s.names for s in sharded.segments] == [
            ("rollout",),
            ("score_start",),
            ("pack",),
            ("reference",),
            ("score_finish",),
            ("advantage", "update"),
        ]
        no_ref = init_state(
            init(ModelConfig(**MODEL), jax.random.key(0)), opt, key=jax.random.key(1)
        )
        with pytest.warns(UserWarning, match="offload_reference: the state has no reference model"):
            assert not parallel.ShardedStep(step, no_ref, mesh, offload_reference=True).offload

    @pytest.mark.slow
    def test_remat_gives_the_same_loss_and_gradients():
        from relax.algorithms.cli.configure import configure
        from relax.algorithms.grpo.config import GRPOConfig
        from relax.algorithms.grpo.loss import make_loss
        from relax.algorithms.online.batch import LossRows
        from relax.train.update import LossContext

        model = init(ModelConfig(**MODEL), jax.random.key(3), std=0.2)
        k = jax.random.split(jax.random.key(4), 3)
        p, g, n = 2, 3, 4
        ids, pm = global_batch()
        mask = jnp.ones((p, g, n), jnp.int32).at[0, 1, 2:].set(0)
        mb = LossRows(
            prompt_ids=jnp.asarray(ids[:p]),
            prompt_mask=jnp.asarray(pm[:p]),
            tokens=jax.random.randint(k[0], (p, g, n), 0, 16),
            mask=mask,
            loss_mask=mask,
            old_logprobs=-2.0 + 0.1 * jax.random.normal(k[1], (p, g, n)),
            advantages=jax.random.normal(k[2], (p, g)),
        )
        norms = LossContext(
            {"tokens": jnp.float32(20.0), "sequences": jnp.float32(6.0)}, jnp.bool_(False)
        )
        out, jaxprs = {}, {}
        for remat, policy in ((False, "nothing"), (True, "nothing"), (True, "dots")):
            cfg = configure(
                GRPOConfig, num_generations=g, max_new_tokens=n, remat=remat, remat_policy=policy
            )
            assert cfg.forward.remat == remat and cfg.forward.remat_policy == policy
            loss_fn = make_loss(cfg)
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            jaxprs[remat, policy] = jaxpr = str(jax.make_jaxpr(grad_fn)(model, mb, norms))
            out[f"remats{remat}"] = jaxpr.count("checkpoint[") + jaxpr.count("remat")
            out[remat, policy] = jax.jit(grad_fn)(model, mb, norms)
        assert out["rematsTrue"] > out["rematsFalse"]  # cfg.remat reaches the layer scan
        # cfg.remat_policy reaches the checkpoint
        dots = str(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        assert dots in jaxprs[True, "dots"] and dots not in jaxprs[True, "nothing"]
        (l0, _), g0 = out[False, "nothing"]
        for key in ((True, "nothing"), (True, "dots")):
            (l1, _), g1 = out[key]
            np.testing.assert_allclose(l1, l0, rtol=1e-6)
            for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=str(key))

    def test_master_weights_keep_steps_below_bfloat16_precision():
        import optax

        from relax.train.optimizer import OptimizerConfig, with_master_weights

        params = {"w": jnp.ones((3,), jnp.bfloat16)}
        grads = {"w": jnp.ones((3,), jnp.bfloat16)}
        results = {}
        for master in (False, True):
            opt = with_master_weights(optax.sgd(1e-4)) if master else optax.sgd(1e-4)
            p, s = params, opt.init(params)
            for _ in range(60):
                u, s = opt.update(grads, s, p)
                p = optax.apply_updates(p, u)
            results[master] = (p, s)
        assert (
            results[False][0]["w"].dtype == jnp.bfloat16 and float(results[False][0]["w"][0]) == 1.0
        )  # lost
        p, s = results[True]
        assert p["w"].dtype == jnp.bfloat16 and s.master["w"].dtype == jnp.float32
        np.testing.assert_allclose(s.master["w"], 1.0 - 60e-4, rtol=1e-5)
        assert np.all(
            np.asarray(p["w"]) == np.asarray(s.master["w"].astype(jnp.bfloat16))
        )  # exact rounding
        st = OptimizerConfig(master_weights=True).make().init(params)
        assert st.master["w"].dtype == jnp.float32 and int(st.total_notfinite) == 0

    @pytest.mark.slow
    def test_bfloat16_policy_with_float32_master_weights_trains():
        """The GRPO step end to end: the policy (rollout and forward) stays bfloat16, the optimizer
        holds float32 master weights, and the update moves them."""
        out = run_case(None, iterations=1, master_weights=True, param_dtype=jnp.bfloat16)
        m = out["metrics"][0]
        assert (
            out["policy_dtype"] == "bfloat16"
            and np.isfinite(m["loss"])
            and m["skipped_updates"] == 0
        )
        assert m["grad_norm"] > 0 and out["master_dtype"] == "float32" and out["master_moved"]


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "cli_worker":
        cli_worker(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1:]}")
