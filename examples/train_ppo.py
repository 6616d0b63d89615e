"""PPO with a critic from the command line.

    python examples/train_ppo.py                        # built-in offline task, a few minutes on CPU
    python examples/train_ppo.py --model HF_DIR --data train.jsonl --ppo.max-new-tokens 512 --steps 500
    python examples/train_ppo.py ... --ppo.critic-model CRITIC_DIR   # a critic with a score head
    python examples/train_ppo.py ... --ppo.advantage vineppo         # Monte-Carlo values, no critic
    python examples/train_ppo.py ... --ppo.policy-loss conservative_ppo --ppo.policy-loss-args kl_threshold=0.02

Every field of ``relax.algorithms.ppo.run.PPORunConfig`` (and the nested ``--ppo.*``, ``--eval.*``,
``--health.*``, ``--task.*`` and ``--parallel.*`` options) is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

import tyro

from relax.algorithms.ppo.run import PPORunConfig, builtin_defaults, real_defaults, run
from relax.train.preemption import exit_as_terminated


def parse_args(argv: list[str]) -> PPORunConfig:
    """Flags -> config; the defaults depend on the mode (the built-in task is tiny)."""
    uses_model = any(a == "--model" or a.startswith("--model=") for a in argv)
    defaults = real_defaults() if uses_model else builtin_defaults()
    return tyro.cli(PPORunConfig, default=defaults, args=argv, description=__doc__)


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: a checkpoint was saved; exit status 143
