"""PPO with a critic: token rewards, explained variance, VinePPO values, the step, learning, exact resume."""

import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_example
from safetensors.numpy import load_file
from test_parallel import _decode, fives
from test_run import overlap_reward, setup  # noqa: F401 - the model directory, --reward overlap

from relax.algorithms.cli.configure import configure
from relax.algorithms.online.batch import step_input
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.batch import CriticRows
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.loss import make_actor_loss, make_joint_loss, value_terms
from relax.algorithms.ppo.step import make_ppo_step, token_rewards
from relax.algorithms.ppo.vine import branch_prompts, step_advantages
from relax.models import ModelConfig, init
from relax.models.forward.prefix_shared import completion_hidden
from relax.models.heads.critic import init_critic, init_value_head, values_from_hidden
from relax.objectives.advantages import vineppo_advantages
from relax.objectives.value import explained_variance
from relax.passes import Passes
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state
from relax.train.update import LossContext

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def test_token_rewards_put_the_score_on_the_last_valid_token():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    kl = jnp.full((3, 4), 0.5)
    r = token_rewards(jnp.array([2.0, -1.0, 3.0]), mask, kl, 0.1)
    np.testing.assert_allclose(
        r, [[-0.05, -0.05, 1.95, 0.0], [-1.05, 0, 0, 0], [0, 0, 0, 0]], atol=1e-7
    )


def test_explained_variance_hand_values():
    returns = jnp.array([[1.0, 2.0, 3.0, 9.0]])
    mask = jnp.array([[1, 1, 1, 0]], bool)
    # Var(R) = 2/3 over valid tokens; V = R - [0, 1, 0]: Var(R - V) = 2/9 -> 1 - (2/9)/(2/3) = 2/3
    values = returns - jnp.array([[0.0, 1.0, 0.0, 5.0]])
    np.testing.assert_allclose(explained_variance(values, returns, mask), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(explained_variance(returns, returns, mask), 1.0)
    np.testing.assert_allclose(
        explained_variance(jnp.zeros((1, 4)), jnp.ones((1, 4)), mask), 0.0
    )  # Var(R) = 0


def test_branch_prompts_are_prompt_plus_completion_prefixes():
    prompt_ids = np.array([[0, 7, 8]])
    prompt_mask = np.array([[0, 1, 1]])
    tokens = np.array([[[1, 2, 3, 4], [5, 6, 0, 0]]])
    ids, mask, points = branch_prompts(prompt_ids, prompt_mask, tokens, np.array([[4, 2]]), every=2)
    assert points.tolist() == [0, 2]
    rows = [row[m > 0].tolist() for row, m in zip(ids, mask)]
    assert rows == [[7, 8], [7, 8, 1, 2], [7, 8], [7, 8, 5, 6]]


def test_vineppo_step_advantages_hand_values():
    """Steps of 2 tokens; completion lengths 5 and 2: A_t = V(next step's state) - V(this step's),
    the state after the last step terminal (the score)."""
    values = jnp.array([[[0.2, 0.5, 0.9], [0.4, 0.7, 0.1]]])  # [P=1, G=2, J=3]
    adv = step_advantages(values, jnp.array([[5, 2]]), jnp.array([[1.0, 0.0]]), every=2, n=6)
    np.testing.assert_allclose(
        adv, [[[0.3, 0.3, 0.4, 0.4, 0.1, 0.0], [-0.4, -0.4, 0, 0, 0, 0]]], atol=1e-6
    )
    # every = 1: the token-level estimator of relax.objectives.advantages
    v = jax.random.uniform(jax.random.key(0), (1, 2, 4))
    lengths, score = jnp.array([[4, 3]]), jnp.array([[1.0, 0.5]])
    mask = jnp.arange(4) < lengths[..., None]
    want = vineppo_advantages(v.reshape(2, 4), mask.reshape(2, 4), terminal_values=score.reshape(2))
    np.testing.assert_allclose(
        step_advantages(v, lengths, score, every=1, n=4).reshape(2, 4), want, atol=1e-6
    )


def _batch(p=4, lp=3):
    ids = jax.random.randint(jax.random.key(9), (p, lp), 1, CFG.vocab_size)
    return step_input(ids, jnp.ones_like(ids), ["x"] * p, {"weight": [1.0] * p})


def _state(cfg: PPOConfig, seed=0):
    policy = init(CFG, jax.random.key(seed), std=0.2)
    critic = None
    if cfg.needs_critic:
        critic = init_value_head(CFG) if cfg.shared_critic else init_critic(policy)
    return init_state(
        policy,
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=cfg.needs_reference,
        critic=critic,
        critic_optimizer=None if critic is None else cfg.critic_optimizer.make(),
    )


@pytest.mark.slow
def test_ppo_step_trains_policy_and_critic():
    cfg = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=5,
        kl_coef=0.05,
        num_minibatches=2,
        optimizer=OptimizerConfig(learning_rate=1e-2),
        critic_optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    state = _state(cfg)
    head0, wq0 = np.asarray(state.critic.head), np.asarray(state.policy.layers.wq)
    step = make_ppo_step(cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(), pad_id=0))
    state, out = step(state, _batch())
    m = {k: float(v) for k, v in out.device.metrics.items()}
    assert all(np.isfinite(v) for v in m.values()), m
    assert {
        "critic/vf_clipfrac",
        "critic/vf_mse",
        "critic/loss",
        "explained_variance",
        "clip_frac_low",
        "approx_kl",
        "kl",
        "non_score_reward",
        "returns_mean",
    } <= set(m)
    assert m["kl"] == 0.0  # the first iteration samples with the reference itself
    assert not np.array_equal(np.asarray(state.critic.head), head0)  # the critic learned
    assert not np.array_equal(np.asarray(state.policy.layers.wq), wq0)
    assert int(state.step) == 1 and state.ref is not None
    # with V = 0 before the update, GAE(gamma=1, lam) returns are the rewards to go: the score at the end
    np.testing.assert_allclose(np.asarray(out.device.batch.old_values), 0.0)
    state, out = step(state, _batch())
    assert float(out.device.metrics["kl"]) > 0.0 and np.any(
        np.asarray(out.device.batch.old_values) != 0.0
    )


@pytest.mark.slow
def test_shared_value_head_is_one_joint_loss_on_the_policy_backbone():
    """critic='shared': the value head reads the policy's hidden states; its loss trains the head
    and reaches the backbone (the joint gradient is the sum of the two terms' gradients)."""
    cfg = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=5,
        kl_coef=0.0,
        critic="shared",
        vf_coef=0.5,
        optimizer=OptimizerConfig(learning_rate=1e-2),
        critic_optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    state = _state(cfg)
    step = make_ppo_step(cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(), pad_id=0))
    state, out = step(state, _batch())
    state, out = step(
        state, _batch()
    )  # the head is no longer 0: values and their loss are not trivial
    m = {k: float(v) for k, v in out.device.metrics.items()}
    assert all(np.isfinite(v) for v in m.values()) and m["critic/vf_mse"] > 0, m
    assert np.any(np.asarray(state.critic.head) != 0) and state.critic_opt_state is not None
    # the rows the joint loss reads: these fields of the trained batch, nothing else
    # (padded: the step packed its batch into bins, whose rotary tables the padded forward does not read)
    mb = CriticRows.of(
        out.device.batch,
        ref_logprobs=None,
        prox_logprobs=None,
        packed=None,
        critic_rope=None,
        rope=None,
    )
    assert (
        out.device.batch.rope is not None and mb.old_values is not None and mb.returns is not None
    )
    ctx = LossContext(
        {"tokens": jnp.float32(20.0), "sequences": jnp.float32(16.0)}, jnp.bool_(False)
    )
    params = (state.policy, state.critic)
    joint = jax.grad(lambda q: make_joint_loss(cfg, Passes())(q, mb, ctx)[0])(params)
    actor = jax.grad(lambda pol: make_actor_loss(cfg, Passes())(pol, mb, ctx)[0])(state.policy)
    value = jax.grad(
        lambda q: value_terms(
            cfg,
            values_from_hidden(
                completion_hidden(
                    q[0], mb.prompt_ids, mb.prompt_mask, mb.tokens, mb.mask, rope=mb.rope
                ),
                q[1].head,
                q[1].bias,
            ),
            mb,
            ctx,
        )[0]
    )(params)
    chex.assert_trees_all_close(
        joint[0], jax.tree.map(jnp.add, actor, value[0]), atol=1e-6, rtol=1e-4
    )
    chex.assert_trees_all_close(joint[1], value[1], atol=1e-7, rtol=1e-5)
    assert float(jnp.max(jnp.abs(value[0].layers.wq))) > 0  # the value loss reaches the backbone


@pytest.mark.slow
def test_vineppo_values_are_exact_once_the_outcome_is_decided():
    """Reward: the first completion token is a five. From every state after the first token the
    outcome is decided, so each Monte-Carlo value equals the completion's own score exactly."""

    def first_is_five(prompts, completions, **kw):
        return [float(c.split(" ")[0] == "5") if c else 0.0 for c in completions]

    cfg = configure(
        PPOConfig,
        num_generations=2,
        max_new_tokens=4,
        advantage="vineppo",
        vine_every=1,
        vine_rollouts=3,
        kl_coef=0.0,
        optimizer=OptimizerConfig(learning_rate=1e-3),
    )
    state = _state(cfg)
    assert state.critic is None and state.ref is None
    step = make_ppo_step(
        cfg, StepParts(reward_fns=[first_is_five], decode=_decode, eos_ids=(), pad_id=0)
    )
    _, out = step(state, _batch())
    batch = out.device.batch
    mc, rewards, mask = (np.asarray(x) for x in (batch.mc_values, batch.rewards, batch.mask))
    later = (mask > 0) & (np.arange(4) >= 1)
    np.testing.assert_array_equal(np.where(later, mc, 0), np.where(later, rewards[..., None], 0))
    assert np.all((mc[..., 0] >= 0) & (mc[..., 0] <= 1))  # V(s_0): a fraction of 3 branches
    assert np.all(np.isfinite(np.asarray(batch.advantages)))


def _args(setup, run_dir, steps, *extra):  # noqa: F811
    return [
        "--model",
        str(setup / "model"),
        "--tokenizer",
        str(setup / "tok.model"),
        "--data",
        str(setup / "train.jsonl"),
        "--eval-data",
        str(setup / "eval.jsonl"),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--batch-size",
        "4",
        "--max-prompt-tokens",
        "16",
        "--ppo.num-generations",
        "2",
        "--ppo.max-new-tokens",
        "5",
        "--ppo.optimizer.learning-rate",
        "1e-2",
        "--ppo.critic-optimizer.learning-rate",
        "1e-2",
        "--checkpoint-every",
        "2",
        "--eval.num-samples",
        "1",
        "--eval-max-prompts",
        "2",
        "--reward",
        "overlap",
        *extra,
    ]


def _train_lines(run_dir):
    lines = map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
    return {
        l["step"]: {
            k: v
            for k, v in l.items()
            if k not in ("time", "tokens_per_s", "compiles") and not k.startswith("time/")
        }
        for l in lines
        if "loss" in l
    }


@pytest.mark.slow  # make test-all; the capability keeps a faster test
def test_ppo_resume_is_bit_exact(setup, tmp_path):  # noqa: F811
    """3 steps straight against 1 step, then --resume to 3: the same logged metrics bit for bit
    (policy, critic, optimizer states, data position and PRNG key all restored) and the same export."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    load_example("ppo").main(_args(setup, straight, 3))
    load_example("ppo").main(_args(setup, resumed, 1))  # a run's last step is always checkpointed
    load_example("ppo").main(_args(setup, resumed, 3, "--resume"))
    a, b = _train_lines(straight), _train_lines(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert all(
        a[s]["critic/grad_norm"] > 0 for s in a
    )  # the critic trains: the comparison is not vacuous
    for s in a:
        assert a[s] == b[s], s
    wa, wb = (load_file(str(d / "final_hf" / "model.safetensors")) for d in (straight, resumed))
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


@pytest.mark.slow  # save_critic / load_critic have fast tests (test_critic.py); this is the --ppo.critic-model wiring
def test_ppo_trains_a_critic_loaded_from_a_hf_directory(setup, tmp_path):  # noqa: F811
    """--ppo.critic-model: a critic saved with a score head (transformers' layout) is loaded,
    trained, and its value head starts where the directory left it."""
    from relax.models.heads.critic import save_critic
    from relax.models.hf.checkpoint import load_pretrained

    policy = load_pretrained(setup / "model")
    critic = init_critic(policy, key=jax.random.key(3), head_std=0.5)
    save_critic(critic, tmp_path / "critic", layout="sequence")
    run_dir = tmp_path / "run"
    load_example("ppo").main(
        _args(setup, run_dir, 1, "--ppo.critic-model", str(tmp_path / "critic"))
    )
    line = _train_lines(run_dir)[1]
    assert (
        line["critic/grad_norm"] > 0 and line["values_mean"] != 0.0
    )  # a nonzero head from the file


@pytest.mark.slow  # `make test-all`; the fast PPO tests check the step, the critic, resume and VinePPO
def test_ppo_learns_the_builtin_task(tmp_path):
    """The no-argument PPO run, shortened: held-out greedy accuracy rises by more than 20 points."""
    summary = load_example("ppo").main(
        [
            "--run-dir",
            str(tmp_path),
            "--steps",
            "30",
            "--eval-every",
            "0",
            "--reverse.sft-steps",
            "250",
            "--eval-max-prompts",
            "100",
        ]
    )
    gain = summary["after"]["greedy/accuracy"] - summary["before"]["greedy/accuracy"]
    assert gain > 0.2, summary
