"""PPO with a critic: per-token KL-shaped rewards, GAE (or VinePPO's Monte-Carlo values), a
clipped value loss, and any policy loss of ``relax.objectives.registry``."""
