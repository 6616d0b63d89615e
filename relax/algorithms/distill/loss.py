"""The distillation loss on one micro-batch of prompt groups, for ``relax.train.update``::

    loss = sum_{valid tokens} D(p_teacher, q_student)_t / ctx.norms["tokens"]

with ``D`` the configured divergence (``relax.models.heads.distill``), computed from the student's hidden
states (the prefix-shared training forward, ``completion_hidden``) and the teacher's, which the
teacher stage put in the batch (``DistillBatch.teacher_hidden``), each projected by its own head in chunks
of rows. Metrics: ``kl`` (or ``jsd``), ``top1_agreement`` (the two argmaxes agree) and the
student's ``entropy`` at the temperature, token means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from relax.algorithms.distill.config import DistillConfig
from relax.algorithms.distill.data import DistillBatch
from relax.masked import masked_mean
from relax.models.decoder.transformer import Transformer
from relax.models.forward.config import ForwardConfig
from relax.models.forward.forward_pass import attention_probs_bytes
from relax.models.forward.prefix_shared import completion_hidden, completion_rope
from relax.models.heads.distill import divergence_from_hidden
from relax.passes import Passes
from relax.train.update import LossContext, make_update


def student_hidden(student: Transformer, mb: DistillBatch, passes: Passes, forward: ForwardConfig):
    """The student's final-norm hidden states ``[P, G, N, D]`` predicting each completion token
    (``mb.rope`` when precomputed), run as ``forward`` says and laid out as ``passes`` say."""
    c = student.config
    how = forward.pass_().laid_out(passes, c, attention_probs_bytes(c, mb.prompt_ids, mb.tokens))
    return completion_hidden(
        student, mb.prompt_ids, mb.prompt_mask, mb.tokens, mb.mask, how, rope=mb.rope
    )


def make_loss(cfg: DistillConfig, teacher: Transformer, passes: Passes = Passes()):
    """``loss(student, micro_batch, ctx) -> (scalar, metrics)``; ``teacher`` gives its head (its hidden
    states are ``micro_batch.teacher_hidden``) and gets no gradient."""
    name = cfg.metric_name

    def loss_fn(student, mb: DistillBatch, ctx: LossContext):
        h = student_hidden(student, mb, passes, cfg.forward)
        div, agree, ent = divergence_from_hidden(
            student,
            h,
            teacher,
            mb.teacher_hidden,
            divergence=cfg.divergence,
            beta=cfg.jsd_beta,
            temperature=cfg.generation.temperature,
            chunk_size=cfg.chunk_size,
        )
        mask = mb.loss_mask > 0
        loss = jnp.sum(jnp.where(mask, div, 0.0)) / ctx.norms["tokens"]
        metrics = {
            name: jax.lax.stop_gradient(masked_mean(div, mask)),
            "top1_agreement": masked_mean(agree, mask),
            "entropy": masked_mean(ent, mask),
        }
        return loss, metrics

    return loss_fn


def make_distill_update(
    cfg: DistillConfig, optimizer, teacher: Transformer, passes: Passes = Passes()
):
    """``update(student, opt_state, batch, key) -> (student, opt_state, metrics)``: one optimizer step
    of ``make_loss`` over a ``DistillBatch`` (its ``prompt_ids``/``prompt_mask`` ``[P, Lp]``,
    ``tokens``/``mask``/``loss_mask`` ``[P, G, N]``, ``teacher_hidden`` ``[P, G, N, D_teacher]``) in
    ``cfg.grad_accum`` micro-batches (``relax.train.update``)."""
    update = make_update(
        make_loss(cfg, teacher, passes),
        optimizer,
        epochs=1,
        minibatches=1,
        grad_accum=cfg.grad_accum,
        passes=passes,
    )

    def distill_update(student, opt_state, batch: DistillBatch, key):
        _, g, n = batch.tokens.shape
        # the rows the loss reads, and the rotary tables once for all micro-batches, outside their
        # loop (see completion_rope)
        data = DistillBatch(
            prompt_ids=batch.prompt_ids,
            prompt_mask=batch.prompt_mask,
            tokens=batch.tokens,
            mask=batch.mask,
            loss_mask=batch.loss_mask,
            teacher_hidden=batch.teacher_hidden,
            rope=completion_rope(student.config, batch.prompt_mask, g, n),
        )
        return update(student, opt_state, data, key)

    return distill_update
