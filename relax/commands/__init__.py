"""The ``relax`` command: every trainer, the training service, the planner and the evaluation
behind one word.

    relax --help                                  # the commands, one line each
    relax grpo --task math                        # a trainer: grpo, ppo, sft, dpo, orpo, kto, rm,
    relax sft --model HF_DIR --data chats.jsonl   #   distill, agent, rlhf
    relax serve --model HF_DIR                    # the training service
    relax plan grpo --target v5p --model config.json   # will the run fit that machine?
    relax eval --model HF_DIR --task gsm8k --data test.jsonl   # a benchmark, as lm-eval scores it

``python -m relax <command>`` and the scripts ``examples/train_<algorithm>.py`` (``rlhf.py``) are
the same commands with the same flags. One module per command holds its help text (the module
docstring) and its ``parse(argv)`` / ``run(argv)``; ``COMMANDS`` (``registry``) lists them as
``Command`` entries (``command``) and ``main`` (``dispatch``) picks one by its first word.
"""

from __future__ import annotations

from relax.commands.command import Command
from relax.commands.dispatch import main
from relax.commands.registry import COMMANDS

__all__ = ["COMMANDS", "Command", "main"]
