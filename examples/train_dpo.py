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

import tyro

from relax.algorithms.dpo.run import DPORunConfig, builtin_defaults, run
from relax.train.preemption import exit_as_terminated

LOSS_TYPE = "sigmoid"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    uses_model = any(a == "--model" or a.startswith("--model=") for a in argv)
    default = builtin_defaults(LOSS_TYPE)
    if uses_model:
        default = DPORunConfig(dpo=type(default.dpo)(loss_type=LOSS_TYPE))
    return run(tyro.cli(DPORunConfig, default=default, args=argv, description=__doc__))


if __name__ == "__main__":
    exit_as_terminated(main)
