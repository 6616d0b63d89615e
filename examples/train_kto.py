"""KTO (Kahneman-Tversky optimisation on unpaired feedback) from the command line.

    python examples/train_kto.py                 # built-in task: reversals desirable, copies undesirable
    python examples/train_kto.py --model HF_DIR --data feedback.jsonl --kto.beta 0.1 --steps 1000
        # rows: prompt / completion / label (true: desirable), TRL's columns

Every field of
``relax.algorithms.kto.run.KTORunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

from relax.algorithms.cli.flags import parse_flags
from relax.algorithms.kto.run import KTORunConfig, builtin_defaults, run
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run(
        parse_flags(
            KTORunConfig, argv, builtin=builtin_defaults, real=KTORunConfig, description=__doc__
        )
    )


if __name__ == "__main__":
    exit_as_terminated(main)
