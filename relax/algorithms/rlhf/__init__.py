"""Three-stage RLHF in one run: SFT -> reward model -> PPO or GRPO against it (``relax.algorithms.rlhf.run``)."""
