"""The online run shared by GRPO, PPO and the agent trainer: batch types, stages, step, run."""
