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

from relax.algorithms.dpo.run import main as dpo_main
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    return dpo_main(sys.argv[1:] if argv is None else argv, loss_type="orpo", description=__doc__)


if __name__ == "__main__":
    exit_as_terminated(main)
