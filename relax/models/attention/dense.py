"""Training attention of the G completions over their shared prompt as ONE fused causal attention
per completion (``jax.nn.dot_product_attention``: cuDNN's flash attention on GPU).

The same function as ``relax.models.attention.group.prefix_group_attention`` in another layout:
each completion's keys are its prompt's (computed once per prompt, broadcast over the G
completions) followed by its own, ``[K_prompt; K_g]``, and one causal softmax runs over them::

    o_t = softmax( q_t [K_prompt; K_g]^T * scale  masked to  pos_j <= pos_t, j valid ) [V_prompt; V_g]

(``scale = D^-1/2`` unless given).

Prompts are left-padded, which a fused kernel's length masks cannot express (they pad on the
right), so each row ``[pad, prompt, completion]`` is rotated left by its pad count to
``[prompt, completion, pad]``: row index = position, valid length = prompt length + N, and the
padding mask becomes the kernel's sequence lengths. Query rows at prompt positions are zeros
and their outputs are dropped. The prompt keys are attended by prompt-length extra query rows
per completion (a square ``Lp+N`` causal block instead of ``N x (Lp+N)``): more arithmetic than
the group kernel, but one fused kernel instead of a loop of unfused matmuls and softmaxes,
which is what wins on a GPU (``benchmarks/gpu.py`` section 3).

Requires the completion mask to be a prefix of each row (true of every rollout: 1 up to and
including the stop token); keys after a completion's end are only seen by query rows after it,
whose outputs the loss masks. No sliding window (use the group kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from relax.passes import current_backend


def fused_attention_available(dtype) -> bool:
    """Whether ``"cudnn"`` can run here: a GPU backend and a 16-bit dtype."""
    return current_backend() == "gpu" and jnp.dtype(dtype) in (
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    )


def prefix_dense_attention(
    q: Float[Array, "b n hq d"],
    k: Float[Array, "b n hk d"],
    v: Float[Array, "b n hk d"],
    pk: Float[Array, "p hk lp d"],
    pv: Float[Array, "p hk lp d"],
    prompt_len: Int[Array, " p"],
    *,
    implementation: str | None = None,
    scale: float | None = None,
) -> Float[Array, "b n hq d"]:
    """Completion rows ``q`` (token-major, ``B = P*G`` rows, completion g of prompt p at row
    ``p*G + g``) over [their prompt's keys ``pk`` (head-major, left-padded to ``Lp``, the last
    ``prompt_len`` valid); their own causal keys ``k``]. ``implementation``: as
    ``jax.nn.dot_product_attention`` (``"cudnn"``, ``"xla"`` or ``None``); ``scale``: of the
    scores (None: ``D^-1/2``). Returns ``q.dtype``."""
    b, n, hq, d = q.shape
    p, hk, lp, _ = pk.shape
    g = b // p
    t = lp + n
    per_row = lambda x: jnp.repeat(x, g, axis=0)
    token_major = lambda x: per_row(jnp.swapaxes(x, 1, 2))  # [P, Hkv, Lp, D] -> [B, Lp, Hkv, D]
    kf = jnp.concatenate([token_major(pk).astype(k.dtype), k], axis=1)
    vf = jnp.concatenate([token_major(pv).astype(v.dtype), v], axis=1)
    qf = jnp.concatenate([jnp.zeros((b, lp, hq, d), q.dtype), q], axis=1)
    length = per_row(prompt_len.astype(jnp.int32))
    # rotate [pad, prompt, completion] left by the pad count: rotated row i holds original (i + pad) mod T
    src = (jnp.arange(t)[None, :] + (lp - length)[:, None]) % t
    rotate = lambda x: jnp.take_along_axis(x, src[:, :, None, None], axis=1)
    seq = length + n
    out = jax.nn.dot_product_attention(
        rotate(qf),
        rotate(kf),
        rotate(vf),
        is_causal=True,
        query_seq_lengths=seq,
        key_value_seq_lengths=seq,
        implementation=implementation,
        scale=scale,
    )
    # completion token i sits at rotated row prompt_len + i
    rows = length[:, None] + jnp.arange(n)[None, :]
    return jnp.take_along_axis(out, rows[:, :, None, None], axis=1).astype(q.dtype)
