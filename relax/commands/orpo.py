"""ORPO (odds-ratio preference optimisation, no reference model) from the command line (``relax orpo``).

    relax orpo                   # built-in task: reversing preferred to copying
    relax orpo --model HF_DIR --data pairs.jsonl --dpo.orpo-lambda 0.1 --steps 1000
        # rows: prompt / chosen / rejected (strings or chat messages, TRL's columns)

``python examples/train_orpo.py`` (and ``python -m relax orpo``) is the same command, with the same flags.

ORPO is a loss of the DPO family's trainer (``relax dpo --dpo.loss-type orpo``): the NLL of the
chosen response plus ``orpo_lambda`` times the log-sigmoid of the log odds ratio of chosen to
rejected. Every field of ``relax.algorithms.dpo.run.DPORunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command
from relax.commands.dpo import parse_pairs

if TYPE_CHECKING:
    from relax.algorithms.dpo.run import DPORunConfig

NAME = "orpo"


def parse(argv: list[str]) -> DPORunConfig:
    return parse_pairs(argv, loss_type="orpo", description=__doc__, prog=f"relax {NAME}")


def run(argv: list[str]) -> dict:
    from relax.algorithms.dpo.run import run as run_dpo

    return run_dpo(parse(argv))


COMMAND = Command(
    NAME, "ORPO: odds-ratio preference optimisation on pairs, no reference model", run, parse
)
