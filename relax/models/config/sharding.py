"""Logical sharding axes of the model's parameters and the batch axes of a mesh.

Every parameter of ``relax.models.Transformer`` names its dimensions with LOGICAL axes
(``LOGICAL_AXES``), and so does every weight of a vision-language model's frozen vision part
(``VISION_LOGICAL_AXES``); ``relax.parallel`` maps them to mesh axes by rules. The model layer owns the
names (they are facts about its arrays); the mapping is the parallel layer's business.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from relax.models.config.family_record import ADAPTABLE_FIELDS

BATCH_AXES = ("data", "expert", "fsdp")  # the mesh axes that split the prompt batch
EXPERT_AXIS = (
    "expert"  # also splits the experts of a sparse layer (relax.models.moe.expert_parallel)
)
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
    # a mixture of experts (relax.models.moe.experts), stacked on the sparse layers [Ls]
    "layers.router": ("layers", "embed", "router_experts"),
    "layers.expert_gate": ("layers", "experts", "embed", "expert_mlp"),
    "layers.expert_up": ("layers", "experts", "embed", "expert_mlp"),
    "layers.expert_down": ("layers", "experts", "expert_mlp", "embed"),
    "layers.shared_gate": ("layers", "embed", "mlp"),
    "layers.shared_up": ("layers", "embed", "mlp"),
    "layers.shared_down": ("layers", "mlp", "embed"),
    "layers.shared_router": ("layers", "embed", "shared_router_unit"),
}
# LoRA factors (relax.models.layers.lora): A [L, in, r] shares its weight's input axis, B [L, r, out] its
# output axis; the rank axis is never sharded (no rule names it).
_WEIGHT_AXES = {f: LOGICAL_AXES[f"layers.{f}"] for f in ADAPTABLE_FIELDS}
for _f, (_, _in, _out) in _WEIGHT_AXES.items():
    LOGICAL_AXES[f"layers.lora.{_f}.a"] = ("layers", _in, "lora_rank")
    LOGICAL_AXES[f"layers.lora.{_f}.b"] = ("layers", "lora_rank", _out)


# The frozen vision part of a vision-language model (``relax.models.vision``'s family records),
# by each weight's path in it: its attention heads (``vision_heads``, a fused q/k/v's 3 H heads
# included; split at head boundaries of the tower's head_dim) and MLP widths (``vision_mlp``: the
# blocks', the patch merger's and the projection's columns) go where the rules send them, by
# default over ``tensor`` as the language model's heads and MLP; the widths (``embed``) over
# ``fsdp`` as its model width; a patch's pixels and the patch positions (``patch``) never split.
_VISION_LAYER = "layers", "embed"
VISION_LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    # Gemma 3 (relax.models.vision.gemma3.Gemma3Vision): the SigLIP tower and the projector
    "tower.patch_w": ("patch", "embed"),
    "tower.patch_b": ("embed",),
    "tower.pos": ("patch", "embed"),
    **{
        f"tower.layers.{n}": _VISION_LAYER for n in ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "bo", "b2")
    },
    **{f"tower.layers.{n}": ("layers", "embed", "vision_heads") for n in ("wq", "wk", "wv")},
    **{f"tower.layers.{n}": ("layers", "vision_heads") for n in ("bq", "bk", "bv")},
    "tower.layers.wo": ("layers", "vision_heads", "embed"),
    "tower.layers.w1": ("layers", "embed", "vision_mlp"),
    "tower.layers.b1": ("layers", "vision_mlp"),
    "tower.layers.w2": ("layers", "vision_mlp", "embed"),
    "tower.post_w": ("embed",),
    "tower.post_b": ("embed",),
    "projector.norm": ("embed",),
    "projector.proj": ("embed", "vision_mlp"),
    # Qwen2.5-VL (relax.models.vision.qwen_vit.QwenVision, the vision record's ``visual``)
    "visual.patch_embed": ("patch", "embed"),
    **{f"visual.blocks.{n}": _VISION_LAYER for n in ("norm1", "norm2", "proj_bias", "down_bias")},
    "visual.blocks.qkv": ("layers", "embed", "vision_heads"),
    "visual.blocks.qkv_bias": ("layers", "vision_heads"),
    "visual.blocks.proj": ("layers", "vision_heads", "embed"),
    **{f"visual.blocks.{n}": ("layers", "embed", "vision_mlp") for n in ("gate", "up")},
    **{f"visual.blocks.{n}": ("layers", "vision_mlp") for n in ("gate_bias", "up_bias")},
    "visual.blocks.down": ("layers", "vision_mlp", "embed"),
    "visual.merger.ln_q": ("embed",),
    "visual.merger.fc1": ("embed", "vision_mlp"),
    "visual.merger.fc1_bias": ("vision_mlp",),
    "visual.merger.fc2": ("vision_mlp", "embed"),
    "visual.merger.fc2_bias": ("embed",),
}
HEAD_AXES = ("q_heads", "kv_heads", "vision_heads")  # split at head boundaries


def batch_shards(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> int:
    """Shards of the prompt axis: the product of the mesh's ``BATCH_AXES`` (1 for an empty mesh)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)


def mesh_of(tree) -> jax.sharding.Mesh | None:
    """The mesh ``tree``'s first array is laid out on (its ``NamedSharding``'s); None for one
    device's arrays or a tree without arrays."""
    arrays = (x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
    sharding = getattr(next(arrays, None), "sharding", None)
    return sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None


def ambient_batch_axes() -> tuple[str, ...]:
    """The ``BATCH_AXES`` of the mesh being traced with (``jax.set_mesh``; () outside any mesh):
    the mesh axes a jitted step's rows are split over."""
    names = getattr(jax.sharding.get_abstract_mesh(), "axis_names", ())
    return tuple(a for a in BATCH_AXES if a in names)


def ambient_batch_shards() -> int:
    """``batch_shards`` of the mesh being traced with (``jax.set_mesh``, as ``ShardedStep`` does),
    1 outside any mesh: lets per-group loops run over local groups."""
    return batch_shards(jax.sharding.get_abstract_mesh())


def ambient_axis_size(axis: str) -> int:
    """The size of mesh axis ``axis`` on the mesh being traced with (1 where it has none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[axis] if axis in getattr(mesh, "axis_names", ()) else 1


def rows_over_batch(tree: Any) -> Any:
    """Each array of ``tree`` (inside jit) pinned with its leading rows split over the ambient
    mesh's batch axes (``ambient_batch_axes``) and its other axes whole, where the rows divide;
    unchanged outside a mesh. For the residual stream between layers: each device keeps its own
    rows from layer to layer. Left to propagation, the embedding's split of the model width ran
    every layer on every row with its contractions split, an all-reduce of the whole batch's
    activations per matmul (benchmarks/RESULTS.md, forty-first session)."""
    axes, shards = ambient_batch_axes(), ambient_batch_shards()
    if shards == 1:
        return tree
    pin = lambda x: (  # noqa: E731
        jax.lax.with_sharding_constraint(x, P(axes))
        if getattr(x, "ndim", 0) and x.shape[0] % shards == 0
        else x
    )
    return jax.tree.map(pin, tree)


def path_name(path) -> str:
    """A pytree key path as the dotted name ``LOGICAL_AXES`` uses (``"layers.wq"``,
    ``"layers.lora.wq.a"``)."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


FSDP_AXIS = "fsdp"  # splits the rows and the stored model width of every weight (ZeRO-3)
_TENSOR_LOGICAL = ("q_heads", "kv_heads", "mlp", "expert_mlp", "vocab")


def layer_weight_specs(
    logical: tuple[str, ...], shape: tuple[int, ...], head_dim: int
) -> tuple[P, P] | None:
    """``(in use, stored)``: the ``PartitionSpec`` of one layer's weight (``logical``: its axes in
    ``LOGICAL_AXES`` without ``layers``) while its layer runs, and as the default parameter rules
    (``relax.parallel.mesh.DEFAULT_RULES``) store it, on the mesh being traced with. Stored, its
    model width (``embed``) is split over ``fsdp``; in use it is whole, each device holding what
    its rows need, while heads, MLP units and each expert's units stay over ``tensor`` and experts
    over ``expert`` where they divide. None when nothing is split over ``fsdp`` (no mesh, an
    ``fsdp`` axis of 1, a width it does not divide): nothing to gather."""
    f, t, ep = (ambient_axis_size(a) for a in (FSDP_AXIS, TENSOR_AXIS, EXPERT_AXIS))
    use, stored = [], []
    for axis, n in zip(logical, shape):
        units = n // head_dim if axis in HEAD_AXES and n % head_dim == 0 else n
        if axis == "embed":
            use.append(None)
            stored.append(FSDP_AXIS if f > 1 and n % f == 0 else None)
            continue
        if axis in _TENSOR_LOGICAL and t > 1 and units % t == 0:
            a = TENSOR_AXIS
        elif axis == "experts" and ep > 1 and n % ep == 0:
            a = EXPERT_AXIS
        else:
            a = None
        use.append(a)
        stored.append(a)
    return None if FSDP_AXIS not in stored else (P(*use), P(*stored))


def gathered(x: jax.Array, logical: tuple[str, ...], head_dim: int) -> jax.Array:
    """Weight ``x`` (inside jit; ``logical``: its axes, without ``layers`` for one layer's slice)
    laid out for its use (``layer_weight_specs``): an all-gather over ``fsdp`` of its model width,
    and in the backward its cotangent, each device's partial sum over its own rows,
    reduce-scattered back to the stored split. FSDP made explicit rather than left to the
    partitioner's propagation, which for the rollout's prefill kept the weights split and
    exchanged activations by collective-permute instead (benchmarks/RESULTS.md, forty-second
    session). ``x`` itself where nothing is split over ``fsdp``."""
    specs = layer_weight_specs(logical, x.shape, head_dim)
    if specs is None:
        return x
    use, stored = specs

    @jax.custom_vjp
    def gather(w):
        return jax.lax.with_sharding_constraint(w, use)

    def forward(w):
        return gather(w), None

    def backward(_, g):
        return (jax.lax.with_sharding_constraint(g, stored),)

    gather.defvjp(forward, backward)
    return gather(x)


# The decode loop's arrays, by the meaning of the mesh axes (relax.parallel.mesh): rows over the
# batch axes, heads / MLP units / vocabulary over ``tensor``, experts over ``expert``, the model
# width never split.
TENSOR_AXIS = "tensor"


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """Where a decode step's arrays live: the mesh axes of its rows (``batch``), of its heads, MLP
    units and vocabulary, of a sparse layer's experts and of each expert's units (each None when
    unsplit). Outside a mesh every field is empty and ``constrain`` returns its input; on a mesh
    every array the loop carries or produces is pinned, so the compiled step has only the
    collectives the layout implies (per layer, with ``tensor``: one all-reduce after the attention
    output and one after the MLP down-projection; per sparse layer, with ``expert``: the token
    exchange of ``relax.models.moe.expert_parallel``, all-gathers of the rows and their routing and
    one reduce-scatter of the expert outputs; per step: the embedding lookup's all-reduce and the
    logits' all-gather, and the stop check's all-reduce over rows)."""

    batch: tuple[str, ...] = ()
    heads: str | None = None
    mlp: str | None = None
    vocab: str | None = None
    tensor_size: int = 1  # shards of what ``tensor`` splits (the fused weights' column blocks)
    experts: str | None = None
    expert_mlp: str | None = None

    @property
    def qkv_groups(self) -> int:
        """Column blocks of the fused q/k/v weight (``fuse_layers``): one per head shard."""
        return 1 if self.heads is None else self.tensor_size

    @property
    def mlp_groups(self) -> int:
        """Column blocks of the fused gate/up weight: one per MLP-unit shard."""
        return 1 if self.mlp is None else self.tensor_size

    def spec(self, *dims: str | None) -> P:
        """``PartitionSpec`` from logical dims ("batch", "heads", "mlp", "vocab", "experts",
        "expert_mlp" or None)."""
        axes = {
            "batch": self.batch or None,
            "heads": self.heads,
            "mlp": self.mlp,
            "vocab": self.vocab,
            "experts": self.experts,
            "expert_mlp": self.expert_mlp,
            None: None,
        }
        return P(*(axes[d] for d in dims))

    @property
    def sharded(self) -> bool:
        return bool(self.batch) or any(
            a is not None for a in (self.heads, self.mlp, self.vocab, self.experts, self.expert_mlp)
        )

    def constrain(self, x: jax.Array, *dims: str | None) -> jax.Array:
        """``x`` pinned to ``spec(*dims)`` on the ambient mesh (unchanged when nothing is sharded)."""
        return jax.lax.with_sharding_constraint(x, self.spec(*dims)) if self.sharded else x


def decode_layout(config) -> DecodeLayout:
    """The ``DecodeLayout`` on the mesh being traced with (``jax.set_mesh``; none: unsharded) for a
    model of ``config``: a ``tensor`` axis splits what it divides (whole KV heads and their query
    heads, MLP units, each expert's units, vocabulary rows), an ``expert`` axis the experts, as
    the parameter rules do."""
    batch = tuple(a for a in BATCH_AXES if ambient_axis_size(a) > 1)
    t, ep = ambient_axis_size(TENSOR_AXIS), ambient_axis_size(EXPERT_AXIS)
    split = lambda n: TENSOR_AXIS if t > 1 and n % t == 0 else None  # noqa: E731
    moe = bool(getattr(config, "num_experts", 0))
    return DecodeLayout(
        batch=batch,
        heads=split(config.num_kv_heads),
        mlp=split(config.intermediate_size),
        vocab=split(config.vocab_size),
        tensor_size=t,
        experts=EXPERT_AXIS if moe and ep > 1 and config.num_experts % ep == 0 else None,
        expert_mlp=split(config.moe_intermediate_size) if moe else None,
    )
