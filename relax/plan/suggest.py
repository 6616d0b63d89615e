"""Flags that would make a run fit, each checked by compiling the run again with it.

When a plan does not fit, ``suggest`` tries these changes in order, cheapest first, keeping each
one that lowers the peak, until the run fits or none is left::

    --<algo>.remat                          recompute each layer in the backward (update, reference)
    --<algo>.grad-accum 2a, 4a, 8a          smaller micro-batches (same loss and gradient) than
                                            the run's a (``micro_batches``)
    --parallel.offload-reference            the KL reference in host memory between its uses
    --param-dtype bfloat16 --compute-dtype bfloat16 --<algo>.optimizer.master-weights
                                            16-bit weights, float32 master copy in the optimizer
    --parallel.mesh fsdp=<chips>            weights and optimizer state sharded over every chip (with a
                                            sampler split: every chip trains and samples)
    --lora.rank 16                          adapters train, the base model is frozen (one copy)

A sampler/trainer split (``--parallel.sampler-devices``) gives each side fewer chips, so it never
lowers the per-chip peak; it is not tried.
"""

from __future__ import annotations

import dataclasses

import jax

from relax.algorithms.offline.run import OfflineAlgorithm
from relax.parallel import MeshSpec
from relax.plan import targets
from relax.plan.plan import Plan, compile_once, parse_run, plan_run
from relax.plan.programs import run_passes
from relax.plan.trainers import ALGORITHMS
from relax.train.update import micro_batch_split, row_positions


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One change tried: its flags, the peak per chip after it, whether the run then fits and
    whether the change was kept (it lowered the peak); ``error``: the run refused the flags."""

    flags: tuple[str, ...]
    peak_bytes: int
    fits: bool
    kept: bool
    error: str | None = None


def candidates(p: Plan) -> list[tuple[str, ...]]:
    """The changes worth trying on ``p``'s run, in order."""
    run, entry = p.run, ALGORITHMS[p.algorithm]
    algo = entry.settings(run)
    out: list[tuple[str, ...]] = []
    remat = algo.forward.remat if hasattr(algo, "forward") else getattr(algo, "remat", None)
    if remat is False:
        out.append((entry.flag(run, "remat"),))
    if hasattr(algo, "grad_accum"):  # more micro-batches, each splitting a minibatch evenly
        rows, a = run.batch_size // getattr(algo, "num_minibatches", 1), micro_batches(p)
        out += [
            (entry.flag(run, "grad-accum"), str(k)) for k in (2 * a, 4 * a, 8 * a) if rows % k == 0
        ]
    parallel = getattr(run, "parallel", None)
    if (
        getattr(algo, "beta", 0) > 0
        and not run.lora.enabled
        and parallel
        and not parallel.offload_reference
    ):
        out.append(("--parallel.offload-reference",))
    if run.param_dtype == "float32":
        out.append(
            (
                "--param-dtype",
                "bfloat16",
                "--compute-dtype",
                "bfloat16",
                entry.flag(run, "optimizer.master-weights"),
            )
        )
    if parallel and (
        parallel.sampler_devices
        or MeshSpec.parse(parallel.mesh).resolve(p.target.chips).shape
        != MeshSpec(fsdp=p.target.chips).shape
    ):
        out.append(("--parallel.mesh", f"fsdp={p.target.chips}"))
    if not run.lora.enabled:
        out.append(("--lora.rank", "16"))
    return out


def micro_batches(p: Plan) -> int:
    """The update's micro-batches per minibatch in ``p``'s run, as the run splits them
    (``relax.train.update.micro_batch_split``): ``--<algo>.grad-accum``, or when it is left to
    the backend the target's passes' choice (``relax.passes.Passes.micro_batches``) for the
    update's rows, an online run's prompt groups of ``G x N`` completion slots or an offline
    run's longest items (``row_positions``). 1 when the rows do not split."""
    run, entry = p.run, ALGORITHMS[p.algorithm]
    algo, built = entry.settings(run), entry.algorithm(run)
    if isinstance(built, OfflineAlgorithm):
        batch = built.longest(run.batch_size)
        rows, row_tokens = jax.tree.leaves(batch)[0].shape[0], row_positions(batch)
    else:
        gen = built.generation
        rows, row_tokens = run.batch_size, gen.num_generations * gen.max_new_tokens
    passes = run_passes(run, targets.devices(p.target))
    try:
        return micro_batch_split(
            rows, getattr(algo, "num_minibatches", 1), algo.grad_accum, passes, row_tokens
        )
    except ValueError:
        return 1


def suggest(p: Plan, argv: list[str], log=lambda line: None, compile_fn=None) -> list[Attempt]:
    """Greedy: each candidate on top of the kept ones, compiled again; stop once the run fits.
    ``compile_fn``: default ``compile_once()``, so a program no flag changed compiles once."""
    compile_fn = compile_once() if compile_fn is None else compile_fn
    kept: list[str] = []
    best, attempts = p.peak.total if p.peak.total else float("inf"), []
    for flags in candidates(p):
        try:
            trial = plan_run(
                p.algorithm,
                parse_run(p.algorithm, argv + kept + list(flags)),
                p.model,
                p.target,
                compile_fn=compile_fn,
                exact=p.exact,
                images=p.images,
            )
        except (
            ValueError
        ) as e:  # flags this run cannot take (e.g. micro-batches that do not divide it)
            attempts.append(Attempt(flags, 0, False, False, str(e)))
            log(f"  tried {' '.join(flags)}: refused ({e})")
            continue
        lower = trial.peak.total < best or (trial.fits and not p.fits)
        attempts.append(Attempt(flags, trial.peak.total, trial.fits, lower))
        log(
            f"  tried {' '.join(flags)}: peak {trial.peak.total / 2**30:.2f} GiB"
            + (" (fits)" if trial.fits else "")
            + (" -> kept" if lower else "")
        )
        if lower:
            kept += list(flags)
            best = trial.peak.total
        if trial.fits:
            break
    return attempts
