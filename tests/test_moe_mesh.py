"""Expert parallelism (relax.models.moe.expert_parallel): a tiny mixture of experts on meshes with an
``expert`` axis (alone, with data, with fsdp and tensor) against one device: the training
forward's log-probs and gradients, the GRPO step's metrics, the sampler's tokens; the compiled
programs' collectives (``relax.parallel.hlo.collectives``) per sparse layer; the sharding rules.

Collectives of one sparse layer over ``expert`` (``nl`` rows per device, ``ep`` the axis size,
``D`` the width, ``k`` the experts per token), read from the HLO::

    forward   all-gather [ep nl, D] (rows), [ep nl, k] s32 (experts), [ep nl, k] (weights);
              reduce-scatter [nl, D] (expert outputs)
    backward  all-gather [ep nl, D] (output cotangent); reduce-scatter [nl, D] (input
              cotangent) and [nl, k] (routing weights' cotangent)

and nothing gathers the experts' weights over ``expert`` (over ``fsdp`` their width D is
gathered as every FSDP weight is). Two things beside the exchange are the partitioner's, not
the expert layer's (printed by ``-s``): the router's top-k input ``[rows, E]`` is gathered over
all batch axes (``moe.route``'s ``top_k`` on sharded rows), and with ``fsdp`` the prompts'
embedding lookup (a table split along D) is resharded to rows through a full
rematerialization (XLA's "Involuntary full rematerialization" warning).

The GRPO step's routing metrics (load ratios, z-loss) are per micro-batch, then averaged: one
CPU device splits the update by prompt group (``relax.passes``), a mesh does not, so they are
compared with one device running the mesh's passes (everything else with both).

Eight simulated devices: one subprocess (this file as a script) computes everything and writes
JSON, as tests/test_parallel.py does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    dense_layers=(1,),
    max_position_embeddings=128,
)
# Every expert on its own device, and the three-axis mesh (experts split two ways, the batch over
# fsdp, heads and MLP over tensor). A data axis is a batch axis as fsdp is (``batch_shards``): the
# third mesh the suite once ran here, ``expert=4,data=2``, took the same code path.
MESHES = ("expert=8", "expert=2,fsdp=2,tensor=2")
P, LP, G, N = (
    8,
    6,
    2,
    5,
)  # the forward's prompts, prompt length, completions per prompt, completion length
RTOL, ATOL = 1e-4, 1e-5
SPARSE_LAYERS = 2  # layers 0 and 2 (layer 1 is dense)
STOPS = tuple(range(1, 64, 6))  # a sixth of the vocabulary: completions of ragged lengths


def _model():
    import jax

    from relax.models.config.model import ModelConfig
    from relax.models.decoder import transformer as T

    return T.init(ModelConfig(**TINY), jax.random.key(0), std=0.2)


def _counts(counter) -> list:
    """A ``relax.parallel.hlo.collectives`` counter as JSON rows ``[op, shape, axes, count]``."""
    return sorted([op, shape, list(axes), n] for (op, shape, axes), n in counter.items())


def _forward_inputs():
    import jax
    import jax.numpy as jnp

    ids = jax.random.randint(jax.random.key(1), (P, LP), 1, TINY["vocab_size"])
    pm = jnp.ones_like(ids).at[1, :2].set(0).at[6, :4].set(0)
    comp = jax.random.randint(jax.random.key(2), (P, G, N), 1, TINY["vocab_size"])
    cm = jnp.ones_like(comp).at[0, 1, 3:].set(0).at[5, 0, 1:].set(0)
    return ids, pm, comp, cm


def forward_cases() -> dict:
    """``sum(log-probs)`` and its gradient (``completion_logprobs``) on one device and on each
    mesh: the largest differences per leaf, the meshes' collectives; and the forward one prompt
    group per pass (rows that do not split over the devices: padded in the exchange)."""
    import jax
    import jax.numpy as jnp

    from relax import parallel
    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs
    from relax.parallel.hlo import collectives

    model, args = _model(), _forward_inputs()

    def loss(m, ids, pm, comp, cm, groups=None):
        how = ForwardPass(attention="group", groups_per_pass=groups)
        lp = completion_logprobs(m, ids, pm, comp, cm, how)
        return jnp.sum(lp * cm), lp

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, lp0), g0 = grad(model, *args)
    one_group = jax.jit(lambda *a: loss(*a, groups=1)[1])
    out = {}
    for spec in MESHES:
        mesh = parallel.make_mesh(spec)
        rows = parallel.batch_sharding(mesh)
        placed = (parallel.shard_model(model, mesh), *(jax.device_put(a, rows) for a in args))
        with jax.set_mesh(mesh):
            (_, lp), g = grad(*placed)
            text = grad.lower(*placed).compile().as_text()
            lp1 = one_group(*placed)
        leaves = jax.tree_util.tree_leaves_with_path(g0)
        out[spec] = {
            "logprobs": float(jnp.max(jnp.abs(lp - lp0))),
            "one_group": float(jnp.max(jnp.abs(lp1 - lp0))),
            "grads": {
                jax.tree_util.keystr(p): [
                    float(jnp.max(jnp.abs(a - b))),
                    float(jnp.max(jnp.abs(b))),
                ]
                for (p, b), a in zip(leaves, jax.tree.leaves(g))
            },
            "collectives": _counts(collectives(text, dict(mesh.shape))),
        }
    return out


def lora_case(spec: str) -> dict:
    """A shared expert (Qwen2-MoE's) and LoRA on every adaptable weight (attention, the dense
    layer's MLP, the shared expert and its gate): the log-probs and the adapters' gradients on
    ``spec`` against one device (the adapters shard like their weights: relax.models.config.sharding)."""
    import dataclasses

    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from relax import parallel
    from relax.models.adapters.operations import add_lora, split_trainable
    from relax.models.config.model import ModelConfig
    from relax.models.decoder import transformer as T
    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs
    from relax.models.layers.lora import LoRAConfig

    cfg = ModelConfig(**TINY, family="qwen2_moe", shared_expert_size=24)
    model = add_lora(T.init(cfg, jax.random.key(0), std=0.2), LoRAConfig(rank=2), jax.random.key(1))
    ad = model.layers.lora
    model = dataclasses.replace(
        model, layers=dataclasses.replace(model.layers, lora=jax.tree.map(lambda x: x + 0.05, ad))
    )  # B != 0: the adapters change the forward
    args = _forward_inputs()

    def loss(trained, frozen, ids, pm, comp, cm):
        lp = completion_logprobs(
            eqx.combine(trained, frozen), ids, pm, comp, cm, ForwardPass(attention="group")
        )
        return jnp.sum(lp * cm), lp

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, lp0), g0 = grad(*split_trainable(model), *args)
    mesh = parallel.make_mesh(spec)
    rows = parallel.batch_sharding(mesh)
    with jax.set_mesh(mesh):
        (_, lp), g = grad(
            *split_trainable(parallel.shard_model(model, mesh)),
            *(jax.device_put(a, rows) for a in args),
        )
    leaves = jax.tree_util.tree_leaves_with_path(g0)
    return {
        "logprobs": float(jnp.max(jnp.abs(lp - lp0))),
        "adapted": sorted(ad.weights()),
        "grads": {
            jax.tree_util.keystr(p): [float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(b)))]
            for (p, b), a in zip(leaves, jax.tree.leaves(g))
        },
    }


def _fives(prompts, completions, **fields):
    return [c.split().count("5") / 6 for c in completions]


def _decode(tokens, mask):
    return [" ".join(str(t) for t, m in zip(row, mr) if m) for row, mr in zip(tokens, mask)]


def grpo_case(spec: str | None, iterations: int = 2, *, mesh_passes: bool = False) -> dict:
    """``iterations`` of the composed GRPO step (routing replay, KL term) on one device or on
    ``spec`` (``ShardedStep``): metrics and tokens per iteration; on a mesh the collectives of
    the compiled update segment. ``mesh_passes``: one device with a mesh's passes (the update in
    one micro-batch, not one per prompt group as ``choose_passes`` gives one CPU device)."""
    import jax

    from relax import parallel
    from relax.algorithms.grpo.config import preset
    from relax.algorithms.grpo.step import make_grpo_step
    from relax.algorithms.online.batch import step_input
    from relax.algorithms.online.step import StepParts
    from relax.data.completion_layout import PackingConfig
    from relax.parallel import distributed
    from relax.parallel.hlo import collectives
    from relax.passes import choose_passes
    from relax.train.optimizer import OptimizerConfig
    from relax.train.state import init_state

    # eps=1: Adam's first step ~ lr * g. With a small eps a gradient component within float noise
    # of 0 moves its weight by +-lr on a sign set by rounding, and the meshes' second samples part
    # at a near-tie (an AMD EPYC host did)
    cfg = preset(
        "grpo",
        num_generations=4,
        max_new_tokens=6,
        beta=0.04,
        # padded: the update's exchange is counted on its [P, G, N] rows (the bins' layout has others)
        packing=PackingConfig(mode="off"),
        optimizer=OptimizerConfig(learning_rate=0.1, eps=1.0),
    )
    state = init_state(_model(), cfg.optimizer.make(), key=jax.random.key(1), with_reference=True)
    mesh = None if spec is None else parallel.make_mesh(spec)
    step = make_grpo_step(
        cfg,
        StepParts(
            reward_fns=[_fives],
            decode=_decode,
            eos_ids=(),
            pad_id=0,
            passes=choose_passes(
                batch_shards=8
                if mesh_passes
                else 1
                if mesh is None
                else parallel.batch_shards(mesh)
            ),
        ),
    )
    if mesh is not None:
        step = parallel.ShardedStep(step, state, mesh)
        state = step.place(state)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, TINY["vocab_size"], (8, 7)).astype(
        np.int32
    )  # 7: no activation shaped like [E, ...]
    mask = np.ones_like(ids)
    mask[1, :3] = mask[4, :5] = 0
    out = {"metrics": [], "tokens": []}
    for i in range(iterations):
        batch = step_input(ids, mask, [f"p{j}" for j in range(8)], {})
        for seg in step.segments:
            if i == 0 and mesh is not None and "update" in seg.names:
                with jax.set_mesh(mesh):
                    text = seg.jitted.lower(*seg.abstract(state, batch)).compile().as_text()
                out["update_collectives"] = _counts(collectives(text, dict(mesh.shape)))
            state, batch = seg.run(state, batch)
        out["metrics"].append({k: float(v) for k, v in batch.device.metrics.items()})
        out["tokens"].append(distributed.to_local(batch.device.batch.tokens).tolist())
    return out


def sampler_case(spec: str | None, eos_ids: tuple[int, ...] = ()) -> dict:
    """The sampler (routes recorded) on one device or ``spec``: tokens, log-probs, routes, and on a
    mesh the decode loops' collectives (``loop_ops``) and the program's by mesh axis. With
    ``eos_ids`` rows end at different steps and the decode batch compacts (relax.rollout.compaction)."""
    import jax
    import jax.numpy as jnp

    from relax import parallel
    from relax.parallel.hlo import COLLECTIVES, collectives, loop_ops
    from relax.rollout.sampler import RolloutConfig, compiled_generate

    model = _model()
    ids = jax.random.randint(jax.random.key(1), (8, 8), 1, TINY["vocab_size"])
    mask = jnp.ones_like(ids).at[1, :3].set(0).at[5, :6].set(0)
    gen = compiled_generate(
        RolloutConfig(
            num_generations=2, max_new_tokens=12, cache_chunk=8, record_routes=True, eos_ids=eos_ids
        )
    )
    args = (model, ids, mask, jax.random.key(2))
    out = {}
    if spec is not None:
        mesh = parallel.make_mesh(spec)
        rows = parallel.batch_sharding(mesh)
        args = (
            parallel.shard_model(model, mesh),
            jax.device_put(ids, rows),
            jax.device_put(mask, rows),
            args[3],
        )
        with jax.set_mesh(mesh):
            text = gen.lower(*args).compile().as_text()
            result = gen(*args)
        out = {
            "body": sorted(
                [op, shape, n] for (op, shape), n in loop_ops(text, COLLECTIVES).items()
            ),
            "collectives": _counts(collectives(text, dict(mesh.shape))),
        }
    else:
        result = gen(*args)
    return {
        **out,
        "tokens": np.asarray(result.tokens).tolist(),
        "logprobs": np.asarray(result.logprobs).tolist(),
        "routes": np.asarray(result.routes.completion).tolist(),
        "lengths": np.asarray(result.lengths).tolist(),
    }


def worker(out_path: str) -> None:
    import jax
    from conftest import use_compile_cache

    use_compile_cache()
    assert jax.device_count() == 8, jax.devices()
    results = {
        "forward": forward_cases(),
        "grpo": {
            **{spec: grpo_case(spec) for spec in (None, *MESHES)},
            "one_micro_batch": grpo_case(None, mesh_passes=True),
        },
        "sampler": {spec: sampler_case(spec) for spec in (None, *MESHES)},
        "lora": lora_case(MESHES[-1]),
        "sampler_ragged": {
            spec or "null": sampler_case(spec, eos_ids=STOPS) for spec in (None, "expert=8")
        },
    }
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    worker(sys.argv[1])
else:
    import jax
    import jax.numpy as jnp
    import pytest
    from test_parallel import ATOL as STEP_ATOL
    from test_parallel import RTOL as STEP_RTOL
    from test_parallel import run_worker

    from relax import parallel
    from relax.models.config.sharding import LOGICAL_AXES, decode_layout, path_name
    from relax.models.moe import experts as moe
    from relax.models.moe.expert_parallel import experts_ffn, local_sparse_ffn
    from relax.parallel.mesh import MeshSpec, ShardingError
    from relax.passes import target_backend

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        out = tmp_path_factory.mktemp("moe_mesh") / "results.json"
        run_worker(HERE, [str(out)], timeout=900.0)
        return json.loads(out.read_text())

    def _key(spec):
        return "null" if spec is None else spec

    # ------------------------------------------------------------------ 8 devices (subprocess)

    @pytest.mark.parametrize("spec", MESHES)
    @pytest.mark.slow
    def test_training_forward_and_gradients_equal_one_device(results, spec):
        got = results["forward"][spec]
        assert got["logprobs"] < ATOL and got["one_group"] < ATOL, got
        for name, (diff, scale) in got["grads"].items():
            assert diff <= ATOL + RTOL * scale, (spec, name, diff, scale)

    @pytest.mark.slow
    def test_lora_on_a_shared_expert_model_equals_one_device(results):
        got = results["lora"]
        assert {"shared_gate", "shared_router", "w_gate", "wq"} <= set(got["adapted"])
        assert got["logprobs"] < ATOL, got
        assert any("shared_router" in name for name in got["grads"])
        for name, (diff, scale) in got["grads"].items():
            assert scale > 0 and diff <= ATOL + RTOL * scale, (name, diff, scale)

    # per micro-batch, then averaged (module docstring)
    ROUTING_METRICS = (
        "moe/load_balance_loss",
        "moe/load_max_over_mean",
        "moe/load_max_over_mean_avg",
        "moe/router_z_loss",
    )

    def _same_metrics(got, want, what, skip=()):
        for i, w in enumerate(want["metrics"]):
            assert set(got["metrics"][i]) == set(w), what
            for k, v in w.items():
                if k not in skip:
                    np.testing.assert_allclose(
                        got["metrics"][i][k],
                        v,
                        rtol=STEP_RTOL,
                        atol=STEP_ATOL,
                        err_msg=f"{what} iteration {i}: {k}",
                    )

    @pytest.mark.parametrize("spec", MESHES)
    @pytest.mark.slow
    def test_grpo_step_equals_one_device(results, spec):
        one, split, got = (
            results["grpo"][_key(None)],
            results["grpo"]["one_micro_batch"],
            results["grpo"][spec],
        )
        assert got["tokens"] == one["tokens"] == split["tokens"], spec
        _same_metrics(got, split, spec)
        _same_metrics(got, one, spec, skip=ROUTING_METRICS)
        assert one["metrics"][1]["kl"] > 0 and "moe/load_balance_loss" in one["metrics"][0]

    @pytest.mark.parametrize("spec", MESHES)
    @pytest.mark.slow
    def test_sampler_on_an_expert_mesh_equals_one_device(results, spec):
        one, got = results["sampler"][_key(None)], results["sampler"][spec]
        assert got["tokens"] == one["tokens"] and got["routes"] == one["routes"], spec
        np.testing.assert_allclose(got["logprobs"], one["logprobs"], atol=2e-5, err_msg=spec)

    @pytest.mark.slow
    def test_compacted_sampler_on_an_expert_mesh_equals_one_device(results):
        """Ragged lengths: the 16 rows compact to 8 (expert=8 needs a multiple of 8) once at most 8 run."""
        one, got = results["sampler_ragged"]["null"], results["sampler_ragged"]["expert=8"]
        lengths = np.asarray(one["lengths"]).ravel()
        assert any(0 < (lengths > t + 1).sum() <= 8 for t in range(11)), (
            lengths
        )  # a compacted phase ran
        assert got["tokens"] == one["tokens"] and got["routes"] == one["routes"]
        np.testing.assert_allclose(got["logprobs"], one["logprobs"], atol=2e-5)

    def _sizes(spec):
        sizes = {"data": 1, "expert": 1, "fsdp": 1, "tensor": 1}
        sizes.update({k: int(v) for k, v in (part.split("=") for part in spec.split(","))})
        return sizes

    def _over_expert(rows):
        """``{(op, shape): count}`` of the collectives whose groups are exactly the expert axis."""
        return {(op, shape): n for op, shape, axes, n in rows if axes == ["expert"]}

    def _exchange(spec, nl_rows, backward=True, remat=False):
        """One sparse layer's token exchange (module docstring) for each row count in ``nl_rows``
        (rows per device of one call: the prompts', the completions'), summed over the calls;
        ``remat``: the forward's three gathers run again in the backward, recomputed (its combine's
        reduce-scatter gives the layer's output, which the backward does not read)."""
        s = _sizes(spec)
        ep, d, k = s["expert"], TINY["hidden_size"], TINY["num_experts_per_tok"]
        want: dict = {}
        for nl in nl_rows:
            keys = [
                ("all-gather", f"f32[{ep * nl},{d}]"),
                ("all-gather", f"s32[{ep * nl},{k}]"),
                ("all-gather", f"f32[{ep * nl},{k}]"),
                ("reduce-scatter", f"f32[{nl},{d}]"),
            ]
            if remat:
                keys += keys[:3]
            if backward:
                keys += [
                    ("all-gather", f"f32[{ep * nl},{d}]"),
                    ("reduce-scatter", f"f32[{nl},{d}]"),
                    ("reduce-scatter", f"f32[{nl},{k}]"),
                ]
            for key in keys:
                want[key] = want.get(key, 0) + 1
        return want

    def _weight_shapes(spec) -> set:
        """Trailing dims of an expert weight with all E experts (whole or split D and Fe)."""
        s = _sizes(spec)
        e, d, f = TINY["num_experts"], TINY["hidden_size"], TINY["moe_intermediate_size"]
        ds, fs = {d, d // s["fsdp"]}, {f, f // s["tensor"]}
        return {(e, a, b) for a in ds for b in fs} | {(e, b, a) for a in ds for b in fs}

    def _dims(shape):
        return tuple(int(x) for x in shape[shape.index("[") + 1 : shape.index("]")].split(",") if x)

    def _check_exchange(rows, spec, nl_rows, what, remat=False):
        """The exchange of every sparse layer over ``expert``, and no all-gather of an expert weight
        with all its experts (over any axes); prints what goes over ``expert``."""
        over = _over_expert(rows)
        for key, n in _exchange(spec, nl_rows, remat=remat).items():
            assert over.get(key, 0) == SPARSE_LAYERS * n, (what, key, over)
        weights = _weight_shapes(spec)
        for op, shape, axes, _ in rows:
            assert not (op == "all-gather" and _dims(shape)[-3:] in weights), (
                what,
                op,
                shape,
                axes,
            )
        print(f"\n{spec}: {what}, collectives over 'expert' ({SPARSE_LAYERS} sparse layers):")
        for op, shape, axes, n in rows:
            if "expert" in axes and op != "all-reduce":
                print(f"  {n:3d} x {op} {shape} over {axes}")

    @pytest.mark.parametrize("spec", MESHES)
    @pytest.mark.slow
    def test_forward_and_backward_exchange_tokens_over_the_expert_axis(results, spec):
        """Per sparse layer and input (the prompts and the completions, each its own call) the
        exchange of the module docstring; nothing gathers an expert weight's experts."""
        s = _sizes(spec)
        shards = s["data"] * s["expert"] * s["fsdp"]
        _check_exchange(
            results["forward"][spec]["collectives"],
            spec,
            (P * LP // shards, P * G * N // shards),
            "training forward + backward",
        )

    @pytest.mark.parametrize("spec", MESHES)
    @pytest.mark.slow
    def test_update_step_exchanges_tokens_and_gathers_no_expert_weight(results, spec):
        """The compiled GRPO update (one micro-batch: 8 prompts of 7 tokens, 32 completions of 6),
        with remat (the default): each layer's forward, its exchange included, runs again in the
        backward."""
        s = _sizes(spec)
        shards = s["data"] * s["expert"] * s["fsdp"]
        _check_exchange(
            results["grpo"][spec]["update_collectives"],
            spec,
            (56 // shards, 192 // shards),
            "GRPO update",
            remat=True,
        )

    @pytest.mark.parametrize("spec", MESHES)
    @pytest.mark.slow
    def test_decode_step_exchanges_tokens_per_sparse_layer(results, spec):
        """In each of the 2 decode loops (cache blocks of 8 and 4 slots) every sparse layer exchanges
        the step's rows once (forward only)."""
        s = _sizes(spec)
        nl = 8 * 2 // (s["data"] * s["expert"] * s["fsdp"])
        body = {(op, shape): n for op, shape, n in results["sampler"][spec]["body"]}
        for key, n in _exchange(spec, (nl,), backward=False).items():
            assert body.get(key, 0) == 2 * SPARSE_LAYERS * n, (key, body)
        print(f"\n{spec}: decode loop bodies' collectives (2 loops): {body}")

    # ------------------------------------------------------------------ in-process

    def test_expert_axis_specs():
        assert MeshSpec.parse("expert=4,data=2").shape == (2, 4, 1, 1)
        assert str(MeshSpec.parse("expert=2,fsdp=2,tensor=2")) == "data=1,expert=2,fsdp=2,tensor=2"
        assert MeshSpec.parse("expert=-1,tensor=2").resolve(8).expert == 4
        assert (
            parallel.AXES == ("data", "expert", "fsdp", "tensor")
            and "expert" in parallel.BATCH_AXES
        )

    def _abstract(**sizes):
        return jax.sharding.AbstractMesh(
            tuple(sizes.get(a, 1) for a in parallel.AXES), parallel.AXES
        )

    def _moe_model(**overrides):
        from relax.models.config.model import ModelConfig
        from relax.models.decoder import transformer as T

        cfg = ModelConfig(**{**TINY, **overrides})
        return cfg, jax.eval_shape(lambda: T.init(cfg, jax.random.key(0)))

    def _specs(model, cfg, mesh):
        return {
            path_name(p): parallel.partition_spec(path_name(p), x.shape, mesh, cfg)
            for p, x in jax.tree_util.tree_leaves_with_path(model)
        }

    def test_expert_weights_split_over_expert_router_and_shared_expert_replicated():
        cfg, model = _moe_model(shared_expert_size=24)
        assert {path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(model)} <= set(
            LOGICAL_AXES
        )
        spec = _specs(model, cfg, _abstract(expert=2, fsdp=2, tensor=2))
        PS = jax.sharding.PartitionSpec
        assert (
            spec["layers.expert_gate"]
            == spec["layers.expert_up"]
            == PS(None, "expert", "fsdp", "tensor")
        )
        assert spec["layers.expert_down"] == PS(None, "expert", "tensor", "fsdp")
        assert spec["layers.router"] == spec["layers.shared_router"] == PS(None, "fsdp", None)
        assert spec["layers.shared_gate"] == PS(None, "fsdp", "tensor")
        assert spec["layers.shared_down"] == PS(None, "tensor", "fsdp")
        assert spec["layers.wq"] == PS(None, "fsdp", "tensor")  # dense parts: as before
        alone = _specs(model, cfg, _abstract(expert=8))
        assert alone["layers.expert_up"] == PS(None, "expert", None, None)
        assert alone["layers.wq"] == PS(None, None, None)

    @pytest.mark.parametrize("sizes", [dict(expert=3), dict(expert=16), dict(expert=3, data=2)])
    def test_expert_axis_that_does_not_divide_the_experts_names_the_parameter(sizes):
        cfg, model = _moe_model()
        match = (
            rf"parameter layers.expert_gate \(2, 8, 32, 16\): dimension 1 \(experts, size 8\) does not split "
            rf"over mesh axis expert={sizes['expert']}"
        )
        with pytest.raises(ShardingError, match=match):
            _specs(model, cfg, _abstract(**sizes))

    def test_decode_layout_splits_experts_and_their_units():
        cfg, _ = _moe_model()
        with jax.sharding.use_abstract_mesh(_abstract(expert=2, fsdp=2, tensor=2)):
            layout = decode_layout(cfg)
        assert (
            layout.batch == ("expert", "fsdp")
            and layout.experts == "expert"
            and layout.expert_mlp == "tensor"
        )
        assert layout.spec("experts", None, "expert_mlp") == jax.sharding.PartitionSpec(
            "expert", None, "tensor"
        )

    def _ffn_inputs(n=13, d=6, f=5, e=4, k=2):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
        weights, experts, _ = moe.route(
            jnp.asarray(rng.normal(size=(n, e)), jnp.float32), k, normalize=True
        )
        w = [
            jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))
        ]
        return x, experts, weights, w

    def test_without_an_expert_axis_it_is_sparse_ffn():
        x, experts, weights, w = _ffn_inputs()
        mine, ref = (
            str(jax.make_jaxpr(lambda *a, f=f: f(*a, jax.nn.silu))(x, experts, weights, *w))
            for f in (experts_ffn, moe.sparse_ffn)
        )
        assert mine == ref

    @pytest.mark.parametrize("backend", ["cpu", "tpu"])  # "tpu": the ragged_dot path, traced here
    def test_pairs_of_other_devices_experts_give_zero(backend):
        """``local_sparse_ffn`` on experts 0..1 of 4 (``key`` 2: another device's): the pairs on
        local experts as ``sparse_ffn`` gives them, the others nothing; ``grouped_matmul``'s rows
        beyond ``sum(sizes)`` are 0 and get no gradient."""
        x, experts, weights, (wg, wu, wd) = _ffn_inputs()
        local = experts < 2
        want = moe.sparse_ffn(x, experts, jnp.where(local, weights, 0.0), wg, wu, wd, jax.nn.silu)
        with target_backend(backend):
            got = local_sparse_ffn(
                x, jnp.where(local, experts, 2), weights, wg[:2], wu[:2], wd[:2], jax.nn.silu
            )
            sizes = jnp.asarray([3, 2])
            y, vjp = jax.vjp(lambda a: moe.grouped_matmul(a, wg[:2], sizes), x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
        assert not np.any(np.asarray(y[5:])) and np.any(np.asarray(y[:5]))
        (dx,) = vjp(jnp.ones_like(y))
        assert not np.any(np.asarray(dx[5:]))
