"""Token-level divergences between a student and a teacher, from their hidden states, without a
``[rows, V]`` float32 array beyond one chunk of rows (knowledge distillation; GKD, Agarwal et al. 2024).

With ``q = softmax(h_s W_s^T / T)`` (student, trained) and ``p = softmax(h_t W_t^T / T)`` (teacher,
no gradient) at temperature ``T``, per row::

    forward:  KL(p || q) = sum_v p (log p - log q)                     (mean-seeking)
    reverse:  KL(q || p) = sum_v q (log q - log p)                     (mode-seeking)
    jsd:      JSD_beta   = beta KL(p || m) + (1 - beta) KL(q || m),    m = beta p + (1 - beta) q

the generalized Jensen-Shannon divergence of GKD (eq. 1) with TRL's conventions
(``GKDTrainer.generalized_jsd_loss``): ``beta`` weights the TEACHER, and ``beta = 0`` / ``beta = 1``
are defined as the forward / reverse KL above (the formula itself tends to ``beta KL(p || q)`` /
``(1 - beta) KL(q || p)`` there, so those end points are special cases, as in TRL). No ``T^2``
factor (GKD's convention; ``relax.objectives.preference.distillation_loss`` multiplies by ``T^2``).

Rows go through ``chunk_size`` at a time (``lax.map``). The divergence is a ``custom_vjp``: the
forward keeps only the two per-row log-sum-exps, and the backward recomputes the chunk's logits
and writes the student's logit gradient in one pass::

    d/dz_s = q - p                                  forward
    d/dz_s = q (g - E_q[g]),  g = log q - log p     reverse
    d/dz_s = q (g - E_q[g]),  g = (1 - beta) log(q / m)   jsd   (d JSD / dq = (1 - beta) log(q / m))

(times ``1 / T`` through ``z = h W^T / T``). The teacher gets no gradient. Bitwise equal
log-softmaxes give a divergence and a logit gradient of exactly 0 (``log(m / q) =
log1p(beta expm1(log p - log q))`` is 0 when ``log p == log q``); a student equal to its teacher
gets 0 up to the rounding by which two forwards of the same weights may differ.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from relax.choices import check_choice
from relax.models.decoder.transformer import Transformer

DIVERGENCES = ("forward", "reverse", "jsd")
DEFAULT_CHUNK = 512


class Divergence(NamedTuple):
    """A divergence as the chunk kernel runs it (static): ``kind`` forward | reverse | jsd (with
    ``0 < beta < 1``), at ``temperature``."""

    kind: str
    beta: float
    temperature: float


def resolve_divergence(
    divergence: str, *, beta: float = 0.5, temperature: float = 1.0
) -> Divergence:
    """Checked; ``jsd`` with ``beta = 0`` is the forward KL and with ``beta = 1`` the reverse KL (TRL)."""
    check_choice("divergence", divergence, DIVERGENCES)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence = "forward" if beta == 0.0 else "reverse"
    return Divergence(divergence, float(beta) if divergence == "jsd" else 0.0, float(temperature))


def check_same_vocabulary(student: Transformer, teacher: Transformer) -> None:
    """Raise ``ValueError`` unless the two models' output heads span the same vocabulary."""
    vs, vt = student.head.shape[0], teacher.head.shape[0]
    if vs != vt or student.config.vocab_size != teacher.config.vocab_size:
        raise ValueError(
            f"the teacher's vocabulary ({vt} rows in its head, vocab_size={teacher.config.vocab_size}) differs "
            f"from the student's ({vs} rows, vocab_size={student.config.vocab_size}): distillation compares "
            "the two next-token distributions entry by entry, so both models need the same tokenizer and "
            "vocabulary size"
        )


def _acc(x):
    """The accumulation dtype: float32, or float64 for float64 inputs."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _logits(w, h, temperature):
    z = jnp.einsum("nd,vd->nv", h, w, preferred_element_type=_acc(w))
    return z if temperature == 1.0 else z / temperature


def _log_softmax(w, h, temperature):
    """``log softmax(h W^T / T)`` (float32, or float64 for float64 inputs) and its per-row log-sum-exp."""
    z = _logits(w, h, temperature)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = m[:, 0] + jnp.log(jnp.sum(jnp.exp(z - m), axis=-1))
    return z - lse[:, None], lse


def _log_mix_over_q(lp, lq, beta):
    """``log(m / q) = log(beta p / q + 1 - beta)``: ``log1p(beta expm1(d))`` near ``d = log p - log q = 0``
    (exactly 0 there), ``logaddexp(log beta + d, log(1 - beta))`` elsewhere (no overflow; ``d = -inf``
    where the teacher has probability 0 gives ``log(1 - beta)``)."""
    d = lp - lq
    near = jnp.abs(d) < 1.0
    small = jnp.log1p(beta * jnp.expm1(jnp.where(near, d, 0.0)))
    large = jnp.logaddexp(jnp.log(beta) + jnp.where(near, 0.0, d), jnp.log1p(-beta))
    return jnp.where(near, small, large)


def _xlogy_terms(a, log_ratio):
    """``sum_v a (log_ratio)`` with ``0 * anything = 0`` (a probability that underflowed or is 0)."""
    return jnp.sum(jnp.where(a > 0, a * log_ratio, 0.0), axis=-1)


def _value(div: Divergence, lq, lp):
    """Per-row divergence from the two log-softmaxes."""
    if div.kind == "forward":
        return _xlogy_terms(jnp.exp(lp), lp - lq)
    if div.kind == "reverse":
        return _xlogy_terms(jnp.exp(lq), lq - lp)
    r = _log_mix_over_q(lp, lq, div.beta)  # log(m / q); log(m / p) = r + log q - log p
    kl_qm = -_xlogy_terms(jnp.exp(lq), r)
    kl_pm = -_xlogy_terms(jnp.exp(lp), r + (lq - lp))
    return div.beta * kl_pm + (1.0 - div.beta) * kl_qm


def _rows_forward(div, w_s, h_s, w_t, h_t):
    lq, lse_s = _log_softmax(w_s, h_s, div.temperature)
    lp, lse_t = _log_softmax(w_t, h_t, div.temperature)
    value = _value(div, lq, lp)
    agree = (jnp.argmax(lq, axis=-1) == jnp.argmax(lp, axis=-1)).astype(value.dtype)
    entropy = -_xlogy_terms(jnp.exp(lq), lq)
    return (value, agree, entropy), (lse_s, lse_t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rows(div, w_s, h_s, w_t, h_t):
    return _rows_forward(div, w_s, h_s, w_t, h_t)[0]


def _rows_fwd(div, w_s, h_s, w_t, h_t):
    out, (lse_s, lse_t) = _rows_forward(div, w_s, h_s, w_t, h_t)
    return out, (w_s, h_s, w_t, h_t, lse_s, lse_t)


def _rows_bwd(div, res, g):
    """Recompute the chunk's log-softmaxes from the saved log-sum-exps; the logit gradient in one
    pass (module docstring). The agreement and entropy outputs are metrics: no gradient."""
    w_s, h_s, w_t, h_t, lse_s, lse_t = res
    g_value = g[0]
    lq = _logits(w_s, h_s, div.temperature) - lse_s[:, None]
    lp = _logits(w_t, h_t, div.temperature) - lse_t[:, None]
    q = jnp.exp(lq)
    if div.kind == "forward":
        dz = q - jnp.exp(lp)
    else:
        gv = (
            (lq - lp)
            if div.kind == "reverse"
            else -(1.0 - div.beta) * _log_mix_over_q(lp, lq, div.beta)
        )
        gv = jnp.where(q > 0, gv, 0.0)
        dz = q * (gv - jnp.sum(q * gv, axis=-1, keepdims=True))
    dz = dz * g_value[:, None]
    if div.temperature != 1.0:
        dz = dz / div.temperature
    dz = dz.astype(
        w_s.dtype
    )  # products in the weights' dtype, float32 accumulation (as the forward)
    dh = jnp.dot(dz, w_s, preferred_element_type=_acc(w_s)).astype(h_s.dtype)
    dw = jnp.einsum(
        "nv,nd->vd", dz, h_s.astype(w_s.dtype), preferred_element_type=_acc(w_s)
    ).astype(w_s.dtype)
    return dw, dh, None, None


_rows.defvjp(_rows_fwd, _rows_bwd)


def divergence_rows(
    w_s: Float[Array, "v ds"],
    h_s: Float[Array, "n ds"],
    w_t: Float[Array, "v dt"],
    h_t: Float[Array, "n dt"],
    div: Divergence,
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Float[Array, " n"], Float[Array, " n"], Float[Array, " n"]]:
    """Per row: the divergence (differentiable in ``w_s``, ``h_s``), the top-1 agreement of the two
    argmaxes and the student's entropy at the temperature (both metrics, no gradient). At most
    ``chunk_size`` rows of logits exist at a time; the teacher is under ``stop_gradient``."""
    if w_s.shape[0] != w_t.shape[0]:
        raise ValueError(
            f"student head has {w_s.shape[0]} vocabulary rows, teacher head {w_t.shape[0]}"
        )
    if h_s.shape[0] != h_t.shape[0]:
        raise ValueError(
            f"student has {h_s.shape[0]} rows of hidden states, teacher {h_t.shape[0]}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    w_t, h_t = jax.lax.stop_gradient(w_t), jax.lax.stop_gradient(h_t)
    n = h_s.shape[0]
    fn = lambda hs, ht: jnp.stack(_rows(div, w_s, hs, w_t, ht), axis=-1)  # noqa: E731
    if n <= chunk_size:
        out = fn(h_s, h_t)
    else:
        c, pad = chunk_size, (-n) % chunk_size
        tiles = lambda h: jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, c, h.shape[-1])  # noqa: E731
        out = jax.lax.map(lambda xs: fn(*xs), (tiles(h_s), tiles(h_t)))
        out = out.reshape(-1, 3)[:n]
    sg = jax.lax.stop_gradient
    return out[:, 0], sg(out[:, 1]), sg(out[:, 2])


def divergence_from_hidden(
    student: Transformer,
    h_s: Float[Array, "*b ds"],
    teacher: Transformer,
    h_t: Float[Array, "*b dt"],
    *,
    divergence: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Float[Array, "*b"], Float[Array, "*b"], Float[Array, "*b"]]:
    """``(divergence, top1_agreement, student_entropy)`` per position, float32, from final-norm hidden
    states (e.g. ``relax.models.forward.prefix_shared.completion_hidden`` of each model) and the models'
    heads; the teacher may have another width and depth but needs the same vocabulary.
    ``divergence``: forward | reverse | jsd (with ``beta``, TRL's convention; module docstring)."""
    check_same_vocabulary(student, teacher)
    lead = h_s.shape[:-1]
    if h_t.shape[:-1] != lead:
        raise ValueError(
            f"student hidden states {h_s.shape} and teacher's {h_t.shape} differ in their leading axes"
        )
    div = resolve_divergence(divergence, beta=beta, temperature=temperature)
    out = divergence_rows(
        student.head.astype(student.dtype),
        h_s.reshape(-1, h_s.shape[-1]),
        teacher.head.astype(teacher.dtype),
        h_t.reshape(-1, h_t.shape[-1]),
        div,
        chunk_size=chunk_size,
    )
    return tuple(x.reshape(lead) for x in out)
