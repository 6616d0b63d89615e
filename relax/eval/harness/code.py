"""HumanEval's verdict in relax's sandbox (``relax.rewards.sandbox``), as lm-eval's ``pass_at_k``
(HF ``evaluate``'s ``code_eval``) decides it: the program ``prompt + completion``, then the item's
``test`` and ``check(entry_point)``, passes when it runs to the end (exit status 0) within the
time limit (``code_eval``'s default: 3 s of wall time per program).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

TIMEOUT_S = 3.0


@functools.lru_cache(maxsize=1)
def _sandbox():
    from relax.rewards.sandbox import Sandbox, SandboxConfig

    return Sandbox(SandboxConfig(wall_s=TIMEOUT_S, cpu_s=int(TIMEOUT_S) + 1))


def run_programs(programs: Sequence[str], doc: dict | None = None) -> list[float]:
    """1.0 for each program that exits 0 in the sandbox, else 0.0 (``doc``: the item, unused:
    the tests are already in the programs)."""
    box = _sandbox()
    return [float(box.run({"main.py": p}, ["{python}", "-I", "src/main.py"]).ok) for p in programs]
