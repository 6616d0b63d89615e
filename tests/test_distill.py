"""Knowledge distillation: chunked divergences over the vocabulary (against the full-logit
formulas), and the trainer (off-policy, on-policy, mixed; zero at student = teacher; learning;
gradient accumulation; vocabulary checks)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.algorithms.cli.configure import configure
from relax.algorithms.distill import (
    DistillBatch,
    DistillConfig,
    init_distill_state,
    make_distill_step,
    make_distill_update,
    make_loss,
)
from relax.algorithms.distill.step import MIX_STREAM, rollout_config, teacher_hidden
from relax.algorithms.online.stages import ROLLOUT_STREAM
from relax.models import ModelConfig, init
from relax.models.forward.config import ForwardConfig
from relax.models.forward.prefix_shared import completion_hidden
from relax.models.heads.distill import divergence_from_hidden, divergence_rows, resolve_divergence
from relax.objectives.preference import distillation_loss
from relax.passes import Passes
from relax.rollout.sampler import compiled_generate
from relax.train.optimizer import OptimizerConfig
from relax.train.update import LossContext

RNG = np.random.default_rng(0)
STUDENT = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
TEACHER = ModelConfig(
    vocab_size=16,
    hidden_size=48,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    max_position_embeddings=64,
)
P, G, LP, N = 4, 1, 3, 5


# ----------------------------------------------------------------------------- the divergences


def heads(n=7, ds=5, dt=6, v=11):
    """Student and teacher heads and hidden states (float64 inside ``jax.enable_x64``)."""
    ws, hs = RNG.normal(size=(v, ds)), RNG.normal(size=(n, ds))
    wt, ht = RNG.normal(size=(v, dt)), 1.5 * RNG.normal(size=(n, dt))
    return ws, hs, wt, ht


def np_jsd(s, t, beta, T):
    """GKD's generalized JSD, TRL's convention (beta weights the teacher), in numpy float64."""

    def log_softmax(x):
        x = x / T
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lq, lp = log_softmax(s), log_softmax(t)
    lm = np.logaddexp(np.log(beta) + lp, np.log1p(-beta) + lq)
    return beta * (np.exp(lp) * (lp - lm)).sum(-1) + (1 - beta) * (np.exp(lq) * (lq - lm)).sum(-1)


def jnp_jsd(s, t, beta, T):
    """The same, unchunked, differentiable (TRL's log-sum-exp mixture)."""
    lq, lp = jax.nn.log_softmax(s / T, -1), jax.nn.log_softmax(jax.lax.stop_gradient(t) / T, -1)
    lm = jnp.logaddexp(jnp.log(beta) + lp, jnp.log1p(-beta) + lq)
    return beta * jnp.sum(jnp.exp(lp) * (lp - lm), -1) + (1 - beta) * jnp.sum(
        jnp.exp(lq) * (lq - lm), -1
    )


def assert_same_grads(chunked, reference, *args):
    """Values and gradients (in every argument, of a weighted sum over rows) agree."""
    w = jnp.asarray(RNG.uniform(0.5, 1.5, size=np.shape(chunked(*args))))
    np.testing.assert_allclose(chunked(*args), reference(*args), rtol=1e-10, atol=1e-12)
    ga = jax.grad(lambda *a: jnp.sum(w * chunked(*a)), argnums=tuple(range(len(args))))(*args)
    gb = jax.grad(lambda *a: jnp.sum(w * reference(*a)), argnums=tuple(range(len(args))))(*args)
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("T", [1.0, 2.0])
@pytest.mark.slow
def test_kl_matches_distillation_loss(direction, T):
    """Chunked KL from hidden states = ``distillation_loss`` on the full logits (without its T^2),
    values and gradients in the student's head and hidden states; chunks of 3 rows (7 rows: a
    padded last chunk) and one chunk."""
    with jax.enable_x64(True):
        ws, hs, wt, ht = heads()
        mask = np.ones(hs.shape[0], bool)

        def ref(w, h):
            loss, _ = distillation_loss(
                (h @ w.T)[None], (ht @ wt.T)[None], mask[None], temperature=T, direction=direction
            )
            return loss[0] / T**2

        for chunk in (3, 64):
            div = resolve_divergence(direction, temperature=T)
            chunked = lambda w, h: divergence_rows(w, h, wt, ht, div, chunk_size=chunk)[0]  # noqa: E731
            assert_same_grads(chunked, ref, jnp.asarray(ws), jnp.asarray(hs))


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_matches_numpy_and_unchunked_gradient(beta):
    with jax.enable_x64(True):
        ws, hs, wt, ht = heads()
        T = 1.5
        div = resolve_divergence("jsd", beta=beta, temperature=T)
        chunked = lambda w, h: divergence_rows(w, h, wt, ht, div, chunk_size=3)[0]  # noqa: E731
        np.testing.assert_allclose(
            chunked(ws, hs), np_jsd(hs @ ws.T, ht @ wt.T, beta, T), rtol=1e-10
        )
        assert_same_grads(
            chunked,
            lambda w, h: jnp_jsd(h @ w.T, ht @ wt.T, beta, T),
            jnp.asarray(ws),
            jnp.asarray(hs),
        )
        # finite differences along a random direction of the student's hidden states
        d, eps = RNG.normal(size=hs.shape), 1e-6
        f = lambda h: float(jnp.sum(chunked(ws, h)))  # noqa: E731
        numeric = (f(hs + eps * d) - f(hs - eps * d)) / (2 * eps)
        analytic = float(jnp.sum(jax.grad(lambda h: jnp.sum(chunked(ws, h)))(jnp.asarray(hs)) * d))
        assert numeric == pytest.approx(analytic, rel=1e-6)


def test_jsd_end_points_are_trl_forward_and_reverse_kl():
    """TRL: ``beta = 0`` is KL(teacher || student), ``beta = 1`` KL(student || teacher); in between
    the JSD lies below both (bounded by ``beta`` / ``1 - beta`` times them near the ends)."""
    ws, hs, wt, ht = (jnp.asarray(x, jnp.float32) for x in heads())
    rows = lambda kind, beta=0.5: divergence_rows(
        ws, hs, wt, ht, resolve_divergence(kind, beta=beta)
    )[0]  # noqa: E731
    np.testing.assert_array_equal(rows("jsd", 0.0), rows("forward"))
    np.testing.assert_array_equal(rows("jsd", 1.0), rows("reverse"))
    assert resolve_divergence("jsd", beta=0.0).kind == "forward"
    assert resolve_divergence("jsd", beta=1.0).kind == "reverse"
    with jax.enable_x64(
        True
    ):  # the limits: JSD / beta -> KL(p || q), JSD / (1 - beta) -> KL(q || p)
        mild = [jnp.asarray(0.5 * x) for x in heads()]
        rows64 = lambda kind, beta=0.5: divergence_rows(*mild, resolve_divergence(kind, beta=beta))[
            0
        ]  # noqa: E731
        np.testing.assert_allclose(rows64("jsd", 1e-8) / 1e-8, rows64("forward"), rtol=1e-5)
        np.testing.assert_allclose(rows64("jsd", 1 - 1e-8) / 1e-8, rows64("reverse"), rtol=1e-5)
    assert np.all(rows("jsd", 0.5) <= np.minimum(rows("forward"), rows("reverse")) + 1e-6)
    with pytest.raises(ValueError, match="beta"):
        resolve_divergence("jsd", beta=1.5)
    with pytest.raises(ValueError, match="divergence"):
        resolve_divergence("tvd")


@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_identical_distributions_give_zero_and_zero_gradient(kind):
    """Bitwise equal log-softmaxes give exactly 0; the same head and hidden states through the
    chunked kernel give 0 up to float rounding (two fusions of the same logits may round their last
    bits differently), and so does the gradient."""
    from relax.models.heads.distill import _value

    ws, hs, _, _ = (jnp.asarray(x, jnp.float32) for x in heads())
    div = resolve_divergence(kind, beta=0.3, temperature=0.7)
    lq = jax.nn.log_softmax(hs @ ws.T / 0.7, -1)
    assert np.all(np.asarray(_value(div, lq, lq)) == 0.0)
    f = lambda w, h: divergence_rows(w, h, ws, hs, div, chunk_size=4)  # noqa: E731
    value, agree, _ = f(ws, hs)
    np.testing.assert_allclose(value, 0.0, atol=1e-6)
    assert np.all(np.asarray(agree) == 1.0)
    gw, gh = jax.grad(lambda w, h: jnp.sum(f(w, h)[0]), argnums=(0, 1))(ws, hs)
    np.testing.assert_allclose(gw, 0.0, atol=1e-6)
    np.testing.assert_allclose(gh, 0.0, atol=1e-6)


def test_teacher_gets_no_gradient_and_metrics_are_metrics():
    ws, hs, wt, ht = (jnp.asarray(x, jnp.float32) for x in heads())
    div = resolve_divergence("jsd", beta=0.4)
    g = jax.grad(lambda w, h: jnp.sum(divergence_rows(ws, hs, w, h, div)[0]), argnums=(0, 1))(
        wt, ht
    )
    assert all(np.all(np.asarray(x) == 0.0) for x in g)
    # agreement and entropy: stop-gradients; values as from the full logits
    _, agree, ent = divergence_rows(ws, hs, wt, ht, div, chunk_size=2)
    s, t = hs @ ws.T, ht @ wt.T
    np.testing.assert_array_equal(
        agree, (jnp.argmax(s, -1) == jnp.argmax(t, -1)).astype(jnp.float32)
    )
    lq = jax.nn.log_softmax(s, -1)
    np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(lq) * lq, -1), rtol=1e-5)
    assert np.all(
        np.asarray(jax.grad(lambda h: jnp.sum(divergence_rows(ws, h, wt, ht, div)[1]))(hs)) == 0
    )


def test_teacher_with_masked_vocabulary_stays_finite():
    """A teacher probability of exactly 0 (a -inf logit: a vocabulary entry it never emits) keeps
    the forward KL and the JSD finite (the per-row formula on log-softmaxes)."""
    from relax.models.heads.distill import _value

    ws, hs, wt, ht = (jnp.asarray(x, jnp.float32) for x in heads())
    lq = jax.nn.log_softmax(hs @ ws.T, -1)
    lp = jax.nn.log_softmax((ht @ wt.T).at[:, 0].set(-jnp.inf), -1)
    for kind in ("forward", "jsd"):
        assert np.all(np.isfinite(_value(resolve_divergence(kind, beta=0.5), lq, lp))), kind


# ----------------------------------------------------------------------------- the trainer


def models(seed=0, teacher_cfg=TEACHER):
    ks, kt = jax.random.split(jax.random.key(seed))
    return init(STUDENT, ks), init(teacher_cfg, kt)


def prompts(seed=1, p=P):
    ids = jax.random.randint(jax.random.key(seed), (p, LP), 1, STUDENT.vocab_size)
    mask = jnp.ones_like(ids).at[0, 0].set(0)  # one left-padded prompt
    return ids.at[0, 0].set(0), mask


def dataset_batch(seed=1, p=P, g=G, n=N):
    ids, pm = prompts(seed, p)
    tokens = jax.random.randint(jax.random.key(seed + 100), (p, g, n), 1, STUDENT.vocab_size)
    mask = jnp.ones((p, g, n), jnp.int32).at[1, :, 3:].set(0)  # one shorter completion
    return DistillBatch(prompt_ids=ids, prompt_mask=pm, tokens=tokens, mask=mask)


def state_of(student, teacher, lr=1e-2, seed=3):
    """A state of copies of the two models (a step donates its state's buffers)."""
    opt = OptimizerConfig(learning_rate=lr, max_grad_norm=None).make()
    return init_distill_state(copy(student), copy(teacher), opt, key=jax.random.key(seed))


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def held_out_kl(student, teacher, batch):
    """Token-mean forward KL of the student to the teacher on ``batch``'s completions."""
    hs = completion_hidden(student, batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask)
    ht = completion_hidden(teacher, batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask)
    kl, _, _ = divergence_from_hidden(student, hs, teacher, ht, divergence="forward")
    m = batch.mask > 0
    return float(jnp.sum(jnp.where(m, kl, 0.0)) / jnp.sum(m))


def test_config_checks():
    with pytest.raises(ValueError, match="divergence"):
        configure(DistillConfig, divergence="tv")
    with pytest.raises(ValueError, match="mode"):
        configure(DistillConfig, mode="sometimes")
    with pytest.raises(ValueError, match="lmbda"):
        configure(DistillConfig, mode="mixed", lmbda=1.5)
    with pytest.raises(ValueError, match="beta"):
        configure(DistillConfig, divergence="jsd", jsd_beta=-0.1)
    with pytest.raises(ValueError, match="grad_accum"):
        configure(DistillConfig, grad_accum=0)
    assert configure(DistillConfig, divergence="jsd", jsd_beta=0.5).metric_name == "jsd"
    assert configure(DistillConfig, divergence="jsd", jsd_beta=0.0).metric_name == "kl"


@pytest.mark.slow
def test_student_equal_to_teacher_gives_zero_divergence_and_gradient():
    """The loss on a micro-batch with student = teacher: every divergence ~0 (the two forwards of
    the same weights differ only in summation order) and so is its gradient; top-1 agreement 1."""
    student, _ = models()
    batch = dataset_batch()
    passes = Passes(cache_sized=True)  # the teacher one group per pass, the student unrolled
    h = teacher_hidden(student, batch, passes, ForwardConfig(train_attention="group"))
    mb = dataclasses.replace(batch, loss_mask=batch.mask, teacher_hidden=h)
    ctx = LossContext({"tokens": jnp.sum(batch.mask).astype(jnp.float32)}, jnp.bool_(False))
    for divergence in ("forward", "reverse", "jsd"):
        cfg = configure(
            DistillConfig, divergence=divergence, temperature=1.3, train_attention="group"
        )
        loss_fn = make_loss(cfg, student, passes)
        (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
            student, mb, ctx
        )
        assert abs(float(loss)) < 1e-6 and abs(float(metrics[cfg.metric_name])) < 1e-6, divergence
        assert float(metrics["top1_agreement"]) == 1.0
        assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) < 1e-5, divergence


@pytest.mark.slow
def test_student_equal_to_teacher_through_the_step():
    student, _ = models()
    cfg = configure(DistillConfig, divergence="jsd", optimizer=OptimizerConfig())
    state = state_of(student, student)
    _, out = make_distill_step(cfg, Passes(), eos_ids=(), pad_id=0)(state, dataset_batch())
    assert abs(float(out.metrics["jsd"])) < 1e-6 and float(out.metrics["grad_norm"]) < 1e-5
    assert float(out.metrics["top1_agreement"]) == 1.0


@pytest.mark.slow  # the command line's learning test (tests/test_offline.py) is the fast one
def test_off_policy_distillation_reduces_held_out_kl():
    """Eight steps on fresh dataset batches (random completions) bring the student's forward KL to
    a sharpened random teacher down on held-out sequences."""
    student, teacher = models()
    teacher = eqx.tree_at(
        lambda m: m.lm_head, teacher, 4.0 * teacher.lm_head
    )  # peaked distributions
    held_out = dataset_batch(seed=7)
    before = held_out_kl(student, teacher, held_out)
    cfg = configure(DistillConfig, divergence="forward", mode="off_policy", train_attention="group")
    step = make_distill_step(cfg, Passes(), eos_ids=(), pad_id=0)
    state = state_of(student, teacher, lr=3e-3)
    kls = []
    for i in range(8):
        state, out = step(state, dataset_batch(seed=10 + i))
        kls.append(float(out.metrics["kl"]))
        assert (
            int(out.health["first_nonfinite"]) == -1 and int(out.health["consecutive_skips"]) == 0
        )
    assert int(state.step) == 8 and kls[-1] < kls[0]
    after = held_out_kl(state.policy, state.ref, held_out)
    assert after < 0.75 * before, (before, after)
    assert set(out.metrics) >= {
        "kl",
        "top1_agreement",
        "entropy",
        "loss",
        "grad_norm",
        "completion_length",
        "skipped_updates",
    }
    assert set(out.health) == {"first_nonfinite_grad", "first_nonfinite", "consecutive_skips"}
    # the teacher is never updated
    for a, b in zip(jax.tree.leaves(state.ref), jax.tree.leaves(teacher)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_on_policy_samples_from_the_student_and_trains():
    student, teacher = models()
    cfg = configure(
        DistillConfig,
        divergence="reverse",
        mode="on_policy",
        num_generations=2,
        max_new_tokens=4,
        temperature=1.0,
    )
    ids, pm = prompts()
    state = state_of(student, teacher, seed=3)
    key = jax.random.key(3)  # the state's (its own buffer is donated to the step)
    step = make_distill_step(cfg, Passes(), eos_ids=(3,), pad_id=0)
    state, out = step(state, DistillBatch(prompt_ids=ids, prompt_mask=pm))
    # the student's sampler with the state's rollout key produced exactly these completions
    generate = compiled_generate(rollout_config(cfg, eos_ids=(3,), pad_id=0))
    want = generate(student, ids, pm, jax.random.fold_in(key, ROLLOUT_STREAM))
    np.testing.assert_array_equal(out.batch.tokens, want.tokens)
    np.testing.assert_array_equal(out.batch.mask, want.mask)
    np.testing.assert_array_equal(out.batch.loss_mask, want.mask)
    assert out.batch.tokens.shape == (P, 2, 4) and bool(out.batch.on_policy)
    teacher_sample = generate(teacher, ids, pm, jax.random.fold_in(key, ROLLOUT_STREAM))
    assert not np.array_equal(
        teacher_sample.tokens, want.tokens
    )  # the student's, not the teacher's
    assert np.isfinite(float(out.metrics["kl"])) and float(out.metrics["on_policy"]) == 1.0
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(state.policy), jax.tree.leaves(student))
    ]
    assert any(changed)
    # the next step samples with the new key: other completions
    _, out2 = step(state, DistillBatch(prompt_ids=ids, prompt_mask=pm))
    assert not np.array_equal(out2.batch.tokens, out.batch.tokens)


@pytest.mark.slow
def test_mixed_mode_takes_sampled_or_dataset_completions_by_its_coin():
    student, teacher = models()
    batch = dataset_batch()
    for lmbda in (0.0, 1.0):
        cfg = configure(
            DistillConfig, mode="mixed", lmbda=lmbda, num_generations=G, max_new_tokens=N
        )
        state = state_of(student, teacher, seed=3)
        key = jax.random.key(3)
        _, out = make_distill_step(cfg, Passes(), eos_ids=(), pad_id=0)(state, batch)
        if lmbda == 0.0:
            np.testing.assert_array_equal(out.batch.tokens, batch.tokens)
            assert not bool(out.batch.on_policy)
        else:
            gen = compiled_generate(rollout_config(cfg, eos_ids=(), pad_id=0))
            want = gen(
                student,
                batch.prompt_ids,
                batch.prompt_mask,
                jax.random.fold_in(key, ROLLOUT_STREAM),
            )
            np.testing.assert_array_equal(out.batch.tokens, want.tokens)
            assert bool(out.batch.on_policy)
    assert MIX_STREAM != ROLLOUT_STREAM
    with pytest.raises(ValueError, match="num_generations, max_new_tokens"):
        cfg = configure(DistillConfig, mode="mixed", num_generations=2, max_new_tokens=N)
        make_distill_step(cfg, Passes(), eos_ids=(), pad_id=0)(state_of(student, teacher), batch)


def test_vocabulary_mismatch_is_a_clear_error():
    student, _ = models()
    _, teacher = models(teacher_cfg=ModelConfig(**{**TEACHER.__dict__, "vocab_size": 20}))
    opt = OptimizerConfig().make()
    with pytest.raises(ValueError, match=r"teacher's vocabulary \(20 rows.*student's \(16 rows"):
        init_distill_state(student, teacher, opt, key=jax.random.key(0))
    with pytest.raises(ValueError, match="same tokenizer and vocabulary size"):
        divergence_from_hidden(student, jnp.zeros((2, 32)), teacher, jnp.zeros((2, 48)))
    # a state assembled by hand is checked by the step
    from relax.train.state import init_state

    state = init_state(student, opt, key=jax.random.key(0)).replace(ref=teacher)
    with pytest.raises(ValueError, match="vocabulary"):
        make_distill_step(
            configure(
                DistillConfig,
            ),
            Passes(),
            eos_ids=(),
            pad_id=0,
        )(state, dataset_batch())


@pytest.mark.slow
def test_grad_accumulation_gives_the_same_update():
    student, teacher = models()
    batch = dataset_batch()
    cfg1 = configure(
        DistillConfig, divergence="jsd", jsd_beta=0.3, grad_accum=1, train_attention="group"
    )
    cfg2 = configure(
        DistillConfig, divergence="jsd", jsd_beta=0.3, grad_accum=2, train_attention="group"
    )
    h = teacher_hidden(teacher, batch, Passes(), ForwardConfig(train_attention="group"))
    data = dataclasses.replace(batch, loss_mask=batch.mask, teacher_hidden=h)
    opt = OptimizerConfig(learning_rate=1e-2).make()
    out = []
    for cfg in (cfg1, cfg2):
        update = jax.jit(make_distill_update(cfg, opt, teacher, Passes()))
        out.append(update(student, opt.init(student), data, jax.random.key(0)))
    (p1, _, m1), (p2, _, m2) = out
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["jsd"], m2["jsd"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
