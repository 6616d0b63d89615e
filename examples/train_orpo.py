"""ORPO (odds-ratio preference optimisation, no reference model) from the command line.

    python examples/train_orpo.py                # built-in task: reversing preferred to copying
    python examples/train_orpo.py --model HF_DIR --data pairs.jsonl --dpo.orpo-lambda 0.1 --steps 1000
        # rows: prompt / chosen / rejected (strings or chat messages, TRL's columns)

ORPO is a loss of the DPO family's trainer (``--dpo.loss-type orpo``): the NLL of the chosen
response plus ``orpo_lambda`` times the log-sigmoid of the log odds ratio of chosen to rejected.

Every field of ``relax.algorithms.dpo.run.DPORunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

import tyro

from relax.algorithms.dpo.run import DPORunConfig, builtin_defaults, run
from relax.train.preemption import exit_as_terminated

LOSS_TYPE = "orpo"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    uses_model = any(a == "--model" or a.startswith("--model=") for a in argv)
    default = builtin_defaults(LOSS_TYPE)
    if uses_model:
        default = DPORunConfig(dpo=type(default.dpo)(loss_type=LOSS_TYPE))
    return run(tyro.cli(DPORunConfig, default=default, args=argv, description=__doc__))


if __name__ == "__main__":
    exit_as_terminated(main)
