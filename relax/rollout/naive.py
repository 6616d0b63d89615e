"""Reference sampler without a KV cache: every step re-runs the full forward.

Quadratic in the sequence length, kept as the benchmark's "no cache" mode and as an
independent oracle for the cached sampler's tests. It uses the same sampling function and the
same per-completion keys, so for a fixed key it draws the same tokens (up to float rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from relax.models.decoder.transformer import Transformer
from relax.rollout.sampler import Rollout, RolloutConfig, pad_to_bucket, validate
from relax.rollout.sampling import sample_tokens, uniforms


def _generate_no_cache(
    model: Transformer, prompt_ids, prompt_mask, key, cfg: RolloutConfig
) -> Rollout:
    p, lp = prompt_ids.shape
    g, n = cfg.num_generations, cfg.max_new_tokens
    b = p * g
    keys = jax.random.split(key, b)
    eos = jnp.asarray(cfg.eos_ids if cfg.eos_ids else (-1,), jnp.int32)
    buf = jnp.concatenate(
        [jnp.repeat(prompt_ids, g, axis=0), jnp.full((b, n), cfg.pad_id, jnp.int32)], 1
    )
    bmask = jnp.concatenate([jnp.repeat(prompt_mask, g, axis=0), jnp.zeros((b, n), jnp.int32)], 1)
    logps = jnp.zeros((b, n), jnp.float32)
    finished = jnp.zeros((b,), bool)

    def body(t, s):
        buf, bmask, logps, finished = s
        logits = jax.lax.dynamic_index_in_dim(model(buf, bmask), lp + t - 1, axis=1, keepdims=False)
        tok, lpt = sample_tokens(logits, uniforms(keys, t), cfg.sampling)
        alive = ~finished
        buf = buf.at[:, lp + t].set(jnp.where(alive, tok, cfg.pad_id))
        bmask = bmask.at[:, lp + t].set(alive.astype(jnp.int32))
        logps = logps.at[:, t].set(jnp.where(alive, lpt, 0.0))
        return buf, bmask, logps, finished | (alive & jnp.isin(tok, eos))

    buf, bmask, logps, finished = jax.lax.fori_loop(0, n, body, (buf, bmask, logps, finished))
    shape = (p, g, n)
    mask = bmask[:, lp:]
    return Rollout(
        tokens=buf[:, lp:].reshape(shape),
        mask=mask.reshape(shape),
        logprobs=logps.reshape(shape),
        lengths=mask.sum(1).reshape(p, g),
        finished=finished.reshape(p, g),
    )


@functools.lru_cache(maxsize=16)
def _compiled(cfg: RolloutConfig):
    return jax.jit(functools.partial(_generate_no_cache, cfg=cfg))


def generate_no_cache(
    model: Transformer, prompt_ids, prompt_mask, key, cfg: RolloutConfig
) -> Rollout:
    validate(model, prompt_ids, prompt_mask, cfg)
    ids, mask = pad_to_bucket(prompt_ids, prompt_mask, cfg.prompt_buckets, cfg.pad_id)
    return _compiled(cfg)(model, ids, mask, key)
