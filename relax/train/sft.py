"""Supervised fine-tuning: masked next-token negative log-likelihood.

    loss = - sum_{t} m_t log p(x_{t+1} | x_{<=t}) / sum_t m_t

where ``m`` marks the target tokens (the response and its stop token, never the prompt).
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from relax.masked import masked_mean
from relax.models.logprobs import token_logprobs
from relax.models.transformer import Transformer


def sft_loss(model: Transformer, ids: Int[Array, "b t"], mask: Int[Array, "b t"],
             loss_mask: Int[Array, "b t"]) -> Float[Array, ""]:
    """Token-mean NLL of the tokens where ``loss_mask`` is 1 (a position's own token is scored)."""
    logp = token_logprobs(model, ids, mask)
    return -masked_mean(logp, loss_mask[:, 1:])


def make_sft_step(optimizer: optax.GradientTransformation):
    """Jitted ``step(model, opt_state, ids, mask, loss_mask) -> (model, opt_state, loss)``."""

    @eqx.filter_jit(donate="all-except-first")
    def step(model, opt_state, ids, mask, loss_mask):
        loss, grads = jax.value_and_grad(sft_loss)(model, ids, mask, loss_mask)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, loss

    return step


def pack_examples(prompts: list[list[int]], responses: list[list[int]], *, length: int, pad_id: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded ``[prompt | response]`` rows with attention mask and response-only loss mask."""
    n = len(prompts)
    ids = np.full((n, length), pad_id, np.int32)
    mask = np.zeros((n, length), np.int32)
    loss_mask = np.zeros((n, length), np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > length:
            raise ValueError(f"example {i} has {len(p) + len(r)} tokens, more than the packing length {length}")
        ids[i, :len(p) + len(r)] = p + r
        mask[i, :len(p) + len(r)] = 1
        loss_mask[i, len(p):len(p) + len(r)] = 1
    return ids, mask, loss_mask
