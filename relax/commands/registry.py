"""``COMMANDS``: every command of ``relax`` by name, in the order ``relax --help`` lists them.

Building the table imports only the small modules of ``relax.commands``; each imports its
algorithm (and jax's training stack) when it parses or runs, so listing the commands stays fast.
"""

from __future__ import annotations

from relax.commands import agent, distill, dpo, grpo, kto, orpo, plan, ppo, rlhf, rm, serve, sft
from relax.commands import eval as eval_command
from relax.commands.command import Command

COMMANDS: dict[str, Command] = {
    module.COMMAND.name: module.COMMAND
    for module in (
        grpo,
        ppo,
        sft,
        dpo,
        orpo,
        kto,
        rm,
        distill,
        agent,
        rlhf,
        serve,
        plan,
        eval_command,
    )
}
