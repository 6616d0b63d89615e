"""GRPO from the command line (``relax grpo``).

    relax grpo                                   # built-in offline task, a few minutes on CPU
    relax grpo --task code                       # write functions, rewarded by tests in the sandbox
    relax grpo --task math                       # LaTeX answers, rewarded by math-verify (the math extra)
    relax grpo --model HF_DIR --data train.jsonl \\
        --preset dapo --grpo.max-new-tokens 512 --steps 500
    relax grpo ... --parallel.mesh data=2,fsdp=4   # sharded over 8 devices
    relax grpo ... --parallel.multihost            # every host of a TPU slice / SLURM job

``python examples/train_grpo.py`` (and ``python -m relax grpo``) is the same command, with the same flags.

Every field of ``relax.algorithms.grpo.run.GRPORunConfig`` (and the nested ``--grpo.*``,
``--eval.*``, ``--health.*`` and ``--reverse.*`` options) is a flag; ``--help`` lists them.
``--preset`` picks the algorithm whose values the ``--grpo.*`` flags then override.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.grpo.run import GRPORunConfig

NAME = "grpo"


def parse(argv: list[str]) -> GRPORunConfig:
    """Flags -> config. Defaults depend on the mode (the built-in task is tiny), on the task and on
    the preset; flags override them."""
    from relax.algorithms.cli.flags import flag_value, parse_flags
    from relax.algorithms.grpo.run import GRPORunConfig, builtin_defaults, real_defaults

    name, task = flag_value(argv, "--preset", "grpo"), flag_value(argv, "--task", "reverse")
    return parse_flags(
        GRPORunConfig,
        argv,
        builtin=lambda: builtin_defaults(name, task),
        real=lambda: real_defaults(name),
        description=__doc__,
        prog=f"relax {NAME}",
    )


def run(argv: list[str]) -> dict:
    from relax.algorithms.grpo.run import run as run_grpo

    return run_grpo(parse(argv))


COMMAND = Command(
    NAME,
    "GRPO and its presets (DAPO, Dr. GRPO, GSPO, ...): online RL from rewards, no critic",
    run,
    parse,
)
