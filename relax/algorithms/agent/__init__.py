"""Multi-turn tool-use RL: GRPO / PPO on trajectories of environments (``relax.algorithms.agent.step``)."""
