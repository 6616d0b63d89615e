"""GRPO and its family (Dr. GRPO, DAPO, GSPO, RLOO, CISPO presets)."""
