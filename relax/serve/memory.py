"""What a request would need in memory, against what the service's devices have free.

    free, where, split = free_bytes(devices, memory_mb=None)
    floor = fb_bytes(config, sequences=8, length=512, trained=adapter_bytes, itemsize=2)
    check_fits("batch", floor, devices, None, "forward_backward")     # RequestError 413 if not

Free memory is ``relax.train.free_memory.free_bytes``'s (a device's ``bytes_limit - bytes_in_use``,
the host's available memory for CPU devices), with ``--limits.memory-mb`` as a lower limit. On
several devices the least of them counts, against the request's need divided over them.

A request is measured twice before it runs. Before anything is compiled, against a floor of
what it must need, in bytes, from the model's config (``L`` layers, width ``D``, MLP width
``F``, ``K`` key/value heads of size ``d``, vocabulary ``V``, ``b`` bytes per value):

- a session: ``(6 + samplers_kept) * A``, ``A`` the bytes of what it trains (its adapters, a
  value head; rank 0: the whole model): the weights, two Adam moments, the pending gradients,
  the step's new weights and moments before the old ones are freed, and a snapshot each;
- a forward_backward over ``S`` sequences of ``T`` positions (padded):
  ``S T (L (2 D + F) b + 4 V) + 2 A``: each layer's input and MLP activation kept for the
  backward, the float32 logits, the gradients and their sum into the pending ones;
- a sample request of ``P`` prompts of ``Lp`` tokens, ``G`` completions of ``N`` new tokens:
  ``W + 2 L K d b (P Lp + P G N) + 4 P G V``: the merged per-rollout copy of the weights ``W``,
  the KV caches (prompts once, completions each), a decode step's float32 logits.

Then, once its program is compiled (``relax.serve.programs``), against what XLA's buffer
assignment says the program allocates (``memory_analysis``: temporaries and outputs) plus the
host arrays it copies in: the exact figure, attention scores and adapter activations included,
which the floor leaves out. A request is refused (413 naming ``--limits.memory-mb``) when either
is over ``SAFETY`` of the free memory: the rest is left for what neither counts (the host's
copies of results, the allocator's slack).
"""

from __future__ import annotations

import math
from typing import Any

import jax

from relax.serve.wire import RequestError
from relax.train.free_memory import MIB, free_bytes

__all__ = [
    "SAFETY",
    "check_fits",
    "fb_bytes",
    "sample_bytes",
    "session_bytes",
    "tree_bytes",
]

SAFETY = 0.9


def tree_bytes(tree: Any) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) leaf of ``tree``."""
    return sum(
        math.prod(x.shape) * x.dtype.itemsize
        for x in jax.tree.leaves(tree)
        if hasattr(x, "shape") and hasattr(x, "dtype")
    )


def session_bytes(trained: int, samplers_kept: int) -> int:
    """A new session's bytes, ``trained`` the bytes it trains (module docstring)."""
    return (6 + samplers_kept) * trained


def fb_bytes(c, sequences: int, length: int, trained: int, itemsize: int) -> int:
    """The floor of a forward(_backward) over ``sequences`` of ``length`` (module docstring)."""
    per_token = c.num_layers * (2 * c.hidden_size + c.intermediate_size) * itemsize
    return sequences * length * (per_token + 4 * c.vocab_size) + 2 * trained


def sample_bytes(
    c, weights: int, prompts: int, prompt_len: int, samples: int, new: int, itemsize: int
) -> int:
    """The floor of a sample request, ``weights`` the sampling model's bytes (module docstring)."""
    rows = prompts * samples
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize
    return weights + kv * (prompts * prompt_len + rows * new) + 4 * rows * c.vocab_size


def check_fits(field: str, need: int, devices: list, memory_mb: int | None, what: str) -> None:
    """Refuse (413) a request whose ``need`` (``what`` needs it, and by whose count) is over
    ``SAFETY`` of the free memory of ``devices`` (the need split over them)."""
    free, where, split = free_bytes(devices, memory_mb)
    share = -(-need // split)
    if share > SAFETY * free:
        raise RequestError(
            field,
            f"{what} needs {share / MIB:,.0f} MiB per device and {max(free, 0) / MIB:,.0f} MiB "
            f"are free ({where}); at most {SAFETY:.0%} of it is given to one request "
            "(--limits.memory-mb bounds what the service uses): send less at once",
            status=413,
        )
