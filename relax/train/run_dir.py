"""The run directory across restarts: a fresh run never mixes with an earlier one, a resumed run
continues exactly where its checkpoint left it.

- A fresh run (no ``--resume``) in a directory that holds an earlier run's outputs moves them to
  ``<run_dir>/previous/<time>/`` (nothing is deleted); caches of the built-in task (``task/``,
  ``base_model/``) stay.
- ``--resume`` restores the newest checkpoint, verified against its integrity record
  (``relax.train.checkpoint``). A damaged one stops the run with its step and path, unless
  ``--resume-fallback`` is given: then the newest intact one is restored and each damaged newer
  one is moved to ``<run_dir>/damaged_checkpoints/`` (reported, never deleted).
- ``summary.json`` is written as soon as the "before" evaluation exists, so a resumed run keeps
  the first run's "before" and evaluates nothing extra; the logs are cut back to the restored
  step by ``relax.train.logs.MetricsLogger(resume_step=...)``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.parallel import distributed
from relax.train.checkpoint import CheckpointCorruptError, Checkpointer
from relax.train.logs import CONFIG_FILE, STARTUP_FILE, SUMMARY_FILE, is_main_process

OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "text.jsonl",
    "tb",
    SUMMARY_FILE,
    "final_hf",
    "hf",
    STARTUP_FILE,
    CONFIG_FILE,
)
CHECKPOINTS = "checkpoints"
DAMAGED = "damaged_checkpoints"


def set_aside_earlier_run(run_dir: Path, log: Callable[[str], None]) -> Path | None:
    """Move an earlier run's outputs (``OUTPUTS``) to ``run_dir/previous/<time>``; its path, or None.

    Every process calls it; the main process moves, the others wait for it."""
    present = [name for name in OUTPUTS if (run_dir / name).exists()]
    dest = None
    if present and is_main_process():
        dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
        while dest.exists():
            dest = dest.with_name(dest.name + "+")
        dest.mkdir(parents=True)
        for name in present:
            shutil.move(str(run_dir / name), str(dest / name))
        log(
            f"{run_dir} held an earlier run ({', '.join(present)}): moved to {dest} "
            "(pass --resume to continue a run instead)"
        )
    distributed.barrier("relax-set-aside-earlier-run")
    return dest


def restore_latest(
    ckpt: Checkpointer, state: Any, run_dir: Path, *, fallback: bool, log: Callable[[str], None]
) -> tuple[Any, Any, int] | None:
    """``(state, data_state, step)`` of the newest checkpoint, or None when there is none.

    A damaged newest checkpoint raises (``CheckpointCorruptError``, naming step and path) unless
    ``fallback``: then the newest intact one is restored and the damaged ones are moved aside."""
    if ckpt.latest_step() is None:
        return None
    if not fallback:
        try:
            restored, data_state, _ = ckpt.restore(target=state)
        except CheckpointCorruptError as e:
            raise CheckpointCorruptError(
                f"{e}\n(--resume-fallback restores the newest intact checkpoint "
                "instead and moves the damaged ones aside)",
                directory=e.directory,
                step=e.step,
                item=e.item,
            ) from e
        return restored, data_state, int(ckpt.latest_step())
    restored, data_state, _, step, damaged = ckpt.restore_latest_intact(target=state)
    for bad, error in damaged:
        moved = ckpt.quarantine(bad, run_dir / DAMAGED)
        log(
            f"{error}\n  -> moved to {moved}; resuming from step {step}, the newest intact checkpoint"
        )
    return restored, data_state, step


def load_summary(run_dir: Path) -> dict:
    """``summary.json`` of the run so far ({} when there is none)."""
    path = run_dir / SUMMARY_FILE
    return json.loads(path.read_text()) if path.exists() else {}
