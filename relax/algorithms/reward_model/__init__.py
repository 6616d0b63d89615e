"""Reward-model training: Bradley-Terry on preference pairs (TRL's ``RewardTrainer``).

``RewardModelConfig`` (``config.py``), the pair loss for ``relax.train.update`` (``loss.py``) and
the step ``make_reward_model_step`` with its state ``init_reward_model_state`` (``step.py``). The
model is ``relax.models.heads.reward_model.RewardModel``; ``relax.rewards.model.reward_model_reward``
makes a trained one a reward for GRPO / PPO.
"""
