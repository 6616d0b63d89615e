"""Recorded expert choices (routing replay): what a sampler's sparse layers chose, for a trainer.

A mixture-of-experts layer's top-k is a discontinuous function of its input: the sampler's and
the trainer's forwards of the same tokens can choose different experts (different batch shapes,
kernels or summation orders move near-tied router logits), and then their log-probs differ by
far more than rounding. Recording the sampler's choices and making the trainer's forwards use
them (``relax.models.moe.experts.route(replay=...)``) removes that source of mismatch: the trainer's
log-probs at the sampler's weights equal the sampler's.

``Routes`` holds them per token and sparse layer, batch-major so that an update permutes and
splits it with the rest of the batch, in the smallest signed integer type that holds the expert
ids (int8 up to 127 experts); -1 marks a token with nothing recorded (the completion's last
token, which the sampler never feeds back, and padding): the trainer routes it itself.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int

__all__ = ["Routes", "route_dtype"]


def route_dtype(num_experts: int):
    """The smallest signed integer dtype holding ``0..num_experts-1`` and -1."""
    return jnp.int8 if num_experts <= 127 else jnp.int16 if num_experts <= 32767 else jnp.int32


class Routes(eqx.Module):
    """Each token's ``k`` experts at every sparse layer (``Ls`` of them), -1 where none was recorded::

    prompt      [P, Lp, Ls, k]     the prompt's tokens (left-padded as the prompt)
    completion  [P, G, N, Ls, k]   the completions' tokens
    """

    prompt: Int[Array, "p lp l k"]
    completion: Int[Array, "p g n l k"]

    def replay_rows(self) -> tuple[Int[Array, "l p lp k"], Int[Array, "l b n k"]]:
        """The layer-major int32 replay of the prompt rows ``[Ls, P, Lp, k]`` and of the padded
        completion rows the layers run over, ``[Ls, P*G, N, k]``."""
        prompt = jnp.moveaxis(self.prompt.astype(jnp.int32), 2, 0)
        c = self.completion.astype(jnp.int32)
        p, g, n, ls, k = c.shape
        return prompt, jnp.moveaxis(c.reshape(p * g, n, ls, k), 2, 0)

    def replay_slots(self, source: Int[Array, "u s"]) -> Int[Array, "u s l k"]:
        """The experts of each slot of packed bins (``relax.models.forward.completion_packing``:
        ``source`` indexes the prompt tokens, then the completion tokens), -1 on empty slots."""
        ls, k = self.prompt.shape[-2:]
        prompt, completion = self.prompt.reshape(-1, ls, k), self.completion.reshape(-1, ls, k)
        n = prompt.shape[0]  # gathered apart: no copy of every route per call (one per micro-batch)
        at_prompt = prompt[jnp.clip(source, 0, n - 1)]
        at_completion = completion[jnp.clip(source - n, 0, completion.shape[0] - 1)]
        out = jnp.where((source < n)[..., None, None], at_prompt, at_completion).astype(jnp.int32)
        return jnp.where((source >= 0)[..., None, None], out, -1)
