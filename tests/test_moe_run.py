"""Mixture of experts in training: GRPO learns with a MoE policy, replay and the router losses are
wired into the step, LoRA adapts the attention of an MoE model, and the built-in task's MoE run
learns and exports a checkpoint transformers reads."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_example
from test_parallel import _decode, fives

from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.batch import step_input
from relax.algorithms.online.step import StepParts
from relax.models.adapters.operations import add_lora, merge_lora
from relax.models.config.model import ModelConfig
from relax.models.decoder.transformer import init
from relax.models.layers.lora import LoRAConfig
from relax.models.moe.experts import MoEConfig
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state

MOE = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    family="mixtral",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)


def _prompts(p=4, lp=8):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, MOE.vocab_size, (p, lp)).astype(np.int32)
    return jnp.asarray(ids), jnp.ones((p, lp), jnp.int32)


def _step(moe: MoEConfig, lr=3e-2, **grpo):
    cfg = configure(
        GRPOConfig,
        num_generations=8,
        max_new_tokens=6,
        beta=0.0,
        optimizer=OptimizerConfig(learning_rate=lr),
        moe=moe,
        **grpo,
    )
    state = init_state(
        init(MOE, jax.random.key(0), std=0.1), cfg.optimizer.make(), key=jax.random.key(1)
    )
    return state, make_grpo_step(
        cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(), pad_id=0)
    )


@pytest.mark.slow
def test_grpo_learns_with_a_moe_policy_and_reports_routing():
    state, step = _step(MoEConfig(aux_loss_coef=0.01))
    ids, pm = _prompts()
    rewards = []
    for _ in range(20):
        state, out = step(state, step_input(ids, pm, ["p"] * 4, {"weight": [1.0] * 4}))
        m = out.device.metrics
        rewards.append(float(m["reward"]))
        assert np.isfinite(float(m["loss"]))
    assert np.mean(rewards[-4:]) > np.mean(rewards[:3]) + 0.3, rewards
    assert float(m["mismatch/abs_max"]) < 1e-4  # replayed: sampler == trainer
    for k in (
        "moe/routing_differ",
        "moe/load_max_over_mean",
        "moe/load_balance_loss",
        "moe/router_z_loss",
    ):
        assert k in m and np.isfinite(float(m[k])), k
    assert float(m["moe/load_max_over_mean"]) >= 1.0
    assert 0.9 < float(m["moe/load_balance_loss"]) < 4.0  # E sum f P: 1 when balanced, at most E


@pytest.mark.slow
def test_router_loss_is_added_with_its_coefficient():
    """One step with aux coefficient 0 and 0.5 from the same state: the losses differ by
    0.5 x the load-balancing loss the step reports (one micro-batch: its token share is 1)."""
    ids, pm = _prompts()
    losses = {}
    for coef in (0.0, 0.5):
        state, step = _step(MoEConfig(aux_loss_coef=coef, z_loss_coef=0.0))
        _, out = step(state, step_input(ids, pm, ["p"] * 4, {"weight": [1.0] * 4}))
        losses[coef] = out.device.metrics
    lb = float(losses[0.0]["moe/load_balance_loss"])
    np.testing.assert_allclose(
        float(losses[0.5]["loss"]) - float(losses[0.0]["loss"]), 0.5 * lb, rtol=1e-4
    )


def test_checkpoint_defaults_of_the_router_losses():
    quiet = dataclasses.replace(MOE, router_aux_loss_coef=0.001)
    on = dataclasses.replace(quiet, output_router_logits=True, router_z_loss_coef=0.002)
    assert MoEConfig().coefficients(quiet) == (
        0.0,
        0.0,
    )  # transformers adds it only with output_router_logits
    assert MoEConfig().coefficients(on) == (0.001, 0.002)
    assert MoEConfig(aux_loss_coef=0.1).coefficients(quiet) == (0.1, 0.0)
    dense = ModelConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    assert MoEConfig(aux_loss_coef=0.1).coefficients(dense) == (0.0, 0.0)


def test_lora_on_a_moe_model_adapts_attention():
    model = init(MOE, jax.random.key(0), std=0.1)
    with pytest.warns(
        UserWarning, match=r"\['wq', 'wk', 'wv', 'wo'\]: the experts and their router are not"
    ):
        lora = add_lora(model, LoRAConfig(rank=4), jax.random.key(1))
    assert set(lora.layers.lora.weights()) == {"wq", "wk", "wv", "wo"}
    with pytest.raises(ValueError, match="experts"):
        add_lora(
            model, LoRAConfig(rank=4, target_modules=("q_proj", "gate_proj")), jax.random.key(1)
        )
    # a moved adapter: the merged model computes what the adapted one does
    lw = lora.layers.lora
    lora = dataclasses.replace(
        lora,
        layers=dataclasses.replace(
            lora.layers,
            lora=dataclasses.replace(
                lw, wq=dataclasses.replace(lw.wq, b=jnp.full_like(lw.wq.b, 0.05))
            ),
        ),
    )
    ids, _ = _prompts()
    chex.assert_trees_all_close(lora(ids), merge_lora(lora)(ids), atol=1e-5)
    assert not np.allclose(np.asarray(lora(ids)), np.asarray(model(ids)), atol=1e-4)


@pytest.mark.slow  # make test-all: the built-in task with a MoE base model, end to end
def test_builtin_task_with_a_moe_base_learns_and_exports(tmp_path):
    summary = load_example("grpo").main(["--run-dir", str(tmp_path), "--reverse.num-experts", "4"])
    before, after = summary["before"]["pass@1"], summary["after"]["pass@1"]
    assert after >= before + 0.20, (before, after)
    exported = tmp_path / "final_hf"
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from relax.models.hf.checkpoint import load_pretrained

    ours = load_pretrained(exported)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    ids = np.asarray([[1, 5, 6, 7, 4]], np.int64)
    want = theirs(torch.tensor(ids)).logits.detach().numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), want, atol=1e-4)
