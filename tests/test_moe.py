"""Mixture of experts: the grouped matmul and the sparse MLP against numpy, the router losses
against transformers and finite differences, and routing replay from sampler to trainer."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from relax.models.config.model import ModelConfig
from relax.models.decoder import transformer as T
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.forward.routes import Routes, route_dtype
from relax.models.moe import experts as moe
from relax.passes import target_backend
from relax.rollout.sampler import RolloutConfig, generate_program
from relax.rollout.sampling import SamplingConfig

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
)


def _groups(sizes):
    return np.repeat(np.arange(len(sizes)), sizes)


@pytest.mark.parametrize("backend", ["cpu", "tpu"])  # "tpu": the ragged_dot path, traced here
@pytest.mark.parametrize("sizes", [(10, 0, 20, 7), (0, 0, 37, 0), (1, 1, 1, 34)])
def test_grouped_matmul_matches_numpy(backend, sizes):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(sum(sizes), 5)).astype(np.float32)
    w = rng.normal(size=(len(sizes), 5, 3)).astype(np.float32)
    ref = np.einsum("mi,mio->mo", x, w[_groups(sizes)])
    with target_backend(backend):
        f = jax.jit(moe.grouped_matmul)
        y = f(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
        # gradients against the same product written as a gather of each row's weight
        dense = lambda x, w: jnp.sum(jnp.einsum("mi,mio->mo", x, w[_groups(sizes)]) ** 2)  # noqa: E731
        grouped = lambda x, w: jnp.sum(moe.grouped_matmul(x, w, jnp.asarray(sizes)) ** 2)  # noqa: E731
        g = jax.grad(grouped, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    g_ref = jax.grad(dense, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def _numpy_moe(x, logits, k, normalize, wg, wu, wd):
    """Token by token: softmax, top-k (ties to the lower index), weighted SwiGLU experts."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:k]
        w = p[top] / (p[top].sum() if normalize else 1.0)
        for e, we in zip(top, w):
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            out[t] += we * ((g / (1 + np.exp(-g))) * u) @ wd[e]
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_sparse_ffn_matches_numpy(normalize):
    rng = np.random.default_rng(1)
    n, d, f, e, k = 23, 6, 5, 4, 2
    x = rng.normal(size=(n, d)).astype(np.float32)
    wr = rng.normal(size=(d, e)).astype(np.float32)
    wg, wu = (rng.normal(size=(e, d, f)).astype(np.float32) for _ in range(2))
    wd = rng.normal(size=(e, f, d)).astype(np.float32)
    logits = x @ wr
    weights, experts, own = moe.route(jnp.asarray(logits), k, normalize=normalize)
    chex.assert_shape((weights, experts, own), (n, k))
    y = moe.sparse_ffn(
        jnp.asarray(x),
        experts,
        weights,
        jnp.asarray(wg),
        jnp.asarray(wu),
        jnp.asarray(wd),
        jax.nn.silu,
    )
    np.testing.assert_allclose(
        np.asarray(y), _numpy_moe(x, logits, k, normalize, wg, wu, wd), rtol=1e-4, atol=1e-4
    )


def test_route_replay_uses_recorded_experts_and_own_probabilities():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    recorded = jnp.asarray([[0, 1], [-1, -1]])
    weights, experts, own = moe.route(logits, 2, normalize=True, replay=recorded)
    np.testing.assert_array_equal(np.asarray(experts), [[0, 1], [0, 1]])  # row 1: its own top-2
    np.testing.assert_array_equal(np.asarray(own), [[3, 2], [0, 1]])
    p = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
    np.testing.assert_allclose(np.asarray(weights[0]), p, rtol=1e-6)


def _stats_of(logits, k, valid):
    _, experts, own = moe.route(logits, k, normalize=False)
    return moe.routed_stats(logits, experts, own, valid, None)


def test_load_balance_loss_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(2)
    layers, b, t, e, k = 3, 2, 5, 6, 2
    gate = rng.normal(size=(layers, b * t, e)).astype(np.float32)
    mask = np.ones((b, t), np.int64)
    mask[0, :2] = 0
    ref = load_balancing_loss_func(
        tuple(torch.tensor(g) for g in gate), e, k, torch.tensor(mask)
    ).item()
    stats = jax.tree.map(
        lambda *xs: jnp.stack(xs),
        *(_stats_of(jnp.asarray(g), k, jnp.asarray(mask.reshape(-1) > 0)) for g in gate),
    )
    np.testing.assert_allclose(float(moe.load_balance_loss(stats)), ref, rtol=1e-5)


def test_router_z_loss_by_hand():
    logits = jnp.asarray([[0.0, 0.0], [1.0, 3.0], [9.0, 9.0]])
    stats = _stats_of(logits, 1, jnp.asarray([True, True, False]))
    lse = np.log([2.0, np.exp(1.0) + np.exp(3.0)])
    np.testing.assert_allclose(float(moe.router_z_loss(stats)), np.mean(lse**2), rtol=1e-6)


def test_router_losses_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    with jax.enable_x64():
        x = jnp.asarray(rng.normal(size=(2, 11, 5)))
        w = jnp.asarray(rng.normal(size=(2, 5, 4)))
        valid = jnp.asarray(rng.random(11) > 0.2)

        def losses(w):
            stats = jax.tree.map(
                lambda *xs: jnp.stack(xs), *(_stats_of(x[i] @ w[i], 2, valid) for i in range(2))
            )
            return moe.load_balance_loss(stats) + 0.1 * moe.router_z_loss(stats)

        assert losses(w).dtype == jnp.float64
        check_grads(losses, (w,), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def _near_tied_model(rel: float = 1e-7, **overrides):
    """A tiny MoE whose routers have two pairs of experts tied to ``rel``: rounding picks."""
    m = T.init(ModelConfig(**{**TINY, **overrides}), jax.random.key(0), std=0.2)
    r = m.layers.router
    r = r.at[:, :, 1].set(r[:, :, 0] * (1 + rel)).at[:, :, 3].set(r[:, :, 2] * (1 - rel))
    return dataclasses.replace(m, layers=dataclasses.replace(m.layers, router=r))


def _rollout(model, record=True):
    ids = jax.random.randint(jax.random.key(1), (4, 6), 0, 64)
    mask = jnp.ones((4, 6), jnp.int32).at[0, :2].set(0)
    cfg = RolloutConfig(
        num_generations=4,
        max_new_tokens=12,
        sampling=SamplingConfig(temperature=1.0),
        record_routes=record,
    )
    return (
        ids,
        mask,
        jax.jit(lambda m, k: generate_program(m, ids, mask, k, cfg))(model, jax.random.key(2)),
    )


@pytest.mark.slow
def test_sampler_records_every_fed_token():
    model = _near_tied_model(dense_layers=(1,))
    _, mask, out = _rollout(model)
    c = model.config
    chex.assert_shape(out.routes.prompt, (4, 6, c.num_sparse_layers, 2))
    chex.assert_shape(out.routes.completion, (4, 4, 12, c.num_sparse_layers, 2))
    assert out.routes.completion.dtype == route_dtype(8) == jnp.int8
    fed = np.asarray(out.mask).astype(bool).copy()
    fed[..., -1] = False  # the last token is never fed back
    recorded = np.asarray(out.routes.completion[..., 0, 0]) >= 0
    np.testing.assert_array_equal(recorded & fed, fed)
    assert np.all(np.asarray(out.routes.prompt)[np.asarray(mask) > 0] >= 0)
    assert _rollout(model, record=False)[2].routes is None


@pytest.mark.slow
def test_routing_replay_makes_trainer_logprobs_the_samplers():
    """Near-tied routers: the trainer's forward routes some tokens differently from the sampler's
    (its log-probs then differ by far more than rounding); replaying the recorded experts makes
    them equal to rounding, padded, packed and one group per pass."""
    model = _near_tied_model(dense_layers=(1,))
    ids, mask, out = _rollout(model)
    valid = np.asarray(out.mask) > 0

    def diff(how: ForwardPass):
        lp, stats = completion_logprobs(
            model, ids, mask, out.tokens, out.mask, how, routes=out.routes
        )
        return np.max(np.abs(np.asarray(lp - out.logprobs))[valid]), stats

    free, stats = diff(ForwardPass(replay_routes=False, router_stats=True))
    assert float(jnp.sum(stats.differ)) > 0 and free > 1e-2
    for how in (ForwardPass(router_stats=True), ForwardPass(groups_per_pass=1, router_stats=True)):
        replayed, _ = diff(how)
        assert replayed < 1e-5, how
    # every token is compared but each completion's last (sampled, never fed back: nothing recorded)
    last_unfed = np.asarray(out.lengths).size
    np.testing.assert_array_equal(np.asarray(stats.compared), np.asarray(stats.tokens) - last_unfed)


@pytest.mark.slow
def test_routing_replay_packed_layout():
    from relax.data.completion_layout import PackingConfig, pack_bins

    model = _near_tied_model()
    ids, mask, out = _rollout(model)
    short = np.asarray(out.mask).copy()
    short[:, :2, 5:] = 0  # ragged: half the completions end early, several groups to a bin
    out = dataclasses.replace(out, mask=jnp.asarray(short))
    p, lp = ids.shape
    _, g, n = out.tokens.shape
    sizes = PackingConfig().sizes(p, g, lp, n, block=4)
    packed = jax.tree.map(jnp.asarray, pack_bins(ids, mask, out.tokens, short, sizes))
    assert int(jnp.sum(packed.num_pairs > 0)) < p * g / 2
    lp = completion_logprobs(
        model, ids, mask, out.tokens, out.mask, routes=out.routes, packed=packed
    )
    valid = np.asarray(out.mask) > 0
    assert np.max(np.abs(np.asarray(lp - out.logprobs))[valid]) < 1e-5


@pytest.mark.slow
def test_sampler_logprobs_equal_trainer_logprobs_without_ties():
    model = T.init(ModelConfig(**TINY), jax.random.key(4), std=0.2)
    ids, mask, out = _rollout(model, record=False)
    lp = completion_logprobs(model, ids, mask, out.tokens, out.mask)
    valid = np.asarray(out.mask) > 0
    assert np.max(np.abs(np.asarray(lp - out.logprobs))[valid]) < 1e-5


def test_routes_replay_rows_layouts():
    c = Routes(
        prompt=jnp.arange(2 * 3 * 1 * 2).reshape(2, 3, 1, 2),
        completion=jnp.arange(2 * 2 * 4 * 1 * 2).reshape(2, 2, 4, 1, 2).astype(jnp.int8),
    )
    prompt, rows = c.replay_rows()
    chex.assert_shape((prompt, rows), [(1, 2, 3, 2), (1, 4, 4, 2)])
    np.testing.assert_array_equal(np.asarray(rows[0, 3]), np.asarray(c.completion[1, 1, :, 0]))
    # a bin's slots: prompt 1's token 2 (source 1 * 3 + 2), completion (1, 0)'s token 3, nothing
    slots = c.replay_slots(jnp.array([[5, 6 + (2 + 0) * 4 + 3, -1]]))
    np.testing.assert_array_equal(slots[0, 0, 0], c.prompt[1, 2, 0])
    np.testing.assert_array_equal(slots[0, 1, 0], c.completion[1, 0, 3, 0])
    np.testing.assert_array_equal(slots[0, 2], -1)


def test_moe_config_errors():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(**{**TINY, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="dense_layers"):
        ModelConfig(**{**TINY, "dense_layers": (3,)})
    with pytest.raises(ValueError, match="routing_replay"):
        moe.MoEConfig(routing_replay="trainer")


def test_mixed_layers_stack_per_kind():
    c = ModelConfig(**{**TINY, "dense_layers": (0, 2)})
    m = T.init(c, jax.random.key(0))
    assert c.sparse_layers == (False, True, False)
    assert (
        m.layers.w_gate.shape[0] == 2
        and m.layers.router.shape[0] == 1
        and m.layers.wq.shape[0] == 3
    )
    assert c.num_active_params() < c.num_params()


@pytest.mark.slow
def test_multi_turn_decoder_records_routes_the_trainer_replays():
    """The multi-turn decoder (cache carried across turns, an observation prefilled between them)
    records every fed token's experts; the trainer replaying them gets the decoder's log-probs
    at every sampled token, and without replay it routes some near-tied tokens otherwise."""
    from relax.rollout import turns

    model = _near_tied_model(dense_layers=(1,))
    p, g, n = 2, 3, 24
    prompt_ids = jnp.asarray(np.random.default_rng(0).integers(3, 64, (p, 8)), jnp.int32)
    prompt_mask = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8], jnp.int32)
    cfg = turns.TurnConfig(
        num_generations=g,
        max_tokens=n,
        max_turn_tokens=8,
        eos_ids=(5, 7),
        sampling=SamplingConfig(temperature=1.0),
    )
    state = turns.start(model, prompt_ids, prompt_mask, jax.random.key(1), cfg=cfg)
    state, _, _ = turns.decode_turn(model, state, jnp.ones(p * g, bool), cfg=cfg)
    obs = jnp.asarray(np.random.default_rng(1).integers(3, 64, (p * g, 4)), jnp.int32)
    state = turns.append(model, state, obs, jnp.asarray([3, 0, 4, 2, 1, 4], jnp.int32), cfg=cfg)
    state, _, _ = turns.decode_turn(model, state, jnp.ones(p * g, bool), cfg=cfg)
    filled = np.arange(n)[None, :] < np.asarray(state.length)[:, None]
    assert np.all(
        (np.asarray(state.routes[..., 0, 0]) >= 0) == filled
    )  # every fed token, nothing else
    routes = Routes(
        prompt=state.prompt_routes,
        completion=state.routes.reshape(p, g, n, *state.routes.shape[2:]),
    )
    sampled = np.asarray(state.sampled)
    mask = jnp.asarray(filled.astype(np.int32)).reshape(p, g, n)
    tokens = state.tokens.reshape(p, g, n)
    lp, stats = completion_logprobs(
        model, prompt_ids, prompt_mask, tokens, mask, ForwardPass(router_stats=True), routes=routes
    )
    np.testing.assert_allclose(
        np.asarray(lp).reshape(p * g, n)[sampled], np.asarray(state.logprobs)[sampled], atol=2e-5
    )
    _, free = completion_logprobs(
        model,
        prompt_ids,
        prompt_mask,
        tokens,
        mask,
        ForwardPass(replay_routes=False, router_stats=True),
        routes=routes,
    )
    assert float(jnp.sum(free.differ)) > 0
