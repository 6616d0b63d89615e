"""The sampler's public types and host-side helpers (``relax.rollout.sampler`` runs them).

:class:`Rollout` (what the sampler returns), :class:`RolloutConfig` (what its compiled program is
specialised on), the completion cache's block sizes and bytes, the prompt length buckets and the
host-side checks run before anything is compiled.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from relax.choices import check_choice
from relax.models.decoder.transformer import Transformer
from relax.models.forward.routes import Routes
from relax.models.layers.quantized import PRECISIONS, qwix
from relax.rollout.sampling import SamplingConfig

DEFAULT_BUCKETS = tuple(2**i for i in range(4, 17))
DECODE_ATTENTION = ("xla", "pallas", "pallas_interpret")


class Rollout(eqx.Module):
    """G completions of P prompts. ``mask`` is 1 up to and including the stop token."""

    tokens: Int[Array, "p g n"]
    mask: Int[Array, "p g n"]
    logprobs: Float[Array, "p g n"]
    lengths: Int[Array, "p g"]
    finished: Bool[Array, "p g"]
    routes: Routes | None = None  # a mixture of experts' choices (RolloutConfig.record_routes)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """What the compiled sampler is specialised on (a new value compiles a new program)."""

    num_generations: int
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    cache_chunk: int = 64  # completion-cache block: a step reads only the blocks filled so far
    max_segments: int = 16
    """At most this many cache blocks (one compiled decode loop each, the s-th reading s blocks, so
    the program grows with their square): a long budget gets blocks of ``ceil(N / max_segments)``."""
    decode_attention: str = "xla"
    """The decode step's attention: "xla" (XLA's fusions, the default everywhere), "pallas" (one
    Pallas Triton kernel per step and layer, ``relax.models.attention.decode``; GPU only, opt-in
    until measured) or "pallas_interpret" (the same kernel run by Pallas' interpreter: any
    backend, for tests)."""
    merge_adapters: bool = True
    """With LoRA: decode on ``W + s A B`` merged into the per-rollout fused weights (a copy made
    anyway, so no extra memory), not the adapters run beside them: fewer, wider matmuls
    (RESULTS.md compares the two)."""
    compactions: int = 3
    """Times the decode batch may halve as its rows finish (``relax.rollout.compaction``): from
    ``B`` rows to ``B/2`` once at most ``B/2`` still run, then to ``B/4``, ``B/8``; each phase adds
    decode loops to the program (0: never compact; the loops once)."""
    record_routes: bool = False
    """A mixture-of-experts model records each token's experts at every sparse layer in the
    rollout (``Rollout.routes``, for routing replay: ``relax.models.forward.routes``); no effect on a
    dense model."""
    sampler_precision: str = "model"
    """The sampler's weights: "model" (the model's own, in its compute dtype), or "int8" / "fp8"
    (e4m3) weight-only, one scale per output channel (``relax.models.layers.quantized``, qwix: the
    ``quant`` extra): the per-rollout copy of every layer's matrices and the LM head, prefill and
    decode alike, so the rollout's log-probs are the quantized model's. Off-policy by construction:
    a trainer corrects it (``--async.correction``)."""

    def __post_init__(self):
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.compactions < 0:
            raise ValueError(f"compactions must be >= 0, got {self.compactions}")
        if self.cache_chunk < 1 or self.max_segments < 1:
            raise ValueError(
                f"cache_chunk and max_segments must be >= 1, got {self.cache_chunk}, {self.max_segments}"
            )
        check_choice("sampler_precision", self.sampler_precision, PRECISIONS)
        if self.sampler_precision != "model":
            qwix()  # installed, or an error naming the extra before anything compiles
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"decode_attention must be one of {DECODE_ATTENTION}, got {self.decode_attention!r}"
            )
        if not self.prompt_buckets or list(self.prompt_buckets) != sorted(set(self.prompt_buckets)):
            raise ValueError(
                f"prompt_buckets must be increasing and non-empty, got {self.prompt_buckets}"
            )


def block_size(cfg: RolloutConfig) -> int:
    """Completion-cache slots per block: ``cache_chunk``, or more when the budget would otherwise
    need more than ``max_segments`` blocks."""
    return max(cfg.cache_chunk, -(-cfg.max_new_tokens // cfg.max_segments))


def block_sizes(cfg: RolloutConfig) -> list[int]:
    """Slots of each completion-cache block (the last one may be shorter): one decode loop each."""
    n = cfg.max_new_tokens
    chunk = min(block_size(cfg), n)
    return [min(chunk, n - i) for i in range(0, n, chunk)]


def cache_bytes(config, prompts: int, prompt_len: int, cfg: RolloutConfig, dtype) -> int:
    """Bytes of the KV caches ``generate_program`` keeps over the whole batch: per layer, keys and values
    of each prompt once (``[P, Hkv, Lp, D]``) and of each of its G completions
    (``[P*G, Hkv, N, D]``), in the model's compute ``dtype``."""
    slots = prompts * prompt_len + prompts * cfg.num_generations * cfg.max_new_tokens
    return (
        2
        * config.num_layers
        * slots
        * config.num_kv_heads
        * config.head_dim
        * jnp.dtype(dtype).itemsize
    )


def bucket_length(length: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= length:
            return b
    raise ValueError(
        f"prompt length {length} is longer than the largest prompt bucket {buckets[-1]}"
    )


def validate(model: Transformer, prompt_ids, prompt_mask, cfg: RolloutConfig) -> np.ndarray:
    """Host-side checks before anything is compiled; returns the prompt lengths."""
    ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(
            f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must both be [P, Lp]"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_ids must be integers, got {ids.dtype}")
    lengths = mask.astype(bool).sum(axis=1)
    empty = np.nonzero(lengths == 0)[0]
    if empty.size:
        raise ValueError(f"prompt rows {empty.tolist()} are empty (all-zero prompt_mask)")
    c = model.config
    bad = np.nonzero((ids < 0) | (ids >= c.vocab_size))
    if bad[0].size:
        raise ValueError(
            f"prompt_ids[{bad[0][0]}, {bad[1][0]}] = {ids[bad][0]} is outside the vocabulary [0, {c.vocab_size})"
        )
    longest = int(lengths.max())
    if longest > c.max_position_embeddings:
        raise ValueError(
            f"prompt row {int(lengths.argmax())} has {longest} tokens, longer than the "
            f"model's context ({c.max_position_embeddings})"
        )
    bucket_length(ids.shape[1], cfg.prompt_buckets)
    if longest + cfg.max_new_tokens > c.max_position_embeddings:
        raise ValueError(
            f"max_new_tokens={cfg.max_new_tokens} after a {longest}-token prompt overflows the "
            f"model's context of {c.max_position_embeddings} positions"
        )
    for e in cfg.eos_ids:
        if not 0 <= e < c.vocab_size:
            raise ValueError(f"stop id {e} is outside the vocabulary [0, {c.vocab_size})")
    if not 0 <= cfg.pad_id < c.vocab_size:
        raise ValueError(f"pad_id {cfg.pad_id} is outside the vocabulary [0, {c.vocab_size})")
    return lengths


def pad_to_bucket(prompt_ids, prompt_mask, buckets: tuple[int, ...], pad_id: int):
    """Left-pad the prompt buffers to their length bucket so nearby lengths share a compile."""
    lp = prompt_ids.shape[1]
    target = bucket_length(lp, buckets)
    if target == lp:
        return jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, jnp.int32)
    extra = target - lp
    ids = jnp.pad(jnp.asarray(prompt_ids, jnp.int32), ((0, 0), (extra, 0)), constant_values=pad_id)
    mask = jnp.pad(jnp.asarray(prompt_mask, jnp.int32), ((0, 0), (extra, 0)))
    return ids, mask
