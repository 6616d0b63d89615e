"""The offline run shared by SFT, the preference trainers, reward models and distillation."""
