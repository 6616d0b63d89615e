"""PPO with a critic from the command line (``relax ppo``).

    relax ppo                                    # built-in offline task, a few minutes on CPU
    relax ppo --model HF_DIR --data train.jsonl --ppo.max-new-tokens 512 --steps 500
    relax ppo ... --ppo.critic-model CRITIC_DIR   # a critic with a score head
    relax ppo ... --ppo.advantage vineppo         # Monte-Carlo values, no critic
    relax ppo ... --ppo.policy-loss conservative_ppo --ppo.policy-loss.kl-threshold 0.02

``python examples/train_ppo.py`` (and ``python -m relax ppo``) is the same command, with the same flags.

Every field of ``relax.algorithms.ppo.run.PPORunConfig`` (and the nested ``--ppo.*``, ``--eval.*``,
``--health.*``, ``--reverse.*`` and ``--parallel.*`` options) is a flag; ``--help`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.ppo.run import PPORunConfig

NAME = "ppo"


def parse(argv: list[str]) -> PPORunConfig:
    """Flags -> config; the built-in defaults depend on ``--task``."""
    from relax.algorithms.cli.flags import flag_value, parse_flags
    from relax.algorithms.ppo.run import PPORunConfig, builtin_defaults, real_defaults

    task = flag_value(argv, "--task", "reverse")
    return parse_flags(
        PPORunConfig,
        argv,
        builtin=lambda: builtin_defaults(task),
        real=real_defaults,
        description=__doc__,
        prog=f"relax {NAME}",
    )


def run(argv: list[str]) -> dict:
    from relax.algorithms.ppo.run import run as run_ppo

    return run_ppo(parse(argv))


COMMAND = Command(
    NAME, "PPO with a critic (or VinePPO's Monte-Carlo values): online RL from rewards", run, parse
)
