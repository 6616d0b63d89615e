"""What one request, and every session together, may cost the service (``--limits.*``).

Every limit is checked before anything is allocated or compiled; a request over one is refused
(413 for a size, 429 for a count or quota) naming the limit and the flag that raises it, and
changes nothing. The defaults are for a real model on an accelerator, not the built-in tiny
one: a limit only refuses what no training loop asks for in one request; what fits is decided
by the memory estimate (``relax.serve.memory``) against what the devices have free.
"""

from __future__ import annotations

import dataclasses

from relax.serve.wire import RequestError

__all__ = ["ServiceLimits", "over"]


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    """Bounds on requests and sessions (module docstring)."""

    max_sessions: int = 64
    """Training sessions held at once (closing one frees its place; 429 past it). Each holds its
    adapters, their Adam moments, pending gradients and sampler snapshots on the devices."""
    max_lora_rank: int = 256
    """The largest LoRA rank a session may ask for: published LoRA recipes use 8-256 (rank 256
    adapters on every linear layer of a 7B model are ~1.3 B parameters); more is a full copy."""
    max_samples: int = 256
    """``num_samples`` of one sample request: completions per prompt (GRPO groups are 4-64)."""
    max_prompts: int = 4096
    """Sequences of one request: a sample request's prompts times ``num_samples``, the datums of a
    forward_backward, a typed batch's sequences (its rows times completions per row)."""
    max_tokens: int = 1 << 21
    """Token positions of one request, as padded on the devices (2 M: e.g. 512 sequences of 4 K):
    a forward_backward's rows times their length, a sample request's sequences times prompt
    plus ``max_tokens``."""
    max_programs: int = 64
    """Compiled programs kept (least recently used out first; ``relax.serve.programs``): each
    distinct shape or structure of request compiles one, numeric options are arguments."""
    memory_mb: int | None = None
    """The memory the service may use, MiB: on a device that reports its memory
    (``memory_stats``) the lower of this and its limit, on the host (CPU) the lower of this and
    what the host and the process's cgroup and rlimit leave; None: what those report."""
    max_learning_rate: float = 1.0
    """Adam moves each trained weight by about the learning rate per step: above 1 no run
    trains (1e38 is finite in float32 and sets the adapters to 1e38, whose next forward is inf)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not v > 0:
                raise ValueError(f"--limits.{f.name.replace('_', '-')} must be > 0, got {v}")


def over(field: str, what: str, value: int, limit: str, bound: int, *, status: int = 413):
    """The refusal of ``value`` (``what`` of ``field``) over ``--limits.<limit>`` = ``bound``."""
    flag = "--limits." + limit.replace("_", "-")
    return RequestError(
        field,
        f"{what} {value} is over the service's limit {bound} ({flag}; the server's operator "
        f"may raise it)",
        status=status,
    )
