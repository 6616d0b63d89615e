"""KTO (Kahneman-Tversky optimisation on unpaired feedback) from the command line.

    python examples/train_kto.py                 # built-in task: reversals desirable, copies undesirable
    python examples/train_kto.py --model HF_DIR --data feedback.jsonl --kto.beta 0.1 --steps 1000
        # rows: prompt / completion / label (true: desirable), TRL's columns

Every field of
``relax.algorithms.kto.run.KTORunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

import tyro

from relax.algorithms.kto.run import KTORunConfig, builtin_defaults, run
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    uses_model = any(a == "--model" or a.startswith("--model=") for a in argv)
    default = KTORunConfig() if uses_model else builtin_defaults()
    return run(tyro.cli(KTORunConfig, default=default, args=argv, description=__doc__))


if __name__ == "__main__":
    exit_as_terminated(main)
