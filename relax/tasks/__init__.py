"""Built-in verifiable tasks that run offline (used by ``examples/train_grpo.py`` with no arguments)."""
