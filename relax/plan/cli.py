"""``relax plan``: will this run fit that machine? Compiled for it, without it.

    relax plan grpo --target v5p:2x2x2 --model llama-3.1-8b/config.json \\
        --batch-size 64 --grpo.num-generations 16 --grpo.max-new-tokens 2048 --parallel.mesh fsdp=8

The first word is the algorithm: grpo, ppo (with ``--reward-model DIR``, its reward model
too), sft, dpo, ipo, simpo, orpo (the DPO family, ``--dpo.*``), kto, rm (a reward model),
distill (``--teacher``: the teacher's config.json), agent (the multi-turn trainer, ``--algorithm
grpo|ppo``). A GRPO run on a vision-language ``--model`` with ``--image-field`` plans prompts of
``--images-per-prompt K`` images (1) of ``--image-tokens T`` tokens each (the family's usual:
Gemma 3's 256, Qwen2.5-VL's 1,024), the image encode and the vision weights included
(``relax.plan.vision``). ``--target`` is the machine (``relax.plan.targets``); every other flag is the run's
own (``relax <algorithm> --help``); without ``--parallel.mesh`` the run is laid out over every
chip (``fsdp=-1``), online or offline. Prints per chip and per program what the memory holds,
the peak against the chip's HBM and the step's traffic; when the run does not fit, the flags
that make it fit (``relax.plan.suggest``, ``--no-suggest`` to skip). ``--compile-threads N``
compiles N programs at a time (default 1: compiling Llama-3.1-8B's update took 16 GB of host
memory). A chip kind alone
(``--target v5p``) plans the run on its slices from the smallest up and stops at the first
that fits (``relax.plan.search``). The sampler of a deep model is
compiled at two shallow depths and extended to the model's (``relax.plan.depth``); ``--exact``
compiles it whole (slower). ``--json FILE`` writes the plan's figures. Exit status 0: fits; 3:
does not fit; 2: usage error. ``python -m relax.plan ...`` is ``relax plan ...``; ``--help``
prints this text.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from relax.algorithms.cli.flags import flag_value

USAGE = (
    "usage: relax plan <grpo|ppo|sft|dpo|ipo|simpo|orpo|kto|rm|distill|agent> "
    "--target <v5e:2x4|v5p:2x2x2|v6e:4x4|h100x8|v5p|h100|...> "
    "--model <dir|config.json> [--exact] [--no-suggest] [--compile-threads N] [--json FILE] "
    "[--images-per-prompt K] [--image-tokens T] [run flags]"
)


def help_text() -> str:
    """What ``relax plan --help`` prints: the usage line and this module's docstring."""
    return USAGE + "\n\n" + (__doc__ or "").strip() + "\n"


def _pop(argv: list[str], flag: str, takes_value: bool = True) -> tuple[list[str], str | None]:
    """``argv`` without ``flag`` (and its value), and the value (or "" for a bare flag; None: absent)."""
    value = flag_value(argv, flag, None) if takes_value else ("" if flag in argv else None)
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = takes_value
            continue
        if takes_value and a.startswith(flag + "="):
            continue
        out.append(a)
    return out, value


def summary(p) -> dict:
    """The plan's figures as JSON-able values."""
    return {
        "algorithm": p.algorithm,
        "target": str(p.target),
        "fits": p.fits,
        "peak": p.peak.name,
        "compile_s": round(p.compile_s, 1),
        "exact": p.exact,
        "programs": [dataclasses.asdict(m) | {"fits": m.fits} for m in p.programs],
        "traffic": [None if t is None else dataclasses.asdict(t) for t in p.traffic],
        "images": None if p.images is None else dataclasses.asdict(p.images),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"] and any(a in ("-h", "--help") for a in argv[1:]):
        print(help_text(), end="")
        return 0
    from relax.plan.plan import compile_once, plan
    from relax.plan.search import SLICES
    from relax.plan.suggest import suggest
    from relax.plan.vision import ImagePlan

    if not argv or argv[0] != "plan" or len(argv) < 2 or argv[1].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    algorithm, rest = argv[1], argv[2:]
    rest, target = _pop(rest, "--target")
    rest, out = _pop(rest, "--json")
    rest, no_suggest = _pop(rest, "--no-suggest", takes_value=False)
    rest, exact = _pop(rest, "--exact", takes_value=False)
    rest, threads = _pop(rest, "--compile-threads")
    rest, per_prompt = _pop(rest, "--images-per-prompt")
    rest, tokens = _pop(rest, "--image-tokens")
    if target is None:
        print(USAGE + "\n--target is required", file=sys.stderr)
        return 2
    if threads is not None and not (threads.isdigit() and int(threads) >= 1):
        print(
            USAGE + f"\n--compile-threads must be a whole number >= 1, got {threads!r}",
            file=sys.stderr,
        )
        return 2
    workers = 1 if threads is None else int(threads)
    for flag, value in (("--images-per-prompt", per_prompt), ("--image-tokens", tokens)):
        if value is not None and not (value.isdigit() and int(value) >= 1):
            print(USAGE + f"\n{flag} must be a whole number >= 1, got {value!r}", file=sys.stderr)
            return 2
    images = (
        None
        if per_prompt is None and tokens is None
        else ImagePlan(
            1 if per_prompt is None else int(per_prompt), None if tokens is None else int(tokens)
        )
    )
    compile_fn = compile_once()  # the suggestions reuse the programs their flags leave alone
    if target.strip().lower() in SLICES:  # a chip kind: its smallest slice that fits
        return _search(
            algorithm,
            rest,
            target.strip().lower(),
            compile_fn,
            exact is not None,
            out,
            workers,
            images,
        )
    p = plan(
        algorithm,
        rest,
        target,
        compile_fn=compile_fn,
        exact=exact is not None,
        workers=workers,
        images=images,
    )
    print(p.table(), flush=True)
    record = summary(p)
    if not p.fits and no_suggest is None:
        print(
            "\n  does not fit; trying flags that would make it fit (each compiled again):",
            flush=True,
        )
        attempts = suggest(p, rest, log=lambda line: print(line, flush=True), compile_fn=compile_fn)
        record["suggestions"] = [dataclasses.asdict(a) for a in attempts]
        kept = [f for a in attempts if a.kept for f in a.flags]
        fits = bool(attempts) and attempts[-1].fits
        print(
            f"\n  {'fits with' if fits else 'still does not fit with'}: {' '.join(kept) or '(no change helped)'}"
        )
    _write(out, record)
    return 0 if p.fits else 3


def _search(
    algorithm: str,
    argv: list[str],
    kind: str,
    compile_fn,
    exact: bool,
    out: str | None,
    workers: int,
    images=None,
) -> int:
    """``--target <kind>``: plan the run on the slices of ``kind`` from the smallest up."""
    from relax.plan.plan import parse_run
    from relax.plan.search import smallest
    from relax.plan.vision import language_config

    run = parse_run(algorithm, argv)
    print(
        f"relax plan: the smallest {kind} slice for {algorithm} (each planned in full):", flush=True
    )
    p, tried = smallest(
        algorithm,
        run,
        language_config(run.model),
        kind,
        compile_fn=compile_fn,
        exact=exact,
        log=lambda line: print(line, flush=True),
        workers=workers,
        images=images,
    )
    record = {
        "kind": kind,
        "tried": [dataclasses.asdict(t) | {"target": str(t.target)} for t in tried],
    }
    if p is None:
        print(f"\n  no {kind} slice up to {tried[-1].target} fits this run", flush=True)
    else:
        print("\n" + p.table(), flush=True)
        record["plan"] = summary(p)
    _write(out, record)
    return 0 if p is not None else 3


def _write(out: str | None, record: dict) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
