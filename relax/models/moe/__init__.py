"""Mixture-of-experts: routed experts through grouped matmuls, and expert parallelism."""

from relax.models.moe.expert_parallel import Act, ambient_axis_size, experts_ffn
from relax.models.moe.experts import (
    MoEConfig,
    Routed,
    RouterStats,
    grouped_matmul,
    load_balance_loss,
    route,
    router_loss,
    router_z_loss,
    routing_metrics,
    sparse_ffn,
)

__all__ = [
    "Act",
    "MoEConfig",
    "Routed",
    "RouterStats",
    "ambient_axis_size",
    "experts_ffn",
    "grouped_matmul",
    "load_balance_loss",
    "route",
    "router_loss",
    "router_z_loss",
    "routing_metrics",
    "sparse_ffn",
]
