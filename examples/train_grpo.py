"""GRPO from the command line.

    python examples/train_grpo.py                      # built-in offline task, a few minutes on CPU
    python examples/train_grpo.py --task code          # write functions, rewarded by tests in the sandbox
    python examples/train_grpo.py --task math          # LaTeX answers, rewarded by math-verify (relax[math])
    python examples/train_grpo.py --model HF_DIR --data train.jsonl \\
        --preset dapo --grpo.max-new-tokens 512 --steps 500
    python examples/train_grpo.py ... --parallel.mesh data=2,fsdp=4   # sharded over 8 devices
    python examples/train_grpo.py ... --parallel.multihost            # every host of a TPU slice / SLURM job

Every field of ``relax.algorithms.grpo.run.GRPORunConfig`` (and the nested ``--grpo.*``, ``--eval.*``,
``--health.*`` and ``--reverse.*`` options) is a flag; ``--help`` lists them. ``--preset`` picks the algorithm whose
values the ``--grpo.*`` flags then override.
"""

from __future__ import annotations

import sys

from relax.algorithms.cli.flags import flag_value, parse_flags
from relax.algorithms.grpo.run import GRPORunConfig, builtin_defaults, real_defaults, run
from relax.train.preemption import exit_as_terminated


def parse_args(argv: list[str]) -> GRPORunConfig:
    """Flags -> config. Defaults depend on the mode (the built-in task is tiny), on the task and on
    the preset; flags override them."""
    name, task = flag_value(argv, "--preset", "grpo"), flag_value(argv, "--task", "reverse")
    return parse_flags(
        GRPORunConfig,
        argv,
        builtin=lambda: builtin_defaults(name, task),
        real=lambda: real_defaults(name),
        description=__doc__,
    )


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: a checkpoint was saved; exit status 143
