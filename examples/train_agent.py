"""Multi-turn tool-use RL from the command line.

    python examples/train_agent.py                         # built-in calculator task, a few minutes on CPU
    python examples/train_agent.py --algorithm ppo --ppo.critic shared
    python examples/train_agent.py --agent.per-turn --steps 60

The policy answers "What is 347 * 86?" either directly or by calling a ``multiply`` tool (Hermes
``<tool_call>`` format, rendered by the model's chat template) and answering from its result.
Trajectories are token-exact (the sampled ids are never re-tokenized), the tool outputs are
outside the loss, and the KV cache is carried across turns. Held-out success, tool use and the
success rate with and without the tool are evaluated before and after (``summary.json``).

Every field of ``relax.algorithms.agent.run.AgentRunConfig`` (and the nested ``--task.*``,
``--grpo.*``, ``--ppo.*`` and ``--agent.*`` options) is a flag; ``--help`` lists them. Your own
environments: ``relax.algorithms.agent.step.make_agent_grpo_step(cfg, agent, make_env, chat, pad_id=...)``.
"""

from __future__ import annotations

import sys

from relax.algorithms.agent.run import AgentRunConfig, builtin_defaults, run
from relax.algorithms.cli.flags import cli
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run(cli(AgentRunConfig, default=builtin_defaults(), args=argv, description=__doc__))


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: a checkpoint was saved; exit status 143
