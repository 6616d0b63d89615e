"""Direct preference optimisation (DPO and its family) from the command line (``relax dpo``).

    relax dpo                    # built-in task: reversing preferred to copying
    relax dpo --model HF_DIR --data pairs.jsonl --dpo.beta 0.1 --steps 1000
        # rows: prompt / chosen / rejected (strings or chat messages, TRL's columns)
    relax dpo ... --dpo.loss-type ipo|hinge|robust|simpo|orpo
    relax dpo ... --dpo.precompute-reference   # reference log-probs once, cached beside the data

``python examples/train_dpo.py`` (and ``python -m relax dpo``) is the same command, with the same flags.

Every field of ``relax.algorithms.dpo.run.DPORunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.dpo.run import DPORunConfig

NAME = "dpo"


def parse_pairs(argv: list[str], *, loss_type: str, description: str, prog: str) -> DPORunConfig:
    """The DPO trainer's flags -> config (``relax dpo``, ``relax orpo``). Defaults: the built-in
    task's without ``--model``, else ``DPORunConfig``'s; both with ``loss_type``."""
    from relax.algorithms.cli.flags import parse_flags
    from relax.algorithms.dpo.config import DPOConfig
    from relax.algorithms.dpo.run import DPORunConfig, builtin_defaults

    return parse_flags(
        DPORunConfig,
        argv,
        builtin=lambda: builtin_defaults(loss_type),
        real=lambda: DPORunConfig(dpo=DPOConfig(loss_type=loss_type)),
        description=description,
        prog=prog,
    )


def parse(argv: list[str]) -> DPORunConfig:
    return parse_pairs(argv, loss_type="sigmoid", description=__doc__, prog=f"relax {NAME}")


def run(argv: list[str]) -> dict:
    from relax.algorithms.dpo.run import run as run_dpo

    return run_dpo(parse(argv))


COMMAND = Command(
    NAME, "DPO and its family (IPO, hinge, robust, SimPO) on preference pairs", run, parse
)
