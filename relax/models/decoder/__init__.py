"""The decoder: one layer, the transformer, token log-probs."""
