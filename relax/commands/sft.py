"""Supervised fine-tuning (SFT) from the command line (``relax sft``).

    relax sft                    # built-in task: the reverse task's right answers
    relax sft --model HF_DIR --data chats.jsonl --sft.max-length 2048 --steps 1000
        # rows: messages (a chat, loss on the assistant turns), prompt/completion, or text

``python examples/train_sft.py`` (and ``python -m relax sft``) is the same command, with the same flags.

Examples are packed into rows of ``--sft.max-length`` tokens (attention never crosses an example;
``--sft.no-packing`` for one per row); ``--batch-size`` counts rows. Every field of
``relax.algorithms.sft.run.SFTRunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.sft.run import SFTRunConfig

NAME = "sft"


def parse(argv: list[str]) -> SFTRunConfig:
    from relax.algorithms.cli.flags import parse_flags
    from relax.algorithms.sft.run import SFTRunConfig, builtin_defaults

    return parse_flags(
        SFTRunConfig,
        argv,
        builtin=builtin_defaults,
        real=SFTRunConfig,
        description=__doc__,
        prog=f"relax {NAME}",
    )


def run(argv: list[str]) -> dict:
    from relax.algorithms.sft.run import run as run_sft

    return run_sft(parse(argv))


COMMAND = Command(
    NAME, "supervised fine-tuning on demonstrations (chats, prompt/completion or text)", run, parse
)
