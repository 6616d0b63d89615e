"""Where each parameter of a :class:`ModelConfig` lives in a Hugging Face checkpoint: one
:class:`Slot` per tensor (its name, the relax fields it holds, its place in their stacks, its
shape), in transformers' order. ``relax.models.hf.checkpoint`` loads and saves through it,
``relax.models.hf.validate`` checks a checkpoint's headers against one layer's slots.

Tensor names and fused tensors are the family record's (``relax.models.config.families``); a
per-expert name (``{e}``) is one tensor per expert. Building the layout is linear in the
number of tensors: the per-layer kinds (``ModelConfig.sparse_layers``, a tuple over every layer)
are computed once, not per layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from relax.models.config.families import get_family
from relax.models.config.family_record import EXPERT, TRANSPOSED
from relax.models.config.model import DENSE_MLP_FIELDS, MOE_FIELDS, ModelConfig

__all__ = ["Slot", "layer_groups", "layer_slots", "layout", "split_fused"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor of a checkpoint.

    ``name``: its Hugging Face name; ``fields``: the ``Transformer`` field, or the ``LayerStack``
    fields it holds (several for a fused tensor) when ``index`` is not None; ``index``: its place
    in each field's stack, ``(row,)`` or ``(row, expert)`` per expert; ``transpose``: a torch
    ``Linear`` weight, stored ``[out, in]``; ``hf_shape``: its shape in the file; ``widths``: each
    field's share of the (HF) output axis.
    """

    name: str
    fields: tuple[str, ...]
    index: tuple[int, ...] | None
    transpose: bool
    hf_shape: tuple[int, ...]
    widths: tuple[int, ...]


def layer_groups(c: ModelConfig) -> tuple[dict, list]:
    """``c``'s per-layer shapes (``ModelConfig.layer_shapes``) and its family's tensor groups:
    (name under ``model.layers.{i}.``, the fields of ``c`` it holds)."""
    rec = get_family(c.family)
    shapes = c.layer_shapes()
    missing = sorted(set(shapes) - set(rec.weights))
    if missing:
        raise ValueError(
            f"a {c.family} checkpoint has no tensor for {missing} (the config's traits are not "
            f"{c.family}'s)"
        )
    groups = [
        (name, tuple(f for f in fields if f in shapes)) for name, fields in rec.tensors().items()
    ]
    return shapes, groups


def layer_slots(
    c: ModelConfig, shapes: dict, groups: list, i: int, sparse: bool, rows: dict[str, int]
) -> list[Slot]:
    """Layer ``i``'s tensors: each group (tensor name, the fields it holds) whose fields layer ``i``
    has (a ``sparse`` layer's MLP is the experts', ``ModelConfig.sparse_layers``), one per expert
    for a name with ``{e}``; ``rows`` counts each field's layers so far (its row in the field's
    stack) and is updated."""
    has = lambda f: sparse if f in MOE_FIELDS else not sparse if f in DENSE_MLP_FIELDS else True  # noqa: E731
    out = []
    for suffix, fields in groups:
        fields = tuple(f for f in fields if has(f))
        if not fields:
            continue
        row = rows.get(fields[0], 0)
        rows.update(dict.fromkeys(fields, row + 1))
        per_expert = EXPERT in suffix
        shape = shapes[fields[0]][1:] if per_expert else shapes[fields[0]]
        widths = tuple(shapes[f][-1] for f in fields)
        hf_shape = (sum(widths), *shape[:-1])
        name, t = f"model.layers.{i}.{suffix}", fields[0] in TRANSPOSED
        if not per_expert:
            out.append(Slot(name, fields, (row,), t, hf_shape, widths))
            continue
        out += [
            Slot(name.replace(EXPERT, str(e)), fields, (row, e), t, hf_shape, widths)
            for e in range(c.num_experts)
        ]
    return out


def layout(c: ModelConfig, *, with_head: bool) -> list[Slot]:
    """Every tensor of the checkpoint in transformers' order: the embedding, each layer's
    (``layer_slots``), the final norm and, ``with_head``, ``lm_head``."""
    shapes, groups = layer_groups(c)
    table = (c.vocab_size, c.hidden_size)
    slots = [Slot("model.embed_tokens.weight", ("embed",), None, False, table, (c.vocab_size,))]
    rows: dict[str, int] = {}
    for i, sparse in enumerate(c.sparse_layers):
        slots += layer_slots(c, shapes, groups, i, sparse, rows)
    norm = (c.hidden_size,)
    slots.append(Slot("model.norm.weight", ("norm",), None, False, norm, norm))
    if with_head:
        slots.append(Slot("lm_head.weight", ("lm_head",), None, False, table, (c.vocab_size,)))
    return slots


def split_fused(a: np.ndarray, s: Slot) -> list[np.ndarray]:
    """A stored tensor as its fields' arrays (relax's ``[in, out]`` for a linear weight): a fused
    tensor is cut along its output axis."""
    a = a.T if s.transpose else a
    if len(s.fields) == 1:
        return [a]
    return np.split(a, np.cumsum(s.widths)[:-1], axis=-1)
