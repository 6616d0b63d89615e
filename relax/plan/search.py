"""The smallest slice of a chip kind that fits a run: ``relax plan grpo --target v5p ...``.

The slices of a kind are tried from the smallest up (``SLICES``; Cloud TPU's slice shapes, GPUs
one host of 1-8), each planned in full (``plan_run``), and the first that fits is the answer. A
slice is skipped without compiling when the train state alone (weights, optimizer state,
reference, critic: ``state_bytes``) exceeds all of its chips' HBM together, and is passed over
when the run cannot be laid out on it (e.g. prompts that do not split over its chips; the
message is kept). The mesh must name every chip it does not fix with ``-1`` (the default
``fsdp=-1`` does), so one run's flags mean something on every slice size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from relax.algorithms.online.config import ModelRunConfig
from relax.models.config.model import ModelConfig
from relax.plan.plan import Plan, plan_run
from relax.plan.programs import abstract_state
from relax.plan.targets import CHIPS, Target
from relax.plan.trainers import ALGORITHMS
from relax.plan.vision import ImagePlan

SLICES: dict[str, tuple[str, ...]] = {
    "v5e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v6e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    "h100": ("1", "2", "4", "8"),
    "h200": ("1", "2", "4", "8"),
}


def slices(kind: str) -> list[Target]:
    """The slices of chip ``kind`` (``v5e``, ``v5p``, ``v6e``, ``h100``, ``h200``), smallest first."""
    if kind not in SLICES:
        raise ValueError(f"unknown chip kind {kind!r}: one of {', '.join(SLICES)}")
    sep = "x" if CHIPS[kind].platform == "gpu" else ":"
    return [Target.parse(f"{kind}{sep}{shape}") for shape in SLICES[kind]]


@dataclasses.dataclass(frozen=True)
class Tried:
    """One slice: the peak per chip where it was planned, or why it was not."""

    target: Target
    fits: bool
    peak_bytes: int | None = None
    reason: str | None = None


def state_bytes(algorithm: str, run: ModelRunConfig, model: ModelConfig) -> int:
    """Bytes of the whole train state over all chips together (nothing compiled)."""
    state = abstract_state(ALGORITHMS[algorithm].algorithm(run), run, model)
    return sum(
        math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "shape")
    )


def smallest(
    algorithm: str,
    run: ModelRunConfig,
    model: ModelConfig,
    kind: str,
    *,
    compile_fn: Callable[[Any], tuple],
    exact: bool = False,
    log: Callable[[str], None] = lambda line: None,
    workers: int = 1,
    images: ImagePlan | None = None,
) -> tuple[Plan | None, list[Tried]]:
    """The plan on the smallest slice of ``kind`` that fits ``run`` (None if none does), and every
    slice tried on the way (``workers``, ``images``: ``plan_run``'s)."""
    mesh = run.parallel.mesh
    if run.parallel.sampler_devices or "-1" not in mesh:
        raise ValueError(
            f"searching slices needs a mesh that grows with them (a -1 axis, e.g. fsdp=-1 or "
            f"fsdp=-1,tensor=8) and no fixed sampler split; got --parallel.mesh {mesh}"
        )
    floor, tried = state_bytes(algorithm, run, model), []
    for target in slices(kind):
        if floor > target.chips * target.chip.hbm_bytes:
            tried.append(
                Tried(
                    target,
                    False,
                    reason=f"the train state alone ({floor / 2**30:.1f} GiB) exceeds "
                    f"the slice's HBM",
                )
            )
        else:
            try:
                p = plan_run(
                    algorithm,
                    run,
                    model,
                    target,
                    compile_fn=compile_fn,
                    exact=exact,
                    workers=workers,
                    images=images,
                )
                tried.append(Tried(target, p.fits, p.peak.total))
            except ValueError as e:  # a layout the run's flags cannot take on this slice
                tried.append(Tried(target, False, reason=str(e).splitlines()[0]))
                p = None
        t = tried[-1]
        log(
            f"  {str(target):<12} {target.chips:>4} chips: "
            + (
                t.reason
                or f"peak {t.peak_bytes / 2**30:.2f} GiB of {target.chip.hbm_bytes / 2**30:.2f}"
                + (" -> fits" if t.fits else "")
            )
        )
        if t.fits:
            return p, tried
    return None, tried
