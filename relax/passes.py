"""How a training program lays out its passes on this backend: the one place where relax makes
performance choices that depend on the hardware (docs/architecture.md, "Passes").

On one CPU device a prompt group's activations fit in cache, so a program that goes one group
at a time is faster than one pass over the whole batch (a GRPO update on the benchmark batch,
8 groups of 8 x 128 tokens: 3.2 s as one pass, 2.6 s one group at a time); accelerators and
meshes want the whole batch per pass, and a trainer's micro-batches as large as a token budget
per device allows (``MICRO_BATCH_TOKENS``). ``choose_passes`` decides; trainers, losses and the
reference stage receive the resulting ``Passes`` and never look at the backend themselves.

``current_backend()`` is the backend those choices (and the few kernels that differ per backend: the CPU
matmul's weight gradient, the fused GPU attention) are made for: jax's default backend, or the
target of ``target_backend("tpu")`` while a program is traced for another machine than this one
(``relax.plan`` compiles for TPU and GPU targets from a CPU host).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "relax_target_backend", default=None
)


def current_backend() -> str:
    """The backend programs are traced for: ``target_backend``'s while one is set, else jax's default."""
    target = _TARGET.get()
    return jax.default_backend() if target is None else target


@contextlib.contextmanager
def target_backend(name: str) -> Iterator[None]:
    """Trace for backend ``name`` ("cpu", "gpu", "tpu") inside the block, whatever this host runs."""
    if name not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"target backend must be cpu, gpu or tpu, got {name!r}")
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)


@dataclasses.dataclass(frozen=True)
class Passes:
    """``cache_sized``: split work into one-prompt-group passes (forward-only reference log-probs
    one group at a time, one group per micro-batch when a trainer's ``grad_accum`` is left to
    the backend, parameter comparisons that look at the smallest leaves first).
    ``unroll_max_layers``: on cache-sized passes, a differentiated forward of a model with at most
    this many layers unrolls its layer loop (its backward then reads each layer's residuals in
    place; deeper models keep the scan, whose compile time does not grow with depth).
    ``saved_probs_bytes``: on cache-sized passes, the group attention keeps its probabilities for
    the backward when one layer's fit this budget.
    ``batch_shards``: the ways the batch is split over devices (1: one device).
    ``micro_batch_tokens``: elsewhere, the positions a device takes in one micro-batch when a
    trainer's ``grad_accum`` is left to the backend (``micro_batches``); None: the whole
    minibatch in one.
    ``stream_block``: the block of the packed bins' attention (``relax.models.attention.stream``):
    its cost follows the visible blocks, smaller blocks skip more but loop more.
    ``stream_rows``: SFT's packed rows attend through that block-sparse kernel too (CPU: faster
    than the dense masked attention and no ``[T, T]`` array, benchmarks/RESULTS.md) rather than
    the dense masked attention (elsewhere: the stream loop's small products were measured slower
    than fused dense kernels on a GPU for the bins, and are unmeasured for rows);
    ``rows_block()`` is the block the packed rows' forward takes (None: dense).
    ``auto_packs``: ``--grpo.packing.mode auto`` packs completions into bins (CPU only: on a
    GPU the bins, run one per micro-batch with their attention a loop of small matmuls, were
    measured slower than the padded update; benchmarks/RESULTS.md, H200)."""

    cache_sized: bool = False
    unroll_max_layers: int = 8
    saved_probs_bytes: int = 64 * 2**20
    batch_shards: int = 1
    micro_batch_tokens: int | None = None
    stream_block: int = 64
    stream_rows: bool = True
    auto_packs: bool = True

    def rows_block(self) -> int | None:
        """The attention block of packed rows (``relax.models.forward.packed``); None: dense."""
        return self.stream_block if self.stream_rows else None

    def bins_per_micro_batch(self, bin_tokens: int) -> int:
        """The bins of ``bin_tokens`` slots a device takes per micro-batch of a packed update (a
        packed batch's bin count is rounded to a multiple of it): one on cache-sized passes,
        elsewhere as many as ``micro_batch_tokens`` holds, at least one."""
        if self.cache_sized or self.micro_batch_tokens is None:
            return 1
        return max(1, self.micro_batch_tokens // bin_tokens)

    def unroll(self, num_layers: int) -> bool:
        return self.cache_sized and num_layers <= self.unroll_max_layers

    def save_attention(self, probs_bytes: int) -> bool:
        return self.cache_sized and probs_bytes <= self.saved_probs_bytes

    def groups_per_pass(self, rows: int | None = None, row_tokens: int = 0) -> int | None:
        """Prompt groups per forward-only pass (a reference's, a proximal policy's, a teacher's):
        1 on cache-sized passes; elsewhere, of ``rows`` groups of ``row_tokens`` positions each,
        as many as a default micro-batch takes (``micro_batches``); all (None) when that is one
        pass, or ``rows`` is not given."""
        if self.cache_sized:
            return 1
        passes = 1 if rows is None else self.micro_batches(rows, row_tokens)
        return None if passes == 1 else rows // passes

    def micro_batches(self, rows: int, row_tokens: int = 0) -> int:
        """Micro-batches a minibatch of ``rows`` rows (prompt groups, examples, pairs) of
        ``row_tokens`` positions each is split into by default. Cache-sized: one row each.
        Elsewhere the fewest ``a`` dividing ``rows`` whose micro-batches split evenly over the
        batch shards and give each device at most ``micro_batch_tokens`` positions::

            (rows / a) % batch_shards == 0   and   rows / (a * batch_shards) * row_tokens <= budget

        else the smallest such micro-batches (a row per shard); one when there is no budget or
        ``rows`` does not split over the shards."""
        if self.cache_sized:
            return rows
        budget, shards = self.micro_batch_tokens, self.batch_shards
        even = [a for a in range(1, rows + 1) if rows % a == 0 and (rows // a) % shards == 0]
        if budget is None or not even:
            return 1
        within = [a for a in even if rows // (a * shards) * row_tokens <= budget]
        return within[0] if within else even[-1]


MICRO_BATCH_TOKENS = 16_384
"""The default micro-batch on accelerators and meshes, positions per device: what verl's actor
takes per GPU by default with dynamic batch sizes (``ppo_max_token_len_per_gpu``). With remat on
(every trainer's default) a micro-batch keeps one residual per layer and position, and the
vocabulary projection runs in chunks (``relax.models.decoder.logprobs``), so its memory follows
this budget, not the batch."""


def choose_passes(backend: str | None = None, *, batch_shards: int = 1) -> Passes:
    """The passes for ``backend`` (default: ``current_backend()``) with the batch split ``batch_shards`` ways
    (``relax.parallel.batch_shards(mesh)`` on a mesh): cache-sized on one CPU device only, micro-
    batches of ``MICRO_BATCH_TOKENS`` positions per device everywhere else."""
    backend = current_backend() if backend is None else backend
    cache_sized = backend == "cpu" and batch_shards == 1
    return Passes(
        cache_sized=cache_sized,
        batch_shards=batch_shards,
        micro_batch_tokens=None if cache_sized else MICRO_BATCH_TOKENS,
        stream_block=64 if backend == "cpu" else 128,
        stream_rows=backend == "cpu",
        auto_packs=backend == "cpu",
    )
