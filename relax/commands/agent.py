"""Multi-turn tool-use RL from the command line (``relax agent``).

    relax agent                                  # built-in calculator task, a few minutes on CPU
    relax agent --algorithm ppo --ppo.critic shared
    relax agent --agent.per-turn --steps 60
    relax agent --model DIR --data rows.jsonl --env my_envs:make_env   # your environment

``python examples/train_agent.py`` (and ``python -m relax agent``) is the same command, with the same flags.

The policy answers "What is 347 * 86?" either directly or by calling a ``multiply`` tool (Hermes
``<tool_call>`` format, rendered by the model's chat template) and answering from its result.
Trajectories are token-exact (the sampled ids are never re-tokenized), the tool outputs are outside
the loss, and the KV cache is carried across turns. Held-out success, tool use and the success rate
with and without the tool are evaluated before and after (``summary.json``).

Every field of ``relax.algorithms.agent.run.AgentRunConfig`` (and the nested ``--task.*``,
``--grpo.*``, ``--ppo.*`` and ``--agent.*`` options) is a flag; ``--help`` lists them. Your own
environment: ``--env module:factory`` (a callable of no arguments returning an environment,
``relax.environments``) with ``--data`` (each row resets one) and ``--model``; in Python,
``relax.algorithms.agent.step.make_agent_grpo_step(cfg, agent, make_env, chat, parts)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.agent.run import AgentRunConfig

NAME = "agent"


def parse(argv: list[str]) -> AgentRunConfig:
    from relax.algorithms.agent.run import AgentRunConfig, builtin_defaults
    from relax.algorithms.cli.flags import cli

    return cli(
        AgentRunConfig,
        default=builtin_defaults(),
        args=argv,
        description=__doc__,
        prog=f"relax {NAME}",
    )


def run(argv: list[str]) -> dict:
    from relax.algorithms.agent.run import run as run_agent

    return run_agent(parse(argv))


COMMAND = Command(
    NAME, "multi-turn tool-use RL (GRPO or PPO), token-exact trajectories", run, parse
)
