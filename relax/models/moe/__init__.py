"""Mixture-of-experts: routed experts through grouped matmuls, and expert parallelism."""
