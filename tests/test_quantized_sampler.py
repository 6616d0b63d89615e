"""An int8 / fp8 sampler (``relax.models.layers.quantized``, ``RolloutConfig.sampler_precision``):
the quantized product against numpy's dequantized reference, the sampler's log-probs against the
trainer's on the dequantized model (the same numbers) and on the model itself (a small, nonzero
drift), GRPO and PPO steps corrected for it, the flag that asks for it, and (slow, 8 simulated
devices) the 8-bit sampler on a mesh against one device.

Needs qwix (the ``quant`` extra, which ``make test`` installs); skipped without it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("qwix")

from test_parallel import _decode, fives  # noqa: E402

from relax.algorithms.cli.configure import configure  # noqa: E402
from relax.algorithms.grpo.config import preset  # noqa: E402
from relax.algorithms.grpo.step import make_grpo_step  # noqa: E402
from relax.algorithms.online.batch import step_input  # noqa: E402
from relax.algorithms.online.step import StepParts  # noqa: E402
from relax.algorithms.ppo.config import PPOConfig  # noqa: E402
from relax.algorithms.ppo.step import make_ppo_step  # noqa: E402
from relax.models import ModelConfig, init  # noqa: E402
from relax.models.decoder.layer import linear  # noqa: E402
from relax.models.decoder.logprobs import token_logprobs  # noqa: E402
from relax.models.decoder.transformer import project  # noqa: E402
from relax.models.heads.critic import init_critic  # noqa: E402
from relax.models.layers.quantized import dequantize, quantize  # noqa: E402
from relax.objectives.off_policy import OffPolicyConfig  # noqa: E402
from relax.rollout.sampler import RolloutConfig, dequantized, generate_with  # noqa: E402
from relax.rollout.sampling import SamplingConfig  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.train.state import init_state  # noqa: E402

BOUND = {"int8": 127.5, "fp8": 448.0}  # qwix's: max |W| lands on the edge of the top code


def numpy_codes(w: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray]:
    """``(Q, s)`` of ``w [i, o]`` per output channel: ``s = max_i |w| / B``, ``Q = round(w / s)``
    (int8: half to even, saturated to [-128, 127]; fp8: the nearest e4m3 value)."""
    s = np.abs(w).max(axis=0, keepdims=True) / np.float32(BOUND[precision])
    r = w / s
    if precision == "int8":
        return np.clip(np.round(r), -128, 127), s
    return r.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), s


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_product_equals_numpy_dequantized_reference(precision):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 48)) * 0.05).astype(np.float32)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    q = quantize(jnp.asarray(w), precision, jnp.float32)
    codes, s = numpy_codes(w, precision)
    assert q.qvalue.dtype == (jnp.int8 if precision == "int8" else jnp.float8_e4m3fn)
    assert q.qvalue.shape == w.shape and q.scale.shape == (1, 48)
    np.testing.assert_allclose(np.asarray(q.scale), s, rtol=1e-6)
    got = np.asarray(q.qvalue).astype(np.float32)
    off = got != codes  # only at ties up to float32 rounding (numpy's scale is qwix's +- 1 ulp):
    if precision == "int8":  # int8's are +-127.5, each channel's largest weight
        assert np.all(np.abs(got - codes)[off] == 1) and np.all(np.abs(w / s)[off] > 127.49)
    else:
        assert off.sum() <= 1
    w_hat = got * np.asarray(q.scale)
    np.testing.assert_allclose(np.asarray(dequantize(q)), w_hat, rtol=1e-6, atol=0)
    # every weight within half a step of W^: s / 2 (int8); 2^-4 relative, e4m3's 3 mantissa bits
    bound = 0.5 * s if precision == "int8" else np.abs(w) * 2.0**-4 + s * 2.0**-10
    assert np.all(np.abs(w_hat - w) <= bound * (1 + 1e-4))
    # the layer's product with the 8-bit weight is numpy's x W^ (float32, accumulated in float32)
    y = np.asarray(linear(jnp.asarray(x), q, None, jnp.float32))
    np.testing.assert_allclose(y, x @ w_hat, rtol=1e-5, atol=1e-5)
    assert np.abs(y - x @ w).max() > 1e-5  # and not the float one


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_head_logits_equal_numpy(precision):
    cfg = ModelConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=16, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip
    model = init(cfg, jax.random.key(0), std=0.3)
    head = np.asarray(model.embed)  # tied: the head is the embedding, quantized per vocabulary row
    q = quantize(model.head, precision, jnp.float32, contract=-1)
    _, s = numpy_codes(head.T, precision)
    np.testing.assert_allclose(np.asarray(q.scale)[:, 0], s[0], rtol=1e-6)
    w_hat = np.asarray(q.qvalue).astype(np.float32) * np.asarray(q.scale)
    h = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    logits = np.asarray(project(dataclasses.replace(model, lm_head=q), jnp.asarray(h)))
    np.testing.assert_allclose(logits, h @ w_hat.T, rtol=1e-5, atol=1e-5)
    sampler = dequantized(model, precision)  # the model the sampler samples from
    np.testing.assert_allclose(np.asarray(sampler.lm_head), w_hat, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sampler.embed), head)  # the gather keeps the model's


TINY = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
TEMPERATURE = 0.8


def _sampled(model, precision):
    """A rollout of 3 ragged prompts x 4 completions and the ``[prompt | completion]`` rows."""
    rng = np.random.default_rng(0)
    ids = np.zeros((3, 16), np.int32)
    mask = np.zeros((3, 16), np.int32)
    for i, n in enumerate((9, 4, 16)):
        ids[i, 16 - n :] = rng.integers(5, TINY.vocab_size, n)
        mask[i, 16 - n :] = 1
    cfg = RolloutConfig(
        num_generations=4,
        max_new_tokens=12,
        sampling=SamplingConfig(temperature=TEMPERATURE),
        prompt_buckets=(16,),
        sampler_precision=precision,
    )
    r = generate_with(model, ids, mask, jax.random.key(5), cfg)
    p, g, n = r.tokens.shape
    seq = np.concatenate([np.repeat(ids, g, 0), np.asarray(r.tokens).reshape(p * g, n)], 1)
    full = np.concatenate([np.repeat(mask, g, 0), np.asarray(r.mask).reshape(p * g, n)], 1)
    valid = np.asarray(r.mask).reshape(p * g, n).astype(bool)
    return np.asarray(r.logprobs).reshape(p * g, n), seq, full, valid


def _trainer(model, seq, full):
    lp = token_logprobs(model, jnp.asarray(seq), jnp.asarray(full), temperature=TEMPERATURE)
    return np.asarray(lp)[:, 15:]  # the predictions of the completion tokens


@pytest.mark.parametrize("precision,tie", [("int8", True), ("fp8", False)])
@pytest.mark.slow
def test_sampler_logprobs_are_the_dequantized_models(precision, tie):
    """The 8-bit sampler's log-probs (prefill and decode) equal the trainer's on the dequantized
    model to float32 rounding, and differ from the model's own by the quantization's drift."""
    model = init(dataclasses.replace(TINY, tie_word_embeddings=tie), jax.random.key(0), std=0.1)
    lp, seq, full, valid = _sampled(model, precision)
    same = np.abs(lp - _trainer(dequantized(model, precision), seq, full))[valid]
    assert same.max() < 3e-5 and same.mean() < 5e-6, (same.max(), same.mean())
    drift = np.abs(lp - _trainer(model, seq, full))[valid]
    assert 1e-4 < drift.mean() < 0.2 and drift.max() > 1e-3, (drift.mean(), drift.max())


STEP_CFG = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
TIS = OffPolicyConfig(kind="tis", cap=2.0)


def _policy():
    return init(STEP_CFG, jax.random.key(0), std=0.3)


def _step_batch():
    ids = jax.random.randint(jax.random.key(9), (2, 4), 1, STEP_CFG.vocab_size)
    return step_input(ids, jnp.ones_like(ids), ["x"] * 2, {"weight": [1.0] * 2})


def _check_corrected(m: dict, state_policy, out) -> None:
    """The step measured the sampler against the trainer and weighted every token: the mismatch
    is the 8-bit drift (nonzero), equal to |trainer - sampler| recomputed here."""
    m = {k: float(v) for k, v in m.items()}
    assert all(np.isfinite(v) for v in m.values()), m
    batch = out.device.batch
    prompts, sampled = np.asarray(batch.prompt_ids), np.asarray(batch.tokens)
    p, lp = prompts.shape
    g = sampled.shape[0] // p if sampled.ndim == 2 else sampled.shape[1]
    tokens, mask = sampled.reshape(p * g, -1), np.asarray(batch.mask).reshape(p * g, -1)
    seq = np.concatenate([np.repeat(prompts, g, 0), tokens], 1)
    full = np.concatenate([np.repeat(np.asarray(batch.prompt_mask), g, 0), mask], 1)
    trainer = token_logprobs(state_policy, jnp.asarray(seq), jnp.asarray(full), temperature=1.0)
    d = np.abs(np.asarray(trainer)[:, lp - 1 :] - np.asarray(batch.old_logprobs).reshape(p * g, -1))
    d = d[mask.astype(bool)]
    assert d.max() > 1e-4  # an 8-bit sampler is not the trainer
    np.testing.assert_allclose(m["mismatch/abs_max"], d.max(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["mismatch/abs_mean"], d.mean(), rtol=1e-4, atol=1e-6)
    assert m["is_weight_min"] < 1.0 < m["is_weight_max"]  # the correction weighted the tokens


@pytest.mark.slow
def test_grpo_step_with_an_int8_sampler_is_corrected():
    cfg = preset("grpo", num_generations=4, max_new_tokens=6, sampler_precision="int8")
    policy = _policy()
    state = init_state(
        policy, cfg.optimizer.make(), key=jax.random.key(1), with_reference=cfg.needs_reference
    )
    parts = StepParts(reward_fns=[fives], decode=_decode, eos_ids=(), pad_id=0, off_policy=TIS)
    _, out = make_grpo_step(cfg, parts)(state, _step_batch())
    _check_corrected(out.device.metrics, _policy(), out)  # the state (and policy) was donated


@pytest.mark.slow
def test_ppo_step_with_an_int8_sampler_is_corrected():
    cfg = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=6,
        kl_coef=0.0,
        sampler_precision="int8",
        optimizer=OptimizerConfig(learning_rate=1e-3),
    )
    policy = _policy()
    state = init_state(
        policy,
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=False,
        critic=init_critic(policy),
        critic_optimizer=cfg.critic_optimizer.make(),
    )
    parts = StepParts(reward_fns=[fives], decode=_decode, eos_ids=(), pad_id=0, off_policy=TIS)
    _, out = make_ppo_step(cfg, parts)(state, _step_batch())
    _check_corrected(out.device.metrics, _policy(), out)  # the state (and policy) was donated


def _parse(algorithm: str, argv: list[str]):
    from relax.algorithms.cli.flags import parse_flags
    from relax.algorithms.grpo import run as grpo_run
    from relax.algorithms.ppo import run as ppo_run

    module = grpo_run if algorithm == "grpo" else ppo_run
    config = grpo_run.GRPORunConfig if algorithm == "grpo" else ppo_run.PPORunConfig
    return parse_flags(
        config, argv, builtin=module.builtin_defaults, real=module.real_defaults
    ), module


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_flag_asks_for_the_sampler_and_the_run_corrects_it(algorithm):
    from relax.algorithms.online.config import off_policy, run_parts

    run, module = _parse(
        algorithm, [f"--{algorithm}.sampler-precision", "int8", "--async.correction.kind", "tis"]
    )
    generation = getattr(run, algorithm).generation
    assert generation.sampler_precision == "int8"
    assert generation.rollout(eos_ids=(2,), pad_id=0).sampler_precision == "int8"
    parts = run_parts(run, StepParts(), generation)
    assert run.async_.staleness == 0 and parts.off_policy == OffPolicyConfig(kind="tis")
    assert not parts.pipelined  # corrected, yet synchronous
    plain, _ = _parse(algorithm, [])
    assert off_policy(plain, getattr(plain, algorithm).generation) is None
    none, _ = _parse(
        algorithm, [f"--{algorithm}.sampler-precision", "fp8", "--async.correction.kind", "none"]
    )
    with pytest.raises(ValueError, match="correction.kind none"):
        off_policy(none, getattr(none, algorithm).generation)


def test_bad_precision_and_the_agents_sampler_are_refused():
    from relax.algorithms.agent.config import AgentConfig, rollout_config
    from relax.rollout.generation import GenerationConfig

    with pytest.raises(ValueError, match="sampler_precision 'int4'"):
        GenerationConfig(sampler_precision="int4")
    with pytest.raises(ValueError, match="sampler_precision 'bf16'"):
        RolloutConfig(num_generations=1, max_new_tokens=1, sampler_precision="bf16")
    with pytest.raises(ValueError, match="multi-turn"):
        rollout_config(
            AgentConfig(), GenerationConfig(sampler_precision="int8"), eos_ids=(2,), pad_id=0
        )


# ------------------------------------------------------------------ on a mesh (subprocess)

HERE = Path(__file__).resolve()
MESH_MODEL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    max_position_embeddings=128,
    qkv_bias=True,
    qk_norm=True,
)
MESHES = ("fsdp=8", "data=2,fsdp=2,tensor=2")


def mesh_worker(out_path: str) -> None:
    """The model's and the int8 sampler's rollouts on one device and on ``MESHES`` (8 simulated
    devices), with the collectives of their decode loops, as JSON."""
    import json

    from relax import parallel
    from relax.parallel.hlo import COLLECTIVES, loop_ops
    from relax.rollout.sampler import compiled_generate

    model = init(ModelConfig(**MESH_MODEL), jax.random.key(0), std=0.1)
    ids = jax.random.randint(jax.random.key(1), (8, 8), 1, MESH_MODEL["vocab_size"])
    mask = jnp.ones_like(ids).at[1, :3].set(0)
    out = {}
    for precision in ("model", "int8"):
        gen = compiled_generate(
            RolloutConfig(
                num_generations=4, max_new_tokens=20, cache_chunk=8, sampler_precision=precision
            )
        )
        r = gen(model, ids, mask, jax.random.key(2))
        out[f"{precision} one"] = {"tokens": np.asarray(r.tokens).tolist(), "body": {}}
        out[f"{precision} one"]["logprobs"] = np.asarray(r.logprobs).tolist()
        for spec in MESHES:
            mesh = parallel.make_mesh(spec)
            rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
            args = (
                parallel.shard_model(model, mesh),
                jax.device_put(ids, rows),
                jax.device_put(mask, rows),
                jax.random.key(2),
            )
            with jax.set_mesh(mesh):
                r, text = gen(*args), gen.lower(*args).compile().as_text()
            body = {f"{op} {shape}": n for (op, shape), n in loop_ops(text, COLLECTIVES).items()}
            out[f"{precision} {spec}"] = {
                "tokens": np.asarray(r.tokens).tolist(),
                "logprobs": np.asarray(r.logprobs).tolist(),
                "body": body,
            }
    Path(out_path).write_text(json.dumps(out))


@pytest.mark.slow  # make test-all (8 simulated devices in a subprocess, 4 mesh compiles)
def test_int8_sampler_on_a_mesh_equals_one_device(tmp_path):
    """On a mesh the 8-bit weights are laid out as the float ones (``place_layer``): the same
    tokens and log-probs as on one device, and the decode loop holds the float sampler's
    collectives (no weight gathered per step)."""
    import json

    from test_parallel import run_worker

    out = tmp_path / "mesh.json"
    run_worker(HERE, [str(out)])
    got = json.loads(out.read_text())
    for spec in MESHES:
        mesh, one = got[f"int8 {spec}"], got["int8 one"]
        assert mesh["tokens"] == one["tokens"], spec
        np.testing.assert_allclose(mesh["logprobs"], one["logprobs"], atol=2e-5, err_msg=spec)
        assert mesh["body"] == got[f"model {spec}"]["body"], spec
    assert got["int8 one"]["tokens"] != got["model one"]["tokens"]  # 8 bits: another policy


if __name__ == "__main__":
    mesh_worker(sys.argv[1])
