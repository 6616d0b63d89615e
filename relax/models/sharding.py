"""Logical sharding axes of the model's parameters and the batch axes of a mesh.

Every parameter of ``relax.models.Transformer`` names its dimensions with LOGICAL axes
(``LOGICAL_AXES``); ``relax.parallel`` maps them to mesh axes by rules. The model layer owns the
names (they are facts about its arrays); the mapping is the parallel layer's business.
"""

from __future__ import annotations

import math

import jax

BATCH_AXES = ("data", "fsdp")  # the mesh axes that split the prompt batch
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "norm": ("embed",),
    "layers.attn_norm": ("layers", "embed"),
    "layers.mlp_norm": ("layers", "embed"),
    "layers.attn_out_norm": ("layers", "embed"),
    "layers.mlp_out_norm": ("layers", "embed"),
    "layers.wq": ("layers", "embed", "q_heads"),
    "layers.wk": ("layers", "embed", "kv_heads"),
    "layers.wv": ("layers", "embed", "kv_heads"),
    "layers.wo": ("layers", "q_heads", "embed"),
    "layers.w_gate": ("layers", "embed", "mlp"),
    "layers.w_up": ("layers", "embed", "mlp"),
    "layers.w_down": ("layers", "mlp", "embed"),
    "layers.bq": ("layers", "q_heads"),
    "layers.bk": ("layers", "kv_heads"),
    "layers.bv": ("layers", "kv_heads"),
    "layers.bo": ("layers", "embed"),
    "layers.q_norm": ("layers", "head_dim"),
    "layers.k_norm": ("layers", "head_dim"),
    "layers.b_gate": ("layers", "mlp"),
    "layers.b_up": ("layers", "mlp"),
    "layers.b_down": ("layers", "embed"),
}
# LoRA factors (relax.models.lora): A [L, in, r] shares its weight's input axis, B [L, r, out] its
# output axis; the rank axis is never sharded (no rule names it).
_WEIGHT_AXES = {f: LOGICAL_AXES[f"layers.{f}"] for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
for _f, (_, _in, _out) in _WEIGHT_AXES.items():
    LOGICAL_AXES[f"layers.lora.{_f}.a"] = ("layers", _in, "lora_rank")
    LOGICAL_AXES[f"layers.lora.{_f}.b"] = ("layers", "lora_rank", _out)


def batch_shards(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> int:
    """Shards of the prompt axis: the product of the mesh's ``BATCH_AXES`` (1 for an empty mesh)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)


def ambient_batch_shards() -> int:
    """``batch_shards`` of the mesh being traced with (``jax.set_mesh``, as ``ShardedStep`` does),
    1 outside any mesh: lets per-group loops run over local groups."""
    return batch_shards(jax.sharding.get_abstract_mesh())
