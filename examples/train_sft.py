"""Supervised fine-tuning (SFT) from the command line.

    python examples/train_sft.py                # built-in task: the reverse task's right answers
    python examples/train_sft.py --model HF_DIR --data chats.jsonl --sft.max-length 2048 --steps 1000
        # rows: messages (a chat, loss on the assistant turns), prompt/completion, or text

Examples are packed into rows of ``--sft.max-length`` tokens (attention never crosses an example;
``--sft.no-packing`` for one per row); ``--batch-size`` counts rows. Every field of
``relax.algorithms.sft.run.SFTRunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

from relax.algorithms.cli.flags import parse_flags
from relax.algorithms.sft.run import SFTRunConfig, builtin_defaults, run
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run(
        parse_flags(
            SFTRunConfig, argv, builtin=builtin_defaults, real=SFTRunConfig, description=__doc__
        )
    )


if __name__ == "__main__":
    exit_as_terminated(main)
