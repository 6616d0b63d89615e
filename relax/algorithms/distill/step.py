"""The distillation step: ``distill_step = compose([sample], teacher, update)``.

- ``sample`` (jit, on-policy and mixed modes only): ``num_generations`` completions per prompt from
  the student (``state.policy``) with the prefix-shared sampler, key
  ``fold_in(state.key, ROLLOUT_STREAM)`` (GRPO's rollout key); in mixed mode only on a step whose
  coin (``fold_in(state.key, MIX_STREAM)``, probability ``lmbda``) says so, else the batch's own
  completions. Sets ``tokens``, ``mask``, ``loss_mask`` ``[P, G, N]``, ``lengths``, ``finished``
  ``[P, G]`` and ``on_policy`` (a bool scalar).
- ``teacher`` (jit, reads the reference): the teacher's (``state.ref``) final-norm hidden states
  predicting every completion token, ``teacher_hidden`` ``[P, G, N, D_teacher]``, forward only, one
  prompt group per pass where the passes say so; ``loss_mask`` defaults to ``mask``.
- ``update`` (jit): one optimizer step of the distillation loss through the generic update, then
  ``step + 1`` and a new key; its output is ``relax.train.update.Updated`` (the batch, ``metrics``,
  ``health``).

The last two fuse into one program (the first too: the whole step is one ``jax.jit``). The batch
is a ``relax.algorithms.distill.data.DistillBatch``: ``prompt_ids``/``prompt_mask`` ``[P, Lp]``
(left-padded) and, off-policy, ``tokens``/``mask`` ``[P, G, N]`` (the completions, right after
their prompt) with an optional ``loss_mask``. Host values (prompt texts, dataset fields) are no
part of it: the caller keeps them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from relax.algorithms.distill.config import DistillConfig
from relax.algorithms.distill.data import DistillBatch
from relax.algorithms.distill.loss import make_distill_update
from relax.algorithms.online.stages import ROLLOUT_STREAM
from relax.compose import Stage, compose, stage
from relax.models.decoder.transformer import Transformer
from relax.models.forward.config import ForwardConfig
from relax.models.forward.prefix_shared import completion_hidden, completion_rope, over_groups
from relax.models.heads.distill import check_same_vocabulary
from relax.models.hf.checkpoint import load_pretrained
from relax.passes import Passes, choose_passes
from relax.rollout.sampler import RolloutConfig, compiled_generate
from relax.train.health import first_nonfinite, step_health
from relax.train.state import TrainState, init_state
from relax.train.update import Updated, forward_groups

MIX_STREAM = 0x4D1C  # mixed mode's per-step coin: fold_in(state.key, MIX_STREAM)


def rollout_config(cfg: DistillConfig, *, eos_ids: tuple[int, ...], pad_id: int) -> RolloutConfig:
    """The student's sampler: ``cfg.generation`` (by default the full distribution at its
    temperature: TRL's GKD samples with ``top_k=0``)."""
    return cfg.generation.rollout(eos_ids=tuple(eos_ids), pad_id=pad_id)


def make_sample(cfg: DistillConfig, rcfg: RolloutConfig) -> Stage:
    """Completions sampled from the student (on-policy), or in mixed mode with probability ``lmbda``."""
    if not cfg.samples:
        raise ValueError(f"mode={cfg.mode!r} samples nothing")
    generate = compiled_generate(rcfg)

    def sample(state: TrainState, batch: DistillBatch):
        def on_policy():  # (tokens, mask, loss_mask, lengths, finished)
            r = generate(
                state.policy,
                batch.prompt_ids,
                batch.prompt_mask,
                jax.random.fold_in(state.key, ROLLOUT_STREAM),
            )
            return r.tokens, r.mask, r.mask, r.lengths, r.finished

        def with_completions(completions, on_policy):
            tokens, mask, loss_mask, lengths, finished = completions
            return dataclasses.replace(
                batch,
                tokens=tokens,
                mask=mask,
                loss_mask=loss_mask,
                lengths=lengths,
                finished=finished,
                on_policy=on_policy,
            )

        if cfg.mode == "on_policy":
            return state, with_completions(on_policy(), jnp.bool_(True))

        p = batch.prompt_ids.shape[0]
        want = (p, cfg.generation.num_generations, cfg.generation.max_new_tokens)
        if batch.tokens is None or batch.tokens.shape != want:
            got = "none" if batch.tokens is None else batch.tokens.shape
            raise ValueError(
                f"mixed mode swaps the batch's completions for sampled ones, so they must be "
                f"[P, num_generations, max_new_tokens] = {want}; got {got}"
            )

        def off_policy():
            mask = batch.mask.astype(jnp.int32)
            loss_mask = mask if batch.loss_mask is None else batch.loss_mask.astype(jnp.int32)
            return (
                batch.tokens.astype(jnp.int32),
                mask,
                loss_mask,
                jnp.sum(mask, axis=-1),
                jnp.ones(want[:2], bool),
            )

        coin = jax.random.bernoulli(jax.random.fold_in(state.key, MIX_STREAM), cfg.lmbda)
        return state, with_completions(jax.lax.cond(coin, on_policy, off_policy), coin)

    return stage(sample, name="sample", updates_state=False, placement="sampler")


def teacher_hidden(
    teacher: Transformer, batch: DistillBatch, passes: Passes, forward: ForwardConfig
):
    """The teacher's hidden states ``[P, G, N, D]`` predicting the batch's completion tokens, no
    gradient, ``forward_groups(passes, batch)`` prompt groups per pass (``over_groups``)."""
    ids, pm, tokens, mask = batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask
    _, g, n = tokens.shape
    rope = completion_rope(teacher.config, pm, g, n)  # outside the loop over groups
    how = forward.pass_(differentiated=False)
    run = lambda *xs: completion_hidden(teacher, *xs[:4], how, rope=xs[4])  # noqa: E731
    h = over_groups(
        run, (ids, pm, tokens, mask, rope), groups_per_pass=forward_groups(passes, batch)
    )
    return jax.lax.stop_gradient(h)


def make_teacher(cfg: DistillConfig, passes: Passes) -> Stage:
    """``teacher_hidden`` of the batch's completions from ``state.ref`` (and ``loss_mask``)."""

    def teacher(state: TrainState, batch: DistillBatch):
        if state.ref is None:
            raise ValueError(
                "distillation reads the teacher from TrainState.ref, which is None "
                "(init_state(student, ..., with_reference=True) then state.replace(ref=teacher))"
            )
        check_same_vocabulary(state.policy, state.ref)
        hidden = teacher_hidden(state.ref, batch, passes, cfg.forward)
        loss_mask = batch.mask if batch.loss_mask is None else batch.loss_mask
        return state, dataclasses.replace(batch, teacher_hidden=hidden, loss_mask=loss_mask)

    return stage(teacher, name="teacher", updates_state=False, reads_reference=True)


def make_update_stage(cfg: DistillConfig, passes: Passes) -> Stage:
    """One optimizer step of the distillation loss (``relax.train.update``): ``Updated(batch, metrics,
    health)``."""

    def update(state: TrainState, batch: DistillBatch):
        update_fn = make_distill_update(cfg, state.optimizer, state.ref, passes)
        key, sub = jax.random.split(state.key)
        policy, opt_state, metrics = update_fn(state.policy, state.opt_state, batch, sub)
        # the loss is the only quantity of relax.train.health's list that distillation has
        metrics, health = step_health(metrics, opt_state, first_nonfinite(metrics["loss"]))
        lengths = jnp.sum(batch.mask > 0, axis=-1).astype(jnp.float32)
        metrics = {**metrics, "completion_length": jnp.mean(lengths)}
        if cfg.samples:
            metrics["on_policy"] = batch.on_policy.astype(jnp.float32)
        new = state.replace(policy=policy, opt_state=opt_state, step=state.step + 1, key=key)
        return new, Updated(batch=batch, metrics=metrics, health=health)

    return stage(update, name="update", reads_reference=True)


def make_distill_step(
    cfg: DistillConfig, passes: Passes | None = None, *, eos_ids: tuple[int, ...], pad_id: int
) -> Stage:
    """``distill_step(state, batch) -> (state, Updated)``: the student is ``state.policy``, the teacher
    ``state.ref`` (a ``Transformer`` of any size with the student's vocabulary), the optimizer the
    state's (``cfg.optimizer.make()``). ``eos_ids`` / ``pad_id``: the sampler's (on-policy and mixed
    modes). ``passes``: the backend's pass layout (default ``choose_passes()``).

    Args:
        cfg: the distillation config (``DistillConfig``): the divergence, ``mode``
            (``"off_policy"``, ``"on_policy"`` or ``"mixed"``, with ``lmbda``), the sampler
            (``generation``), ``grad_accum``, ``chunk_size`` and the forward options.
        passes: the backend's pass layout (``relax.passes.Passes``). None: ``choose_passes()``.
        eos_ids: the tokens that end a sampled completion (on-policy and mixed modes).
        pad_id: the token that fills the sampled completions after their end.

    Returns:
        A ``Stage`` named ``"distill_step"``, one jitted program: ``batch`` is a ``DistillBatch``
            (module docstring); ``state`` is ``init_distill_state``'s, returned after one optimizer
            step with ``step + 1`` and a new key. The ``Updated`` holds the batch with
            ``teacher_hidden`` ``[p g n d]`` and ``loss_mask`` set (and the sampled completions when
            it sampled), ``metrics`` (the loss's, ``grad_norm``, ``skipped_updates``,
            ``completion_length``; ``on_policy`` when ``cfg`` samples) and ``health``.
    """
    passes = choose_passes() if passes is None else passes
    sample = (
        [make_sample(cfg, rollout_config(cfg, eos_ids=eos_ids, pad_id=pad_id))]
        if cfg.samples
        else []
    )
    return compose(
        *sample, make_teacher(cfg, passes), make_update_stage(cfg, passes), name="distill_step"
    )


def load_teacher(path, student: Transformer, *, dtype=None, param_dtype=None) -> Transformer:
    """The teacher from a Hugging Face directory (``relax.models.hf.checkpoint.load_pretrained``), in the
    student's compute dtype unless ``dtype`` says otherwise; its vocabulary checked against the
    student's (``ValueError`` naming both sizes)."""
    teacher = load_pretrained(
        path, dtype=student.dtype if dtype is None else dtype, param_dtype=param_dtype
    )
    check_same_vocabulary(student, teacher)
    return teacher


def init_distill_state(student: Transformer, teacher: Transformer, optimizer, *, key) -> TrainState:
    """A fresh state: the student is the policy (what samples, trains and is exported), the teacher
    the reference (checked for the same vocabulary; never updated).

    Args:
        student: the model to train (``state.policy``).
        teacher: the model to distil (``state.ref``): a ``Transformer`` of any size with the
            student's vocabulary.
        optimizer: the student's optax optimizer (e.g. ``DistillConfig.optimizer.make()``).
        key: the PRNG key the steps split.

    Returns:
        A fresh ``TrainState``: ``policy`` the student with its optimizer state, ``ref`` the
            teacher, ``step`` 0 and ``key``.
    """
    check_same_vocabulary(student, teacher)
    return init_state(student, optimizer, key=key).replace(ref=teacher)
