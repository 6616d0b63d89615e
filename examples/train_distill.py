"""Knowledge distillation from the command line.

    python examples/train_distill.py            # built-in task: a fresh small student learns the base model
    python examples/train_distill.py --model STUDENT_DIR --teacher TEACHER_DIR --data rows.jsonl --steps 1000
        # rows: prompt / completion; --distill.divergence forward|reverse|jsd, --distill.mode on_policy (GKD)

Every field of
``relax.algorithms.distill.run.DistillRunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

from relax.algorithms.cli.flags import parse_flags
from relax.algorithms.distill.run import DistillRunConfig, builtin_defaults, run
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run(
        parse_flags(
            DistillRunConfig,
            argv,
            builtin=builtin_defaults,
            real=DistillRunConfig,
            description=__doc__,
        )
    )


if __name__ == "__main__":
    exit_as_terminated(main)
