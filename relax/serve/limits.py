"""What one request, and every session together, may cost the service (``--limits.*``).

Every limit is checked before anything is allocated or compiled; a request over one is refused
(413 for a size, 429 for a count or quota) naming the limit and the flag that raises it, and
changes nothing."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    """Bounds on requests and sessions (module docstring)."""

    max_sessions: int = 64
    """Training sessions held at once (closing one frees its place)."""
    max_lora_rank: int = 256
    """The largest LoRA rank a session may ask for."""
