"""Reference-model update rules as pure functions ``(ref, policy, step, stats) -> ref``.

``ref`` and ``policy`` are pytrees of arrays with the same structure and shapes (pass
``eqx.filter(model, eqx.is_inexact_array)``; ``None`` leaves are skipped). Each factory closes over
its statics and returns a jittable rule; ``step`` (the number of optimizer steps completed, so the
first call after the first update sees ``step = 1``) and ``stats`` may be traced.

One mixing convention everywhere (TRL's ``ref_model_mixup_alpha``): ``alpha`` is the weight of the
POLICY, ``mix(ref, policy) = alpha * policy + (1 - alpha) * ref``, computed in float32 at least and
cast back to each ref leaf's dtype (a bfloat16 ref loses updates smaller than its precision).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, PyTree

from relax.choices import check_choice

Params = PyTree[Array]
Rule = Callable[[Params, Params, ArrayLike, Mapping[str, ArrayLike]], Params]

KINDS = ("static", "ema", "periodic", "mixup", "prorl")
RESET_MODES = ("hard", "mixup")


def _check_trees(ref: Params, policy: Params) -> None:
    chex.assert_trees_all_equal_structs(ref, policy)
    chex.assert_trees_all_equal_shapes(ref, policy, custom_message="ref_params vs policy_params")


def _mix(ref: Params, policy: Params, alpha: float) -> Params:
    """``alpha * policy + (1 - alpha) * ref`` leafwise, in the ref leaf's dtype."""

    def leaf(r: Array, p: Array) -> Array:
        if not jnp.issubdtype(jnp.result_type(r), jnp.inexact):
            raise TypeError(f"cannot mix non-floating leaf of dtype {jnp.result_type(r)}")
        acc = jnp.promote_types(jnp.result_type(r), jnp.float32)
        out = alpha * jnp.asarray(p).astype(acc) + (1.0 - alpha) * jnp.asarray(r).astype(acc)
        return out.astype(jnp.result_type(r))

    return jax.tree.map(leaf, ref, policy)


def _copy(ref: Params, policy: Params) -> Params:
    return jax.tree.map(lambda r, p: jnp.asarray(p).astype(jnp.result_type(r)), ref, policy)


def _update_if(
    pred: Bool[Array, ""], update: Callable[[Params, Params], Params], ref: Params, policy: Params
) -> Params:
    """``update(ref, policy)`` if ``pred`` else ``ref``; ``lax.cond`` so only one branch runs under jit."""
    return jax.lax.cond(pred, update, lambda r, p: r, ref, policy)


def params_equal(a: Params, b: Params, *, smallest_first: bool = False) -> Bool[Array, ""]:
    """True iff ``a`` and ``b`` are bitwise the same model: equal structure, dtypes and values
    (``all_i a_i == b_i`` over every leaf; a dtype or shape mismatch is statically False).

    ``smallest_first``: compare the smallest leaf first and the rest only if it is equal (a
    ``lax.cond``), so that after any update the answer costs one small leaf, not two models. For
    one device: on an 8-device CPU mesh XLA's collectives deadlocked on that conditional."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if jax.tree.structure(a) != jax.tree.structure(b) or any(
        (x.dtype, x.shape) != (y.dtype, y.shape) for x, y in zip(la, lb)
    ):
        return jnp.bool_(False)
    if not la:
        return jnp.bool_(True)
    every = lambda: jnp.all(jnp.stack([jnp.all(x == y) for x, y in zip(la, lb)]))  # noqa: E731
    if not smallest_first:
        return every()
    first = min(range(len(la)), key=lambda i: la[i].size)
    return jax.lax.cond(jnp.all(la[first] == lb[first]), every, lambda: jnp.bool_(False))


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def _check_every(every: int) -> None:
    if int(every) != every or every < 1:
        raise ValueError(f"every must be an integer >= 1, got {every}")


def static() -> Rule:
    """``ref <- ref``: the reference never moves (TRL's default, ``sync_ref_model=False``)."""

    def rule(ref_params, policy_params, step, stats):
        _check_trees(ref_params, policy_params)
        return ref_params

    return rule


def ema(alpha: float) -> Rule:
    """``ref <- alpha * policy + (1 - alpha) * ref`` at every step (``mixup(1, alpha)``).

    ``alpha`` is the POLICY weight: a "decay" of ``d`` in EMA-of-weights terms is ``alpha = 1 - d``.
    """
    _check_alpha(alpha)

    def rule(ref_params, policy_params, step, stats):
        _check_trees(ref_params, policy_params)
        return _mix(ref_params, policy_params, alpha)

    return rule


def _sync_step(step: ArrayLike, every: int) -> Bool[Array, ""]:
    step = jnp.asarray(step)
    return (step > 0) & (step % every == 0)


def periodic(every: int) -> Rule:
    """Hard copy ``ref <- policy`` when ``step % every == 0 and step > 0``; else unchanged."""
    _check_every(every)

    def rule(ref_params, policy_params, step, stats):
        _check_trees(ref_params, policy_params)
        return _update_if(_sync_step(step, every), _copy, ref_params, policy_params)

    return rule


def mixup(every: int, alpha: float) -> Rule:
    """TRL ``SyncRefModelCallback`` (``ref_model_sync_steps``, ``ref_model_mixup_alpha``)::

        ref <- alpha * policy + (1 - alpha) * ref   if step % every == 0 and step > 0

    ``alpha = 1`` is ``periodic(every)``; ``every = 1`` is ``ema(alpha)``. TRL's defaults are
    ``every = 512``, ``alpha = 0.6`` (not defaulted here: pass them).
    """
    _check_every(every)
    _check_alpha(alpha)

    def rule(ref_params, policy_params, step, stats):
        _check_trees(ref_params, policy_params)
        return _update_if(
            _sync_step(step, every), lambda r, p: _mix(r, p, alpha), ref_params, policy_params
        )

    return rule


def prorl_should_reset(
    stats: Mapping[str, ArrayLike], *, kl_target: float | None, entropy_floor: float | None
) -> Bool[Array, ""]:
    """``stats["kl"] > kl_target  or  stats["entropy"] < entropy_floor`` (a None threshold is off).

    Only the keys of enabled thresholds are read. Exposed so a trainer can reset its optimizer
    state on the same condition, as ProRL does.
    """
    pred = jnp.asarray(False)
    for key, threshold, tripped in (
        ("kl", kl_target, lambda v, t: v > t),
        ("entropy", entropy_floor, lambda v, t: v < t),
    ):
        if threshold is None:
            continue
        if key not in stats:
            raise KeyError(f"reference rule needs stats[{key!r}]; got keys {sorted(stats)}")
        pred = pred | tripped(jnp.asarray(stats[key]), threshold)
    return pred


def prorl_reset(
    kl_target: float | None = None,
    entropy_floor: float | None = None,
    mode: str = "hard",
    alpha: float | None = None,
) -> Rule:
    """ProRL-style reference reset (Liu et al. 2025), triggered by training statistics::

        reset = stats["kl"] > kl_target  or  stats["entropy"] < entropy_floor
        hard:  ref <- policy                               if reset
        mixup: ref <- alpha * policy + (1 - alpha) * ref   if reset

    ProRL resets the reference (and the optimizer) on a schedule chosen by watching KL and
    validation; here the trigger is explicit and jittable (``lax.cond`` on a traced predicate).
    At least one threshold must be set; ``alpha`` is read only (and required) by ``mode="mixup"``.
    """
    check_choice("reset mode", mode, RESET_MODES)
    if kl_target is None and entropy_floor is None:
        raise ValueError("prorl_reset needs kl_target and/or entropy_floor")
    if mode == "mixup":
        if alpha is None:
            raise ValueError("mode='mixup' needs alpha")
        _check_alpha(alpha)
    elif alpha is not None:
        raise ValueError("alpha is only read by mode='mixup'")

    def rule(ref_params, policy_params, step, stats):
        _check_trees(ref_params, policy_params)
        pred = prorl_should_reset(stats, kl_target=kl_target, entropy_floor=entropy_floor)
        update = _copy if mode == "hard" else (lambda r, p: _mix(r, p, alpha))
        return _update_if(pred, update, ref_params, policy_params)

    return rule


class RunningStats(eqx.Module):
    """Exponential moving averages of the policy's KL to the reference and of its entropy, the
    ``stats`` a ProRL reset reads::

        s <- decay * s + (1 - decay) * x      (per iteration, from the update's metrics)
    """

    kl: Array
    entropy: Array

    @staticmethod
    def zeros() -> "RunningStats":
        return RunningStats(jnp.float32(0.0), jnp.float32(0.0))

    def update(self, kl: ArrayLike, entropy: ArrayLike, decay: float = 0.9) -> "RunningStats":
        return RunningStats(
            decay * self.kl + (1 - decay) * kl, decay * self.entropy + (1 - decay) * entropy
        )

    def as_dict(self) -> dict[str, Array]:
        return {"kl": self.kl, "entropy": self.entropy}


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """Which reference rule to build. Fields a kind does not read must stay None.

    ========  ==========================================================
    kind      reads
    ========  ==========================================================
    static    (nothing)
    ema       alpha
    periodic  every
    mixup     every, alpha
    prorl     kl_target and/or entropy_floor, reset_mode ("hard" when
              None), alpha (only with reset_mode="mixup")
    ========  ==========================================================
    """

    kind: str = "static"
    alpha: float | None = None
    every: int | None = None
    kl_target: float | None = None
    entropy_floor: float | None = None
    reset_mode: str | None = None

    def __post_init__(self):
        check_choice("reference kind", self.kind, KINDS)
        reads = {
            "static": set(),
            "ema": {"alpha"},
            "periodic": {"every"},
            "mixup": {"every", "alpha"},
            "prorl": {"kl_target", "entropy_floor", "reset_mode", "alpha"},
        }[self.kind]
        fields = ("alpha", "every", "kl_target", "entropy_floor", "reset_mode")
        unread = [f for f in fields if f not in reads and getattr(self, f) is not None]
        if unread:
            raise ValueError(
                f"kind={self.kind!r} does not read {', '.join(unread)}; leave them None"
            )
        required = {"ema": ("alpha",), "periodic": ("every",), "mixup": ("every", "alpha")}.get(
            self.kind, ()
        )
        missing = [f for f in required if getattr(self, f) is None]
        if missing:
            raise ValueError(f"kind={self.kind!r} needs {', '.join(missing)}")
        make_reference_rule(self)  # validate values (alpha range, every >= 1, prorl thresholds)

    @property
    def needs_stats(self) -> bool:
        """Whether the rule reads running statistics (``RunningStats``): ProRL resets."""
        return self.kind == "prorl"


def make_reference_rule(cfg: ReferenceConfig) -> Rule:
    """Build the rule ``cfg`` describes (see ``ReferenceConfig`` for the fields each kind reads)."""
    if cfg.kind == "static":
        return static()
    if cfg.kind == "ema":
        return ema(cfg.alpha)
    if cfg.kind == "periodic":
        return periodic(cfg.every)
    if cfg.kind == "mixup":
        return mixup(cfg.every, cfg.alpha)
    mode = "hard" if cfg.reset_mode is None else cfg.reset_mode
    return prorl_reset(cfg.kl_target, cfg.entropy_floor, mode=mode, alpha=cfg.alpha)
