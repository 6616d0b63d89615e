"""Is the run still learning? Non-finite values that stop it, and collapse warnings.

``optax.apply_if_finite`` skips an optimizer step whose gradients are not finite, so one bad
batch costs nothing. A run that can no longer learn skips every step; relax stops it instead of
finishing and exporting an unchanged model:

- On device, the update reports the first non-finite quantity of each iteration, in the order
  the data flows: ``QUANTITIES`` (``first_nonfinite``: its index, -1 if none; rewards count when
  infinite, since NaN marks a missing reward, and log-probs only where the completion mask is
  on) and the first gradient leaf that is not finite (``first_nonfinite_grad``, in
  ``jax.tree.leaves`` order of the policy).
- On the host, ``HealthMonitor.check`` raises ``NonFiniteError`` once ``max_consecutive_skips``
  optimizer steps in a row were skipped, naming the step where the streak began and its first
  non-finite quantity (or gradient leaf, by its path in the policy).

It also warns (once per streak) when the policy has collapsed: the mean entropy within
``collapse_tolerance`` of ``ln V`` (uniform over the vocabulary), or a gradient norm of exactly 0,
for ``collapse_patience`` iterations in a row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from relax.train.optimizer import skip_counts

QUANTITIES = ("rewards", "advantages", "old_logprobs", "ref_logprobs", "loss")


class NonFiniteError(RuntimeError):
    """The run stopped: too many optimizer steps in a row were skipped for non-finite values."""


def check_finite_weights(tree, what: str) -> None:
    """Raise ``NonFiniteError`` naming the first leaf of ``tree`` (a model) that holds a NaN or an
    infinity (``first_nonfinite_leaf``): weights restored that way would train NaN."""
    first = int(jax.jit(first_nonfinite_leaf)(tree))
    if first >= 0:
        raise NonFiniteError(
            f"{what}: weight {leaf_names(tree)[first]!r} holds NaN or infinite values"
        )


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    """``max_consecutive_skips``: stop after this many optimizer steps in a row were skipped for
    non-finite gradients. ``collapse_patience``: warn after this many iterations in a row with the
    entropy within ``collapse_tolerance`` (relative) of ``ln V``, or a gradient norm of exactly 0."""

    max_consecutive_skips: int = 10
    collapse_patience: int = 3
    collapse_tolerance: float = 1e-3

    def __post_init__(self):
        if self.max_consecutive_skips < 1 or self.collapse_patience < 1:
            raise ValueError("max_consecutive_skips and collapse_patience must be >= 1")
        if not 0 <= self.collapse_tolerance < 1:
            raise ValueError(f"collapse_tolerance must be in [0, 1), got {self.collapse_tolerance}")


def _first(bad: list[Array]) -> Int[Array, ""]:
    """Index of the first True of ``bad`` (bool scalars); -1 if none."""
    bad = jnp.stack(bad)
    return jnp.where(jnp.any(bad), jnp.argmax(bad), -1)


def first_nonfinite_leaf(tree) -> Int[Array, ""]:
    """Index of the first leaf (``jax.tree.leaves`` order) holding a non-finite value; -1 if none."""
    return _first([~jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])


def first_nonfinite(
    loss: Array,
    *,
    rewards: Array | None = None,
    advantages: Array | None = None,
    old_logprobs: Array | None = None,
    ref_logprobs: Array | None = None,
    mask: Array | None = None,
) -> Int[Array, ""]:
    """Index in ``QUANTITIES`` of the first non-finite one of ``loss`` and the batch's quantities
    given; -1 if none.

    A quantity not given counts as finite (``ref_logprobs`` without a KL term; everything but the
    loss for a trainer without rollouts, e.g. SFT); rewards count only infinities (NaN is a missing
    score); log-probs count only where ``mask`` is on."""
    checks = {"loss": jnp.isfinite(loss)}
    if rewards is not None:
        checks["rewards"] = ~jnp.any(jnp.isinf(rewards))
    if advantages is not None:
        checks["advantages"] = jnp.all(jnp.isfinite(advantages))
    for q, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if x is not None:
            checks[q] = jnp.all(jnp.isfinite(x) | ~(mask > 0))
    return _first([~checks.get(q, jnp.bool_(True)) for q in QUANTITIES])


def step_health(
    metrics: Mapping[str, Array], opt_state, first_nonfinite_index: Array
) -> tuple[dict, dict]:
    """An update's ``(metrics, health)``: the metrics without ``first_nonfinite_grad`` and with
    ``skipped_updates`` (all skipped optimizer steps so far), and the record ``HealthMonitor``
    checks: ``first_nonfinite_grad``, ``first_nonfinite`` (``first_nonfinite_index``, e.g.
    ``first_nonfinite(batch, loss)``) and ``consecutive_skips``."""
    total, streak = skip_counts(opt_state)
    metrics = dict(metrics)
    health = {
        "first_nonfinite_grad": metrics.pop("first_nonfinite_grad"),
        "first_nonfinite": jnp.asarray(first_nonfinite_index, jnp.int32),
        "consecutive_skips": streak,
    }
    return {**metrics, "skipped_updates": total}, health


def leaf_names(tree) -> list[str]:
    """The key paths of ``tree``'s leaves (``jax.tree.leaves`` order), e.g. ``layers.wq``."""
    return [
        jax.tree_util.keystr(p, simple=True, separator=".")
        for p, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]


class HealthMonitor:
    """Host-side watch over the iterations' metrics; ``check`` after every iteration.

    ``grad_leaves``: the policy's leaf names (``leaf_names``); ``vocab_size``: for ``ln V``;
    ``warn``: where collapse warnings go (``print`` on the main process, say).
    """

    def __init__(
        self,
        cfg: HealthConfig,
        *,
        grad_leaves: Sequence[str],
        vocab_size: int,
        warn: Callable[[str], None],
    ):
        self.cfg, self.grad_leaves, self.warn = cfg, list(grad_leaves), warn
        self.max_entropy = math.log(vocab_size)
        self._cause: str | None = None  # what made the first step of the current skip streak skip
        self._streak_start: int | None = None
        self._collapse = {"entropy": 0, "grad_norm": 0}

    def cause(self, health: Mapping[str, int]) -> str:
        """The first non-finite quantity of one iteration, in words."""
        q, leaf = int(health["first_nonfinite"]), int(health["first_nonfinite_grad"])
        if q >= 0 and QUANTITIES[q] != "loss":
            return f"non-finite {QUANTITIES[q]}"
        grad = f"gradient of {self.grad_leaves[leaf]}" if leaf >= 0 else "gradients"
        return (
            f"non-finite loss and {grad}" if q >= 0 else f"non-finite {grad} (the loss is finite)"
        )

    def check(self, step: int, metrics: Mapping[str, float], health: Mapping[str, int]) -> None:
        """After iteration ``step``: raise ``NonFiniteError`` past the skip limit; warn on collapse."""
        skips = int(health["consecutive_skips"])
        if skips == 0:
            self._cause = self._streak_start = None
        elif self._cause is None:
            self._cause, self._streak_start = self.cause(health), step
        if skips >= self.cfg.max_consecutive_skips:
            raise NonFiniteError(
                f"{skips} optimizer steps in a row were skipped for non-finite values (limit "
                f"--health.max-consecutive-skips={self.cfg.max_consecutive_skips}); the streak began at "
                f"iteration {self._streak_start} with {self._cause}. The policy holds the last finite "
                "weights; the checkpoints before it are intact (lower the learning rate, check the rewards "
                "and the data, then --resume)."
            )
        self._watch(
            "entropy",
            metrics.get("entropy", 0.0) >= (1 - self.cfg.collapse_tolerance) * self.max_entropy,
            f"the policy's entropy {metrics.get('entropy', 0.0):.4f} is at ln V = {self.max_entropy:.4f} "
            "(uniform over the vocabulary): the model has collapsed (learning rate too high?)",
        )
        self._watch(
            "grad_norm",
            skips == 0 and metrics.get("grad_norm", 1.0) == 0.0,
            "the gradient norm is exactly 0: nothing is learning (every group's rewards equal and no "
            "KL term, or a collapsed model)",
        )

    def _watch(self, name: str, hit: bool, message: str) -> None:
        self._collapse[name] = self._collapse[name] + 1 if hit else 0
        if self._collapse[name] == self.cfg.collapse_patience:
            self.warn(f"warning: for {self.cfg.collapse_patience} iterations {message}")
