"""Every objective by name over a batch: the loss its trainer runs, one call.

    grads, metrics = objective_forward_backward(state, rows, "grpo", beta=0.04, loss_type="token-mean")
    grads, metrics = objective_forward_backward(state, pairs, "dpo", beta=0.1)
    state = objective_optim_step(state, grads)      # the policy's and the value head's optimizers

(The research primitives ``relax.train.primitives.forward_backward`` / ``optim_step`` take a loss
function and step the policy alone; these take an objective's name and its ``Grads``.)

A name picks the trainer's loss function (``relax.algorithms.*``: the same code the trainers
run), built from that trainer's config with ``kwargs`` as its fields (``configure``: flat names,
e.g. a policy loss's own options), and takes the gradient of it over the whole batch as one
micro-batch, with the batch's own normalisers (its loss tokens, sequences or pairs), so the loss
and metrics are what the trainer's update reports for the same batch in one micro-batch and one
optimizer step. ``OBJECTIVES`` lists the names:

====================  ==================  ===================================  =====================================
name                  batch               trains                               kwargs (fields of)
====================  ==================  ===================================  =====================================
``causal_lm``         ``PackedBatch``     the policy                           ``SFTConfig`` (``remat``)
``dpo``, ``ipo``,     ``PairBatch``       the policy                           ``DPOConfig`` (``beta``, ``loss_type``,
``simpo``, ``orpo``   (``ref_logps``                                           ``label_smoothing``, ...); the name sets
                      unless reference-                                        ``loss_type``
                      free)
``kto``               ``UnpairedBatch``   the policy                           ``KTOConfig`` (``beta``,
                      (``ref_logps``;                                          ``desirable_weight``, ...)
                      ``kl``: else ``z0``
                      from the policy)
``reward_modeling``   ``PairBatch``       ``state.policy``, a ``RewardModel``  ``RewardModelConfig``
                      (``margin``)                                             (``center_rewards_coefficient``)
``ppo``               ``ValueRows``       the policy and ``state.critic``, a   ``PPOConfig`` (``vf_coef``,
                                          ``ValueHead`` (one joint loss)       ``cliprange_value``, ``kl_coef``, ...)
``ppo`` (no value     ``LossRows``        the policy                           as the policy losses below
head), the policy
registry's names
====================  ==================  ===================================  =====================================

The policy registry's names (``relax.objectives.registry.POLICY_LOSSES``: ``grpo``, ``dapo``,
``gspo``, ``cispo``, ``reinforce``, ``importance_sampling``, ``conservative_ppo``; ``ppo`` on a
state without a value head) run GRPO's loss (``relax.algorithms.grpo.loss``) with that policy
loss: kwargs are the loss's own options and ``GRPOConfig``'s ``loss_type``, ``beta`` (a KL to
``rows.ref_logprobs``), ``kl_estimator``, ``kl_threshold``, ``entropy_coef``, ``temperature``,
``max_new_tokens`` (``seq-mean-token-sum-norm``'s constant; default: the batch's ``N``, as a
trainer's batch is padded to its budget).

``ppo`` with a value head (``state.critic`` a ``ValueHead``) is PPO's joint loss
(``relax.algorithms.ppo.loss.make_joint_loss``): the policy loss plus ``vf_coef`` times the
clipped value loss. Its ``ValueRows`` carry either ``advantages``, ``returns`` and ``old_values``,
or ``rewards`` (a score per completion): then GAE runs inside on the value head's values
(``relax.algorithms.ppo.step.gae_terms``), with the KL to ``ref_logprobs`` in the token rewards
when ``kl_coef > 0``, and the metrics add ``explained_variance``, ``returns_mean`` and
``values_mean``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from relax import metrics as M
from relax.algorithms.cli.configure import configure
from relax.algorithms.dpo.config import DPOConfig
from relax.algorithms.dpo.loss import make_dpo_loss
from relax.algorithms.dpo.loss import pair_normalizers as dpo_normalizers
from relax.algorithms.dpo.step import pair_rows
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.loss import make_loss as make_grpo_loss
from relax.algorithms.kto.config import KTOConfig
from relax.algorithms.kto.loss import kto_normalizers, make_kto_loss
from relax.algorithms.kto.step import make_reference_point, own_rows
from relax.algorithms.online.batch import LossRows
from relax.algorithms.ppo.batch import CriticRows
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.loss import make_joint_loss
from relax.algorithms.ppo.step import gae_terms, kl_token_rewards
from relax.algorithms.preference.pairs import shared_forward
from relax.algorithms.preference.update import with_loss_mask
from relax.algorithms.reward_model.config import RewardModelConfig
from relax.algorithms.reward_model.loss import make_loss as make_rm_loss
from relax.algorithms.reward_model.loss import pair_normalizers as rm_normalizers
from relax.algorithms.reward_model.step import pair_data
from relax.algorithms.sft.config import SFTConfig
from relax.algorithms.sft.loss import make_sft_loss
from relax.data.pairs import PairBatch, UnpairedBatch
from relax.data.supervised import PackedBatch
from relax.masked import masked_mean
from relax.models.adapters.operations import split_trainable
from relax.models.heads.critic import ValueHead, completion_head_values
from relax.objectives.advantages import whiten
from relax.objectives.registry import POLICY_LOSSES
from relax.passes import Passes, choose_passes
from relax.train import primitives
from relax.train.state import TrainState, apply_updates
from relax.train.update import LossContext, token_normalizers

__all__ = [
    "OBJECTIVES",
    "Grads",
    "ValueRows",
    "objective_forward_backward",
    "make_objective_forward_backward",
    "objective_loss",
    "objective_optim_step",
]

DPO_NAMES = ("dpo", "ipo", "simpo", "orpo")


class Grads(NamedTuple):
    """An ``objective_forward_backward``'s gradients: of the policy's trainable leaves (None at
    frozen ones, a LoRA policy's base) and, for ``ppo`` with a value head, of ``state.critic``."""

    policy: Any
    critic: Any = None


class ValueRows(eqx.Module):
    """PPO's batch with a value head. ``loss_mask`` defaults to ``mask``. Either ``advantages``,
    ``returns`` and ``old_values`` (computed by the caller), or ``rewards`` (one score per
    completion, on its last valid token; GAE inside), with ``ref_logprobs`` when ``kl_coef > 0``."""

    prompt_ids: Int[Array, "p lp"]
    prompt_mask: Int[Array, "p lp"]
    tokens: Int[Array, "p g n"]
    mask: Int[Array, "p g n"]
    old_logprobs: Float[Array, "p g n"]
    loss_mask: Int[Array, "p g n"] | None = None
    rewards: Float[Array, "p g"] | None = None
    ref_logprobs: Float[Array, "p g n"] | None = None
    advantages: Float[Array, "p g n"] | None = None
    returns: Float[Array, "p g n"] | None = None
    old_values: Float[Array, "p g n"] | None = None


@dataclasses.dataclass(frozen=True)
class Objective:
    """One name: the batch type it reads and how it builds ``(params, loss(params) -> (scalar,
    metrics))`` from the state, the batch and the kwargs."""

    batch: type
    build: Callable[..., tuple[Any, Callable]]


def _context(norms) -> LossContext:
    return LossContext(dict(norms), jnp.bool_(False))


def _check_batch(name: str, batch, cls: type) -> None:
    if not isinstance(batch, cls):
        raise TypeError(
            f"objective {name!r} takes a {cls.__module__}.{cls.__name__} batch, "
            f"got {type(batch).__module__}.{type(batch).__name__}"
        )


def _causal_lm(state: TrainState, batch: PackedBatch, kwargs: dict, passes: Passes):
    cfg = configure(SFTConfig, **kwargs)
    loss_fn = make_sft_loss(remat=cfg.remat, moe=cfg.moe, block=passes.rows_block())
    ctx = _context(token_normalizers(batch))
    return Grads(state.policy), lambda params: loss_fn(params.policy, batch, ctx)


def _dpo(name: str):
    def build(state: TrainState, batch: PairBatch, kwargs: dict, passes: Passes):
        loss_type = kwargs.pop("loss_type", "sigmoid" if name == "dpo" else name)
        if name != "dpo" and loss_type != name:
            raise ValueError(
                f"objective {name!r} is DPOConfig(loss_type={name!r}); got loss_type={loss_type!r}"
            )
        cfg = configure(DPOConfig, loss_type=loss_type, **kwargs)
        if cfg.uses_reference and batch.ref_logps is None:
            raise ValueError(
                f"objective {name!r} (loss_type {cfg.loss_type!r}) reads the reference's sequence "
                "log-probs: the PairBatch needs ref_logps [P, 2]"
            )
        rows = pair_rows(cfg, with_loss_mask(batch))
        loss_fn, ctx = make_dpo_loss(cfg, passes), _context(dpo_normalizers(rows))
        return Grads(state.policy), lambda params: loss_fn(params.policy, rows, ctx)

    return build


def _kto(state: TrainState, batch: UnpairedBatch, kwargs: dict, passes: Passes):
    cfg = configure(KTOConfig, **kwargs)
    if batch.ref_logps is None:
        raise ValueError(
            "objective 'kto' reads the reference's sequence log-probs of both completions: the "
            "UnpairedBatch needs ref_logps [P, 2] (its own completion's and its KL completion's)"
        )
    forward = shared_forward(passes, cfg.forward)
    batch = with_loss_mask(batch)
    if (
        batch.kl is None
    ):  # z0 from the KL completions under the policy as it is, as the KTO step does
        batch = make_reference_point(passes, forward)(state, batch)[1]
    rows = own_rows(batch)
    loss_fn, ctx = make_kto_loss(cfg, passes, forward), _context(kto_normalizers(rows))
    return Grads(state.policy), lambda params: loss_fn(params.policy, rows, ctx)


def _reward_modeling(state: TrainState, batch: PairBatch, kwargs: dict, passes: Passes):
    cfg = configure(RewardModelConfig, **kwargs)
    rows = pair_data(batch, state.policy.config)
    loss_fn, ctx = make_rm_loss(cfg, passes), _context(rm_normalizers(rows))
    return Grads(state.policy), lambda params: loss_fn(params.policy, rows, ctx)


def _policy(name: str):
    def build(state: TrainState, batch: LossRows, kwargs: dict, passes: Passes):
        cfg = configure(
            GRPOConfig, policy_loss=name, **{"max_new_tokens": batch.tokens.shape[-1], **kwargs}
        )
        if cfg.beta > 0 and batch.ref_logprobs is None:
            raise ValueError(
                f"objective {name!r} with beta={cfg.beta} reads the reference's log-probs: "
                "the LossRows need ref_logprobs [P, G, N] (or beta=0)"
            )
        loss_fn, ctx = make_grpo_loss(cfg, passes), _context(token_normalizers(batch))
        return Grads(state.policy), lambda params: loss_fn(params.policy, batch, ctx)

    return build


def _ppo(state: TrainState, batch, kwargs: dict, passes: Passes):
    """``ppo``: PPO's joint loss with the state's value head, or the policy-only clipped loss."""
    if not isinstance(state.critic, ValueHead):
        if isinstance(batch, ValueRows):
            raise ValueError(
                "objective 'ppo' on ValueRows trains a value head: the state's critic must be a "
                "relax.models.heads.critic.ValueHead (init_value_head), got "
                f"{type(state.critic).__name__}; for the policy loss alone pass LossRows"
            )
        _check_batch("ppo", batch, LossRows)
        return _policy("ppo")(state, batch, kwargs, passes)
    _check_batch("ppo", batch, ValueRows)
    cfg = configure(
        PPOConfig, critic="shared", **{"max_new_tokens": batch.tokens.shape[-1], **kwargs}
    )
    rows, extra = value_rows(cfg, state, batch, passes)
    loss_fn, ctx = make_joint_loss(cfg, passes), _context(token_normalizers(rows))

    def loss(params):
        value, metrics = loss_fn((params.policy, params.critic), rows, ctx)
        return value, {**metrics, **extra}

    return Grads(state.policy, state.critic), loss


def value_rows(
    cfg: PPOConfig, state: TrainState, batch: ValueRows, passes: Passes
) -> tuple[CriticRows, dict]:
    """The joint loss's rows from ``ValueRows``: given advantages, returns and values, or GAE on the
    value head's values of ``rewards`` (module docstring), whitened when ``cfg.whiten_advantages``;
    and the metrics of the advantage step (``explained_variance``, ``returns_mean``, ``values_mean``)."""
    loss_mask = batch.mask if batch.loss_mask is None else batch.loss_mask
    m = loss_mask > 0
    given = (batch.advantages, batch.returns, batch.old_values)
    if batch.rewards is None:
        if any(x is None for x in given):
            raise ValueError(
                "ValueRows need rewards [P, G] (GAE inside) or all of advantages, returns and old_values"
            )
        adv, returns, values = given
        extra = {}
    else:
        if cfg.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError(
                f"objective 'ppo' with kl_coef={cfg.kl_coef} puts the KL to the reference in the "
                "token rewards: the ValueRows need ref_logprobs [P, G, N] (or kl_coef=0)"
            )
        r, _ = kl_token_rewards(
            cfg, batch.rewards, loss_mask, batch.old_logprobs, batch.ref_logprobs
        )
        values = jax.lax.stop_gradient(
            completion_head_values(
                state.policy,
                state.critic,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.tokens,
                batch.mask,
                cfg.forward.pass_(differentiated=False),
            )
        )
        adv, returns, ev = gae_terms(cfg, r, values, m)
        extra = {
            "explained_variance": ev,
            "returns_mean": masked_mean(returns, m),
            "values_mean": masked_mean(values, m),
        }
    if cfg.whiten_advantages:
        adv = whiten(adv, m)  # over every valid token, whatever the shape
    rows = CriticRows(
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask,
        tokens=batch.tokens,
        mask=batch.mask,
        loss_mask=loss_mask,
        old_logprobs=batch.old_logprobs,
        advantages=adv,
        old_values=values,
        returns=returns,
    )
    return rows, {k: jax.lax.stop_gradient(v) for k, v in extra.items()}


OBJECTIVES: dict[str, Objective] = {
    "causal_lm": Objective(PackedBatch, _causal_lm),
    **{n: Objective(PairBatch, _dpo(n)) for n in DPO_NAMES},
    "reward_modeling": Objective(PairBatch, _reward_modeling),
    "kto": Objective(UnpairedBatch, _kto),
    "ppo": Objective(ValueRows, _ppo),  # or LossRows without a value head (_ppo checks)
    **{n: Objective(LossRows, _policy(n)) for n in POLICY_LOSSES if n != "ppo"},
}


def objective_loss(
    state: TrainState, batch: Any, loss: str, *, passes: Passes | None = None, **kwargs
):
    """``(params, loss_fn)`` of the named objective: ``loss_fn(params) -> (scalar, metrics)`` with
    ``params`` a ``Grads``-shaped pair (policy, critic) of what it trains."""
    if loss not in OBJECTIVES:
        raise ValueError(f"unknown objective {loss!r}; valid: {', '.join(sorted(OBJECTIVES))}")
    objective = OBJECTIVES[loss]
    if loss != "ppo":
        _check_batch(loss, batch, objective.batch)
    return objective.build(
        state, batch, dict(kwargs), choose_passes() if passes is None else passes
    )


def objective_forward_backward(
    state: TrainState, batch: Any, loss: str, *, passes: Passes | None = None, **kwargs
) -> tuple[Grads, dict[str, Array]]:
    """``(grads, metrics)`` of the objective ``loss`` (module docstring) on ``batch``: the gradient
    with respect to the trainable leaves of what it trains, and its metrics (reduced values) with
    ``loss`` added. An unknown name, a batch of the wrong type or a kwarg its config does not have
    is an error naming it."""
    params, loss_fn = objective_loss(state, batch, loss, passes=passes, **kwargs)
    trained, frozen = split_trainable(params)

    def loss_of(t):
        value, metrics = loss_fn(eqx.combine(t, frozen))
        return value, M.values({k: M.as_metric(v) for k, v in metrics.items()})

    (value, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(trained)
    return grads, {**metrics, "loss": value}


def make_objective_forward_backward(loss: str, *, passes: Passes | None = None, **kwargs):
    """``objective_forward_backward`` of one objective with fixed ``kwargs``, jitted:
    ``fb(state, batch) -> (grads, metrics)``, compiled once per batch shape."""
    return jax.jit(
        lambda state, batch: objective_forward_backward(state, batch, loss, passes=passes, **kwargs)
    )


def objective_optim_step(state: TrainState, grads: Grads) -> TrainState:
    """One step of the state's optimizer on ``grads.policy`` and, when given, of its critic
    optimizer on ``grads.critic``; ``state.step`` counts it."""
    state = primitives.optim_step(state, grads.policy)
    if grads.critic is None:
        return state
    updates, critic_opt_state = state.critic_optimizer.update(
        grads.critic, state.critic_opt_state, split_trainable(state.critic)[0]
    )
    return state.replace(
        critic=apply_updates(state.critic, updates), critic_opt_state=critic_opt_state
    )
