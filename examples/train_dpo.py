"""Direct preference optimisation (DPO and its family) from the command line.

    python examples/train_dpo.py                 # built-in task: reversing preferred to copying
    python examples/train_dpo.py --model HF_DIR --data pairs.jsonl --dpo.beta 0.1 --steps 1000
        # rows: prompt / chosen / rejected (strings or chat messages, TRL's columns)
    python examples/train_dpo.py ... --dpo.loss-type ipo|hinge|robust|simpo|orpo
    python examples/train_dpo.py ... --dpo.precompute-reference   # reference log-probs once, cached beside the data

Every field of ``relax.algorithms.dpo.run.DPORunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

from relax.algorithms.dpo.run import main as dpo_main
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    return dpo_main(
        sys.argv[1:] if argv is None else argv, loss_type="sigmoid", description=__doc__
    )


if __name__ == "__main__":
    exit_as_terminated(main)
