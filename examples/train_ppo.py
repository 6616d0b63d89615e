"""PPO with a critic from the command line.

    python examples/train_ppo.py                        # built-in offline task, a few minutes on CPU
    python examples/train_ppo.py --model HF_DIR --data train.jsonl --ppo.max-new-tokens 512 --steps 500
    python examples/train_ppo.py ... --ppo.critic-model CRITIC_DIR   # a critic with a score head
    python examples/train_ppo.py ... --ppo.advantage vineppo         # Monte-Carlo values, no critic
    python examples/train_ppo.py ... --ppo.policy-loss conservative_ppo --ppo.policy-loss.kl-threshold 0.02

Every field of ``relax.algorithms.ppo.run.PPORunConfig`` (and the nested ``--ppo.*``, ``--eval.*``,
``--health.*``, ``--reverse.*`` and ``--parallel.*`` options) is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

from relax.algorithms.cli.flags import flag_value, parse_flags
from relax.algorithms.ppo.run import PPORunConfig, builtin_defaults, real_defaults, run
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    task = flag_value(argv, "--task", "reverse")
    return run(
        parse_flags(
            PPORunConfig,
            argv,
            builtin=lambda: builtin_defaults(task),
            real=real_defaults,
            description=__doc__,
        )
    )


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: a checkpoint was saved; exit status 143
