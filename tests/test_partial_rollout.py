"""Partial rollouts (``relax.rollout.partial``, ``AsyncConfig.partial``): a batch sampled over K
rollouts records each token's version and behaviour log-prob (checked against the trainer's
forward of that version's weights), every token is within the staleness bound, the correction
weighs each token by its own log-prob, and runs reproduce and resume bit for bit.

On meshes (this file run as a script with simulated CPU devices, ``worker`` modes): the stage
alone samples one device's tokens on sharded weights (fast); GRPO with partial rollouts on
``data=2,fsdp=2,tensor=2`` and on separate sampler devices equals one device, and resumes exactly
(slow). tests/test_multihost.py runs ``grpo_case`` on two processes."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_parallel as tp
from test_parallel import _decode, fives
from test_pipeline import Batches, _assert_same
from test_train import CFG

from relax.algorithms.grpo.config import preset
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.batch import HostRecord, step_input
from relax.algorithms.online.step import StepParts
from relax.models import ModelConfig, init
from relax.models.forward.prefix_shared import completion_logprobs
from relax.objectives.off_policy import OffPolicyConfig
from relax.rollout.partial import PartialRequest, PartialRollouts
from relax.rollout.sampler import RolloutConfig
from relax.rollout.sampling import SamplingConfig
from relax.train.optimizer import OptimizerConfig
from relax.train.pipeline import AsyncConfig, Pipeline
from relax.train.state import init_state

EOS = 3
HERE = Path(__file__).resolve()


def _partial(k: int, n: int = 8, g: int = 4) -> PartialRollouts:
    cfg = RolloutConfig(
        num_generations=g,
        max_new_tokens=n,
        sampling=SamplingConfig(temperature=1.0),
        eos_ids=(EOS,),
        pad_id=0,
    )
    return PartialRollouts(
        Batches(),
        lambda w: (np.asarray(w.device.prompt_ids), np.asarray(w.device.prompt_mask), w.host),
        cfg,
        k,
        encode=lambda r: {"prompts": r.prompts, "fields": r.fields},
        decode=lambda d: (
            Batches().__next__().host.replace(prompts=d["prompts"], fields=d["fields"])
        ),
    )


def _forward(policy, done) -> np.ndarray:
    return np.asarray(
        completion_logprobs(
            policy,
            jnp.asarray(done.prompt_ids),
            jnp.asarray(done.prompt_mask),
            jnp.asarray(done.tokens),
            jnp.asarray(done.mask),
            temperature=1.0,
        )
    )


@pytest.mark.parametrize(
    "s,n,k",
    [
        (s, n, k)
        for s in range(1, 5)
        for n in range(1, s + 2)
        for k in range(2, 5)
        if s + 1 - n - (k - 1) >= 0
    ],
)
def test_partial_schedule_keeps_every_token_within_the_bound(s, n, k):
    cfg = AsyncConfig(staleness=s, push_every=n, partial=k)
    assert cfg.depth == s + 1 - n - (k - 1) >= 0
    for i in range(40):
        oldest, newest = cfg.oldest_version(i), cfg.version(i)
        assert oldest <= newest and 0 <= i - oldest <= s
        assert newest <= max(0, i - cfg.depth)  # the rollout of batch i runs once its weights exist
    assert max(cfg.histogram(40)) <= s


def test_partial_needs_staleness_for_its_chunks():
    with pytest.raises(ValueError, match="--async.partial 3 .* needs --async.staleness >= 2"):
        AsyncConfig(staleness=1, partial=3)
    with pytest.raises(ValueError, match="must divide"):
        _partial(3, n=8)


@pytest.mark.slow
def test_partial_rollouts_record_each_tokens_version_and_behaviour_log_prob():
    """Batch 1's first chunk is sampled by policy A (version 0), its second by policy B (version
    1): each token's log-prob is the trainer's forward of the weights its version names."""
    a, b = init(CFG, jax.random.key(0), std=0.3), init(CFG, jax.random.key(5), std=0.3)
    partial, key = _partial(2), jax.random.key(7)
    first = partial.produce(a, 0, key, PartialRequest(0))
    assert (
        partial.last["partial/calls"] == 2 and len(partial.in_progress) == 1
    )  # the warm-up: K calls
    second = partial.produce(b, 1, key, PartialRequest(1))
    assert partial.last["partial/calls"] == 1
    for done, policies in ((first, {0: a}), (second, {0: a, 1: b})):
        sampled = done.versions >= 0
        np.testing.assert_array_equal(sampled, done.mask > 0)
        assert not done.running.any()  # every completion stopped or holds N tokens
        ends = done.tokens[
            np.arange(done.tokens.shape[0])[:, None],
            np.arange(done.tokens.shape[1]),
            np.maximum(done.lengths - 1, 0),
        ]
        np.testing.assert_array_equal(ends[done.finished], EOS)
        assert set(np.unique(done.versions[sampled]).tolist()) == set(policies)
        for version, policy in policies.items():
            here = done.versions == version
            np.testing.assert_allclose(done.logprobs[here], _forward(policy, done)[here], atol=1e-4)
    # chunk 1 (tokens 0..3) by A, chunk 2 (4..7) by B wherever a completion ran past 4 tokens
    long = second.lengths > 4
    assert long.any() and (second.versions[..., :4][second.mask[..., :4] > 0] == 0).all()
    assert (second.versions[long][:, 4:][second.mask[long][:, 4:] > 0] == 1).all()
    with pytest.raises(RuntimeError, match="in order"):
        partial.produce(b, 1, key, PartialRequest(5))


@pytest.mark.slow
def test_partial_state_round_trips_through_json_and_resumes_exactly():
    a = init(CFG, jax.random.key(0), std=0.3)
    partial, key = _partial(4), jax.random.key(3)
    for i in range(2):
        partial.produce(a, i, key, PartialRequest(i))
    saved = json.loads(json.dumps(partial.get_state()))
    later = [partial.produce(a, i, key, PartialRequest(i)) for i in (2, 3)]
    resumed = _partial(4)
    resumed.set_state(saved)
    assert next(resumed) == PartialRequest(2)
    for i, done in zip((2, 3), later):
        again = resumed.produce(a, i, key, PartialRequest(i))
        for f in ("tokens", "logprobs", "versions", "lengths", "finished", "prompt_ids"):
            np.testing.assert_array_equal(getattr(again, f), getattr(done, f))
        assert again.record.prompts == done.record.prompts


ASYNC = AsyncConfig(staleness=2, partial=2, correction=OffPolicyConfig(kind="decoupled"))  # depth 1


def _grpo(partial: PartialRollouts):
    cfg = preset(
        "grpo",
        num_generations=4,
        max_new_tokens=8,
        beta=0.04,
        optimizer=OptimizerConfig(learning_rate=3e-2),
    )
    state = init_state(
        init(CFG, jax.random.key(0), std=0.3),
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=True,
    )
    step = make_grpo_step(
        cfg,
        StepParts(
            reward_fns=[fives],
            decode=_decode,
            eos_ids=(EOS,),
            pad_id=0,
            off_policy=ASYNC.off_policy,
            pipelined=True,
            partial=partial,
        ),
    )
    return state, step


def _run(partial, state, step, start, steps, views=None):
    pipeline = Pipeline(step.segments, ASYNC, partial, lambda r: r, views=views)
    states, outs, saved = [], [], {}
    for j, (state, out, _timings) in enumerate(pipeline.run(state, start, steps), start):
        states.append(jax.tree.map(jnp.copy, state))
        outs.append(out)
        saved[j + 1] = (
            pipeline.saved_views(state, j + 1, steps),
            json.loads(json.dumps(pipeline.data_state(j + 1))),
        )
    return states, outs, saved


@pytest.mark.slow
def test_pipelined_partial_rollouts_reproduce_weigh_each_token_and_resume():
    partial = _partial(2)
    state0, step = _grpo(partial)
    states, outs, saved = _run(partial, jax.tree.map(jnp.copy, state0), step, 0, 5)
    states = [state0] + states
    for j, out in enumerate(outs):
        batch, m = out.device.batch, np.asarray(out.device.batch.loss_mask) > 0
        versions = np.asarray(batch.token_versions)
        assert versions[m].min() == ASYNC.oldest_version(j) and versions[m].max() <= ASYNC.version(
            j
        )
        assert j - versions[m].min() <= ASYNC.staleness
        # each token's behaviour log-prob is its own version's; the weights are exp(prox - behaviour) per token
        behaviour = np.zeros(m.shape, np.float32)
        for v in np.unique(versions[m]):
            fwd = np.asarray(
                completion_logprobs(
                    states[v].policy,
                    batch.prompt_ids,
                    batch.prompt_mask,
                    batch.tokens,
                    batch.mask,
                    temperature=1.0,
                )
            )
            behaviour = np.where(versions == v, fwd, behaviour)
        np.testing.assert_allclose(np.asarray(batch.old_logprobs)[m], behaviour[m], atol=1e-4)
        prox = np.asarray(
            completion_logprobs(
                states[j].policy,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.tokens,
                batch.mask,
                temperature=1.0,
            )
        )
        rho = np.exp(prox - np.asarray(batch.old_logprobs))[m]
        metrics = out.device.metrics
        np.testing.assert_allclose(
            [metrics["is_weight_mean"], metrics["is_weight_min"], metrics["is_weight_max"]],
            [rho.mean(), rho.min(), rho.max()],
            rtol=2e-4,
        )
        assert out.host.partial["partial/calls"] == (2 if j == 0 else 1)
    assert any(out.host.partial["partial/mixed_version_frac"] > 0 for out in outs[1:])
    # the same run again: bit for bit
    partial_b = _partial(2)
    again, _, _ = _run(partial_b, *_grpo(partial_b), 0, 5)
    for x, y in zip(states[1:], again):
        _assert_same(x, y)
    # resumed from the checkpoint of step 2 (its state, sampler copies and data position): the same updates
    views, data = saved[2]
    resumed = _partial(2)
    resumed.set_state(data)
    _, step_r = _grpo(resumed)
    live = ASYNC.live_versions(2, 5)
    tail, _, _ = _run(resumed, states[2], step_r, 2, 5, views=dict(zip(live, views)))
    for x, y in zip(states[3:], tail):
        _assert_same(x, y)


def test_partial_rollouts_refuse_what_they_do_not_support():
    from relax.algorithms.agent.run import AgentRunConfig

    with pytest.raises(ValueError, match="--async.partial: partial rollouts are single-turn"):
        AgentRunConfig(async_=AsyncConfig(staleness=1, partial=2))
    partial = _partial(2)
    cfg = preset(
        "grpo", num_generations=4, max_new_tokens=6
    )  # not the partial rollouts' budget of 8
    with pytest.raises(
        ValueError, match="partial rollouts run pipelined, with the step's own sampler config"
    ):
        make_grpo_step(
            cfg,
            StepParts(
                reward_fns=[fives],
                decode=_decode,
                eos_ids=(EOS,),
                pad_id=0,
                pipelined=True,
                partial=partial,
            ),
        )


@pytest.mark.slow
def test_ppo_with_partial_rollouts_trains_on_mixed_versions():
    """PPO (critic, two epochs: a proximal forward) on batches sampled over two rollouts."""
    from relax.algorithms.cli.configure import configure
    from relax.algorithms.ppo.config import PPOConfig
    from relax.algorithms.ppo.step import make_ppo_step
    from relax.models.heads.critic import init_critic

    cfg = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=8,
        kl_coef=0.05,
        num_iterations=2,
        optimizer=OptimizerConfig(learning_rate=3e-2),
        critic_optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    policy = init(CFG, jax.random.key(0), std=0.3)
    state = init_state(
        policy,
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=True,
        critic=init_critic(policy),
        critic_optimizer=cfg.critic_optimizer.make(),
    )
    partial = _partial(2)
    step = make_ppo_step(
        cfg,
        StepParts(
            reward_fns=[fives],
            decode=_decode,
            eos_ids=(EOS,),
            pad_id=0,
            off_policy=ASYNC.off_policy,
            pipelined=True,
            partial=partial,
        ),
    )
    outs = [
        out for _, out, _ in Pipeline(step.segments, ASYNC, partial, lambda r: r).run(state, 0, 3)
    ]
    for j, out in enumerate(outs):
        versions = np.asarray(out.device.batch.token_versions)[
            np.asarray(out.device.batch.mask) > 0
        ]
        assert versions.min() == ASYNC.oldest_version(j) and versions.max() <= ASYNC.version(j)
        assert np.isfinite(float(out.device.metrics["loss"])) and np.isfinite(
            float(out.device.metrics["critic/vf_loss"])
        )
    assert float(outs[2].device.metrics["is_weight_max"]) != 1.0  # the stale tokens are weighted


# ------------------------------------------------------------------ on meshes (subprocess workers)


def stage_worker(out: str) -> None:
    """Three partial rollouts (policies a, b, a) on one device and on ``fsdp=2,tensor=2`` (the
    weights sharded, the rows split 2 ways), and the error of a mesh whose batch axes do not
    divide the prompts."""
    from relax import parallel

    tp.use_compile_cache()
    a, b = init(CFG, jax.random.key(0), std=0.3), init(CFG, jax.random.key(5), std=0.3)
    results = {}
    for name, mesh in (("one", None), ("mesh", parallel.make_mesh("fsdp=2,tensor=2"))):
        partial, key = _partial(2), jax.random.key(7)
        place = (lambda m: m) if mesh is None else (lambda m: parallel.shard_model(m, mesh))
        done = [
            partial.produce(place(p), i, key, PartialRequest(i)) for i, p in enumerate((a, b, a))
        ]
        fields = ("tokens", "logprobs", "versions", "lengths", "finished")
        results[name] = {f: [getattr(d, f).tolist() for d in done] for f in fields}
    try:
        _partial(2).produce(
            parallel.shard_model(a, parallel.make_mesh("data=4")), 0, key, PartialRequest(0)
        )
    except ValueError as e:
        results["error"] = str(e)
    Path(out).write_text(json.dumps(results))


@pytest.mark.slow
def test_partial_rollouts_on_sharded_weights_sample_one_devices_tokens(tmp_path):
    """The stage alone on 4 simulated devices: weights over ``fsdp=2,tensor=2``, each batch's rows
    (and the continued rows, padded to a multiple of 2) split over fsdp: one device's tokens,
    versions and lengths exactly, its log-probs to rounding; 2 prompts on ``data=4`` are an error
    naming the axis."""
    tp.run_worker(HERE, ["stage", str(tmp_path / "out.json")], devices=4, timeout=300)
    r = json.loads((tmp_path / "out.json").read_text())
    for f in ("tokens", "versions", "lengths", "finished"):
        assert r["mesh"][f] == r["one"][f], f
    np.testing.assert_allclose(r["mesh"]["logprobs"], r["one"]["logprobs"], atol=1e-5)
    assert "2 prompts do not split over the batch axes data=4" in r["error"]


MESH_STEPS, RESUME_AT = 3, 2


class MeshPrompts:
    """test_parallel's 8 prompts, rolled by one row per batch, this process's ``rows`` of them;
    ``get_state`` / ``set_state``."""

    def __init__(self, rows: slice = slice(None)):
        self.rows, self.position = rows, 0

    def __next__(self):
        ids, mask = (np.roll(x, self.position, axis=0) for x in tp.global_batch())
        weights = np.roll([1.0 + i / 8 for i in range(tp.PROMPTS)], self.position)
        self.position += 1
        r = self.rows
        names = [f"p{i}" for i in range(tp.PROMPTS)][r]
        return step_input(ids[r], mask[r], names, {"weight": weights[r].tolist()})

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = state["position"]


def _sharded_grpo(mesh, sampler_devices: int, rows: slice, state=None):
    """``(state, step, partial)``: GRPO with partial rollouts of this process's ``rows`` on
    test_parallel's model, on the meshes asked for (``ShardedStep``; none: one device), from
    ``state`` (None: a new one)."""
    from relax import parallel
    from relax.passes import choose_passes

    cfg = preset(
        "grpo",
        num_generations=4,
        max_new_tokens=6,
        beta=0.04,
        optimizer=OptimizerConfig(learning_rate=tp.LEARNING_RATE),
    )
    if state is None:
        policy = init(ModelConfig(**tp.MODEL), jax.random.key(0), std=0.1)
        state = init_state(policy, cfg.optimizer.make(), key=jax.random.key(1), with_reference=True)
    trainer, sampler = parallel.ParallelConfig(mesh=mesh, sampler_devices=sampler_devices).meshes()
    partial = PartialRollouts(
        MeshPrompts(rows),
        lambda w: (np.asarray(w.device.prompt_ids), np.asarray(w.device.prompt_mask), w.host),
        cfg.generation.rollout(eos_ids=(EOS,), pad_id=0),
        2,
        encode=lambda r: {"prompts": r.prompts, "fields": r.fields},
        decode=lambda d: HostRecord(prompts=d["prompts"], fields=d["fields"]),
    )
    shards = 1 if trainer is None else parallel.batch_shards(trainer)
    parts = StepParts(
        reward_fns=[fives],
        decode=_decode,
        eos_ids=(EOS,),
        passes=choose_passes(batch_shards=shards),
        off_policy=ASYNC.off_policy,
        pipelined=True,
        partial=partial,
    )
    step = make_grpo_step(cfg, parts)
    if trainer is not None:
        step = parallel.ShardedStep(step, state, trainer, sampler_mesh=sampler)
        state = step.place(state)
    return state, step, partial


def _updates(partial, step, state, start: int, stop: int, views=None):
    """Updates ``start .. stop - 1`` of a pipelined run of ``MESH_STEPS``: ``(state, out, saved)``,
    ``out`` each update's metrics and this process's tokens, ``saved`` what a checkpoint after
    ``stop`` holds besides the state (the sampler's copies; the data state, through JSON)."""
    from relax.parallel.distributed import to_local

    pipeline = Pipeline(step.segments, ASYNC, partial, lambda r: r, views=views)
    run, out = pipeline.run(state, start, MESH_STEPS), {"metrics": [], "tokens": []}
    for _ in range(start, stop):
        state, batch, _ = next(run)
        out["metrics"].append({k: float(v) for k, v in batch.device.metrics.items()})
        out["tokens"].append(to_local(batch.device.batch.tokens).tolist())
    data = json.loads(json.dumps(pipeline.data_state(stop)))
    return state, out, (pipeline.saved_views(state, stop, MESH_STEPS), data)


def grpo_case(mesh=None, *, sampler_devices=0, rows=slice(None), resume_at=None) -> dict:
    """``MESH_STEPS`` GRPO updates with partial rollouts (``ASYNC``), sharded as asked; with
    ``resume_at`` the run stops after that many updates and a new one (a new step and data
    iterator) resumes from what a checkpoint holds. Each update's metrics and this process's
    tokens, the data state where it stopped (every process must hold the same) and the segments.
    """
    state, step, partial = _sharded_grpo(mesh, sampler_devices, rows)
    state, out, (views, data) = _updates(partial, step, state, 0, resume_at or MESH_STEPS)
    if resume_at is not None:
        state, step, partial = _sharded_grpo(mesh, sampler_devices, rows, state)
        partial.set_state(data)
        live = dict(zip(ASYNC.live_versions(resume_at, MESH_STEPS), views))
        _, tail, _ = _updates(partial, step, state, resume_at, MESH_STEPS, live)
        out = {k: out[k] + tail[k] for k in out}
    return {**out, "data_state": data, "segments": [seg.names for seg in step.segments]}


def grpo_worker(out: str) -> None:
    tp.use_compile_cache()
    mesh = tp.MESHES[-1]  # data=2,fsdp=2,tensor=2
    results = {
        "single": grpo_case(),
        "mesh": grpo_case(mesh),
        "resumed": grpo_case(mesh, resume_at=RESUME_AT),
        "split": grpo_case("data=2,fsdp=2", sampler_devices=4),
    }
    Path(out).write_text(json.dumps(results))


def assert_same_updates(got: dict, want: dict, what: str, rtol=2e-4, atol=2e-5) -> None:
    """Tokens equal, metrics equal to ``rtol`` / ``atol``, update by update."""
    assert len(got["tokens"]) == len(want["tokens"]) == MESH_STEPS, what
    for i, (g, w) in enumerate(zip(got["metrics"], want["metrics"])):
        assert got["tokens"][i] == want["tokens"][i], (what, i)
        assert set(g) == set(w), (what, i)
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=rtol, atol=atol, err_msg=f"{what} {i}: {k}")


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("partial_mesh") / "runs.json"
    tp.run_worker(HERE, ["grpo", str(out)], timeout=900)
    return json.loads(out.read_text())


@pytest.mark.slow  # one 8-device worker: four pipelined GRPO runs
def test_grpo_with_partial_rollouts_on_a_mesh_equals_one_device(mesh_runs):
    """``--async.partial 2`` on ``data=2,fsdp=2,tensor=2``, and sampled on 4 devices of their
    own (trained on ``data=2,fsdp=2``): one device's tokens, its metrics to rounding."""
    single = mesh_runs["single"]
    assert single["metrics"][1]["is_weight_max"] != 1.0  # stale tokens, weighed
    # on its own devices the rollout samples on the sampler's copy of the weights
    assert mesh_runs["split"]["segments"][:2] == [["weight_transfer"], ["rollout"]]
    for name in ("mesh", "split"):
        assert_same_updates(mesh_runs[name], single, name)


@pytest.mark.slow  # the same worker
def test_partial_rollouts_on_a_mesh_resume_exactly(mesh_runs):
    """Stopped after 2 updates (a batch in progress in the data state) and resumed on the
    mesh by a new step and data iterator: the uninterrupted run, bit for bit."""
    assert mesh_runs["resumed"]["data_state"]["in_progress"]
    assert_same_updates(mesh_runs["resumed"], mesh_runs["mesh"], "resumed", rtol=0, atol=0)


if __name__ == "__main__":
    {"stage": stage_worker, "grpo": grpo_worker}[sys.argv[1]](sys.argv[2])
