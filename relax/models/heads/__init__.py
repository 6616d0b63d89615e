"""Models with heads: the critic, the reward model, distillation's divergences."""
