"""The policy update: ``num_iterations`` epochs x ``num_minibatches`` optimizer steps, each a
sum of ``grad_accum`` micro-batch gradients (by default one prompt group per micro-batch on a
single CPU device), as nested ``lax.scan``s.

Minibatches are whole prompt groups (so the training forward shares each prompt across its G
completions). Loss normalisers are computed ONCE from the whole batch and divided by the
number of minibatches::

    num_tokens = (valid loss tokens in the batch) / num_minibatches
    num_sequences = (valid sequences in the batch) / num_minibatches

so every token weighs the same in every optimizer step however the tokens fall into
minibatches, and summing micro-batch losses gives exactly the minibatch loss: gradient
accumulation does not change what the loss means.

While the policy is bitwise the reference (``ref_is_policy``: the first iteration of a static
reference, or right after a reset), the reference log-probs in the loss are the policy's own
from this very forward, under a stop-gradient::

    log pi_ref(y_t) := stopgrad(log pi_theta(y_t))    =>   KL_t = 0 and dKL_t/dtheta = 0 (k2, k3)

Recomputed in another pass layout (another mesh, another micro-batch split) they would differ by
rounding, and Adam's normalisation turns such a ~1e-10 gradient on rows that get no other
gradient into a learning-rate-sized step that differs per layout. The flag is carried through
the optimizer steps and cleared by the first step that changes the policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from relax.losses.aggregation import aggregate
from relax.losses.kl import conservative_penalty, entropy_bonus, kl_estimate
from relax.losses.policy import cispo, ppo_clip, reinforce
from relax.masked import masked_mean
from relax.parallel import cache_sized_passes
from relax.reference import params_equal
from relax.train.config import GRPOConfig
from relax.train.forward import completion_logprobs, completion_rope
from relax.train.health import first_nonfinite_leaf


def _policy_loss(cfg: GRPOConfig, logp, old_logp, adv, mask):
    if cfg.policy_loss == "ppo":
        return ppo_clip(logp, old_logp, adv, mask, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                        delta=cfg.delta, clip_ratio_c=cfg.clip_ratio_c, importance=cfg.importance_sampling_level)
    if cfg.policy_loss == "cispo":
        return cispo(logp, old_logp, adv, mask, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high)
    return reinforce(logp, adv, mask)


# On cache-sized passes (one CPU device) the policy's forward+backward unrolls its layer loop (the
# backward then reads each layer's residuals in place instead of stacking them; deeper models keep
# the scan, whose compile time does not grow with depth) and keeps the group attention's
# probabilities for the backward when one layer's (float32 [P, Hq, G, N, Lp+N]) fit this budget.
UNROLL_MAX_LAYERS = 8
SAVED_PROBS_BYTES = 64 * 2**20


def make_loss(cfg: GRPOConfig):
    """``loss(policy, minibatch, norms) -> (scalar, metrics)`` for one (micro-)batch of groups."""

    def loss_fn(policy, mb, norms, ref_is_policy=False):
        p, g, n = mb["tokens"].shape
        c, lp = policy.config, mb["prompt_ids"].shape[1]
        cache = cache_sized_passes()  # small passes on one CPU device: see UNROLL_MAX_LAYERS
        probs_bytes = 4 * p * c.num_heads * g * n * (lp + n)  # one layer's attention probabilities
        logp, ent = completion_logprobs(policy, mb["prompt_ids"], mb["prompt_mask"], mb["tokens"], mb["mask"],
                                        temperature=cfg.temperature, with_entropy=True, remat=cfg.remat,
                                        attention=cfg.train_attention, remat_policy=cfg.remat_policy,
                                        entropy_grad=cfg.entropy_coef != 0.0,  # else a metric only
                                        unroll=cache and c.num_layers <= UNROLL_MAX_LAYERS,
                                        save_attention=cache and probs_bytes <= SAVED_PROBS_BYTES,
                                        rope=mb.get("rope"))
        flat = lambda x: x.reshape(p * g, n)
        logp, ent, mask, old = flat(logp), flat(ent), flat(mb["loss_mask"]).astype(bool), flat(mb["old_logprobs"])
        adv = mb["advantages"].reshape((p * g,) + mb["advantages"].shape[2:])  # [B] or [B, N]
        per_token, metrics = _policy_loss(cfg, logp, old, adv, mask)
        metrics = dict(metrics)
        if cfg.beta > 0:
            # masked inside (inputs zeroed first): no inf/NaN from padding reaches the gradient
            ref = jnp.where(ref_is_policy, jax.lax.stop_gradient(logp), flat(mb["ref_logprobs"]))
            kl = kl_estimate(logp, ref, cfg.kl_estimator, mask=mask)
            metrics["kl"] = masked_mean(kl, mask)
            if cfg.kl_threshold is not None:  # Signal's one-sided conservative penalty
                per_token = per_token + jnp.where(mask, conservative_penalty(
                    kl, threshold=cfg.kl_threshold, coef=cfg.beta), 0.0)
            elif not cfg.kl_in_reward:
                per_token = per_token + cfg.beta * kl
        if cfg.entropy_coef != 0.0:
            per_token = per_token + entropy_bonus(ent, mask, coef=cfg.entropy_coef)
        metrics["entropy"] = masked_mean(ent, mask)
        metrics["sampler_logprob_diff"] = jnp.max(jnp.where(mask, jnp.abs(logp - old), 0.0))
        loss = aggregate(per_token, mask, cfg.loss_type, num_sequences=norms["sequences"],
                         num_tokens=norms["tokens"], max_len=cfg.max_new_tokens)
        return loss, metrics

    return loss_fn


def make_update(cfg: GRPOConfig, optimizer: optax.GradientTransformation):
    """``update(policy, opt_state, data, key, ref_is_policy=False) -> (policy, opt_state, metrics)``.

    ``data`` holds per-prompt arrays with a leading ``[P]`` axis: ``prompt_ids``, ``prompt_mask``,
    ``tokens``/``mask``/``loss_mask``/``old_logprobs`` (and ``ref_logprobs``) ``[P, G, N]``,
    ``advantages`` ``[P, G]``. Metrics are averaged over optimizer steps; ``loss`` is the mean
    minibatch loss. ``ref_is_policy`` (a bool scalar): the policy is bitwise the reference model
    (module docstring).
    """
    loss_fn = make_loss(cfg)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    m = cfg.num_minibatches

    def update(policy, opt_state, data, key, ref_is_policy=False):
        p = data["prompt_ids"].shape[0]
        if p % m:
            raise ValueError(f"{p} prompts per batch do not split into num_minibatches={m}")
        a = cfg.grad_accum if cfg.grad_accum is not None else (p // m if cache_sized_passes() else 1)
        if p % (m * a):
            raise ValueError(f"{p} prompts per batch do not split into num_minibatches={m} x grad_accum={a}")
        _, g, n = data["tokens"].shape
        # rotary tables once for all epochs and micro-batches, outside their loops (see completion_rope)
        data = {**data, "rope": completion_rope(policy.config, data["prompt_mask"], g, n)}
        seq_valid = jnp.any(data["loss_mask"] > 0, axis=-1)
        norms = {"tokens": jnp.maximum(jnp.sum(data["loss_mask"]), 1) / m,
                 "sequences": jnp.maximum(jnp.sum(seq_valid), 1) / m}

        def minibatch(carry, mb):
            policy, opt_state, same = carry

            def micro(acc, micro_batch):
                (loss, metrics), grads = grad_fn(policy, micro_batch, norms, same)
                return jax.tree.map(jnp.add, acc, grads), (loss, metrics, jnp.sum(micro_batch["loss_mask"]))

            zeros = jax.tree.map(jnp.zeros_like, policy)
            grads, (losses, metrics, tokens) = jax.lax.scan(micro, zeros, mb)
            skips = consecutive_skipped_updates(opt_state)
            updates, opt_state = optimizer.update(grads, opt_state, policy)
            new_policy = optax.apply_updates(policy, updates)
            # still the reference only if this step left every weight as it was (lr 0, a skipped step)
            same = jax.lax.cond(same, lambda: params_equal(new_policy, policy, smallest_first=cache_sized_passes()),
                                lambda: jnp.bool_(False))
            policy = new_policy
            metrics = reduce_metrics(metrics, weights=tokens)  # the step's metrics, however micro-batched
            metrics["loss"] = jnp.sum(losses)
            metrics["grad_norm"] = optax.tree.norm(grads)
            # -1: all finite (relax.train.health); looked for only when the step was skipped
            metrics["first_nonfinite_grad"] = jax.lax.cond(consecutive_skipped_updates(opt_state) > skips,
                                                           lambda: first_nonfinite_leaf(grads), lambda: -1)
            return (policy, opt_state, same), metrics

        def epoch(carry, epoch_key):
            perm = jax.random.permutation(epoch_key, p)
            split = lambda x: x[perm].reshape((m, a, p // (m * a)) + x.shape[1:])
            return jax.lax.scan(minibatch, carry, jax.tree.map(split, data))

        keys = jax.random.split(key, cfg.num_iterations)
        same = jnp.asarray(ref_is_policy, bool)
        (policy, opt_state, _), metrics = jax.lax.scan(epoch, (policy, opt_state, same), keys)
        # the sampler/trainer mismatch is only meaningful before the first optimizer step
        first_diff = metrics.pop("sampler_logprob_diff")[0, 0]
        metrics = reduce_metrics(metrics)
        metrics["sampler_logprob_diff"] = first_diff
        return policy, opt_state, metrics

    return update


def reduce_metrics(metrics: dict, weights: jax.Array | None = None) -> dict:
    """Metrics stacked over micro-batches or steps -> one value each. Extremes stay extremes
    (``*_max`` and the sampler/trainer difference by max, ``*_min`` by min), the first non-finite
    gradient leaf is the first step's that has one; the rest are means,
    weighted by ``weights`` (the micro-batches' loss tokens: a micro-batch's masked mean then
    counts as its tokens, and the step's metric is the one of the whole minibatch)::

        mean = sum_i w_i x_i / sum_i w_i      (plain mean when every w_i is 0)
    """
    def one(name, x):
        if name == "first_nonfinite_grad":  # that of the first step with one, else -1
            x = x.reshape(-1)
            return x[jnp.argmax(x >= 0)]
        if name.endswith("_max") or name == "sampler_logprob_diff":
            return jnp.max(x)
        if name.endswith("_min"):
            return jnp.min(x)
        if weights is None:
            return jnp.mean(x)
        w = weights.astype(x.dtype)  # one scalar metric per micro-batch: x and w are both [a]
        total = jnp.sum(w)
        return jnp.where(total > 0, jnp.sum(w * x) / jnp.where(total > 0, total, 1), jnp.mean(x))
    return {k: one(k, v) for k, v in metrics.items()}


def skipped_updates(opt_state) -> jax.Array:
    """Total optimizer steps skipped for non-finite gradients (``optax.apply_if_finite``)."""
    return opt_state.total_notfinite


def consecutive_skipped_updates(opt_state) -> jax.Array:
    """Optimizer steps skipped in a row, up to the last one (0 after a step that applied)."""
    return opt_state.notfinite_count
