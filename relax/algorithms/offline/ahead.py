"""An offline run's step compiled before its first call (``--compile-ahead``, the default), as the
online runs' (``relax.algorithms.online.ahead``): listed in the start-up report with each
program's compile seconds and what it allocates per device, and the run stopped there, before
its first step, when a program cannot fit its devices' free memory.

Every batch of an offline run has one shape (``OfflineAlgorithm.collate`` pads to the config's
budgets), so the step walked once with the first batch's shapes (``relax.train.ahead.walk_step``)
gives every program training calls. The held-out evaluation compiles when first called; rows
with images (their shapes follow each batch's images) compile when first met.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.algorithms.cli.report import StartupReport
from relax.algorithms.online.ahead import compile_ahead, publish, shrink_hint
from relax.train.ahead import call_avals, default_workers, walk_step

# A trainer's ``relax plan`` name and its config's flag group, where they differ from its name
PLAN_NAMES = {"reward_model": "rm"}
FLAG_GROUPS = {"orpo": "dpo", "reward_model": "reward-model"}


def offline_hint(name: str) -> str:
    """``shrink_hint`` for the offline trainer ``name`` (``OfflineAlgorithm.name``)."""
    return shrink_hint(
        FLAG_GROUPS.get(name, name), PLAN_NAMES.get(name, name), "fewer rows (--batch-size)"
    )


def prepare_offline(
    name: str,
    step: Any,
    first_batch: Callable[[], Any],
    report: StartupReport,
    log: Callable[[str], Any],
    *,
    enabled: bool,
    images: bool,
    held_out: bool,
) -> Callable[[Any, Path], None]:
    """The run's ``Trainer.prepare``: ``step`` (its ``segments``) compiled for the state it trains
    from and ``first_batch()`` (the step's input, as the run makes it), reported and checked
    (``publish``). ``enabled``: ``--compile-ahead``; ``images``: rows with images (not compiled
    ahead); ``held_out``: the run evaluates held-out rows (compiled when first called)."""

    def prepare(state, run_dir: Path) -> None:
        ahead = None
        if not enabled:
            lines = (
                "off (--no-compile-ahead): each program compiles when the step first calls it",
            )
        elif images:
            lines = (
                "off with image rows: the step's programs take each batch's images and compile "
                "when first called, once per image shape",
            )
        else:
            t0 = time.perf_counter()
            batch = call_avals(first_batch())
            found = walk_step(step.segments, state, batch, run_host=_run_host)
            ahead = compile_ahead(
                [("a training batch", lo) for lo in found],
                workers=default_workers(),
                not_ahead=("the held-out evaluation compiles when first called",)
                if held_out
                else (),
                t_start=t0,
            )
            lines = ahead.lines()
        publish(lines, ahead, report, run_dir, log, offline_hint(name))

    return prepare


def _run_host(segment, state, batch):
    """A host segment of an offline step on the zeros it is walked with (none of the trainers has
    one yet; a runner's weight copy to a sampler mesh is passed over by the walk itself,
    ``Segment.keeps_batch``)."""
    return segment.run(state, batch)[1]
