"""A checkpoint's ``config.json`` checked against its safetensors headers, before any tensor is read
and before any per-layer work, in time linear in the number of tensors.

``check_checkpoint`` raises an :class:`HFFormatError` naming the config file, the field, its value
and what the checkpoint holds (the tensor and its file) for the first of:

- the embedding (``model.embed_tokens.weight``, and ``lm_head.weight`` when stored): rows
  against ``vocab_size``, columns against ``hidden_size``;
- the layer count: the highest ``model.layers.{i}`` index among the tensor names against
  ``num_hidden_layers``, both ways (a config claiming layers the checkpoint lacks, a tensor of a
  layer past the config's);
- the expert count (a mixture of experts): the highest ``experts.{e}`` index against
  ``num_experts`` / ``num_local_experts``, both ways;
- the first dense and first sparse layer's tensors (``relax.models.hf.layout``): each axis of a
  misshapen tensor named by the fields it is made of (``num_attention_heads × head_dim``,
  ``num_key_value_heads × head_dim``, ``intermediate_size``, the experts' width, ...).

A checkpoint that passes is then checked tensor by tensor as it loads
(``relax.models.hf.checkpoint.build_transformer``): missing, extra, misshapen, non-float and
non-finite tensors. Positions (RoPE) have no tensor: ``config.json`` alone bounds them
(``relax.models.hf.config``).
"""

from __future__ import annotations

import re

from relax.models.config.families import get_family
from relax.models.config.model import ModelConfig
from relax.models.hf.layout import layer_groups, layer_slots
from relax.models.hf.reader import HFFormatError
from relax.models.hf.weights_io import SafetensorsFile

__all__ = ["AXES", "check_checkpoint"]

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d{1,18})\.")
_EXPERT = re.compile(r"\.experts\.(\d{1,18})\.")

# LayerStack field -> what each axis of its per-layer shape (``ModelConfig.layer_shapes``) is made
# of: D hidden_size, Q heads x head_dim, K kv heads x head_dim, H head_dim, F intermediate_size,
# E experts, M the experts' width, S the shared expert's width, 1 one.
AXES = dict(
    attn_norm="D",
    wq="DQ",
    wk="DK",
    wv="DK",
    wo="QD",
    mlp_norm="D",
    w_gate="DF",
    w_up="DF",
    w_down="FD",
    bq="Q",
    bk="K",
    bv="K",
    bo="D",
    q_norm="H",
    k_norm="H",
    b_gate="F",
    b_up="F",
    b_down="D",
    attn_out_norm="D",
    mlp_out_norm="D",
    router="DE",
    expert_gate="EDM",
    expert_up="EDM",
    expert_down="EMD",
    shared_gate="DS",
    shared_up="DS",
    shared_down="SD",
    shared_router="D1",
)


def _hf_name(c: ModelConfig, field: str) -> str:
    """A MoE field's ``config.json`` name(s) (the family's, the written one first; relax's own
    when it has none), for messages."""
    first, *aliases = get_family(c.family).moe_names.get(field, (field,))
    return repr(first) + "".join(f" (alias {a!r})" for a in aliases)


def symbols(c: ModelConfig) -> dict[str, tuple[str, int]]:
    """Each ``AXES`` letter of ``c`` as (the ``config.json`` fields it is made of, quoted, and
    their values; its value)."""
    h, hd = c.num_heads, c.head_dim
    kv = c.num_kv_heads
    return {
        "D": ("'hidden_size'", c.hidden_size),
        "Q": (f"'num_attention_heads' × 'head_dim' = {h} × {hd}", h * hd),
        "K": (f"'num_key_value_heads' × 'head_dim' = {kv} × {hd}", kv * hd),
        "H": ("'head_dim'", hd),
        "F": ("'intermediate_size'", c.intermediate_size),
        "E": (_hf_name(c, "num_experts"), c.num_experts),
        "M": (_hf_name(c, "moe_intermediate_size"), c.moe_intermediate_size),
        "S": (_hf_name(c, "shared_expert_size"), c.shared_expert_size),
        "1": ("1", 1),
    }


def _where(where: dict[str, SafetensorsFile], name: str):
    """(the file holding tensor ``name``, its shape)."""
    return where[name].path, where[name].entries[name][1]


def _check_tables(c: ModelConfig, where: dict, source: str) -> None:
    """The embedding's and a stored lm_head's [vocab_size, hidden_size]."""
    for name in (EMBED, HEAD):
        if name not in where:
            continue  # the tensor-by-tensor check names a missing one
        path, shape = _where(where, name)
        if len(shape) != 2:
            raise HFFormatError(
                f"{path}: tensor {name!r} has shape {list(shape)}, expected "
                f"[vocab_size, hidden_size] = [{c.vocab_size}, {c.hidden_size}] ({source})"
            )
        for n, field, value, axis in (
            (shape[0], "vocab_size", c.vocab_size, "rows"),
            (shape[1], "hidden_size", c.hidden_size, "columns"),
        ):
            if n != value:
                raise HFFormatError(
                    f"{source}: field {field!r} = {value}, but tensor {name!r} in {path} "
                    f"has {n} {axis} (shape {list(shape)})"
                )


def _highest(names, pattern: re.Pattern) -> tuple[int, str] | None:
    """(the highest index ``pattern`` captures in ``names``, the first name holding it)."""
    best = None
    for name in names:
        m = pattern.search(name)
        if m is not None and (best is None or int(m[1]) > best[0]):
            best = (int(m[1]), name)
    return best


def _check_count(
    where: dict, listing: str, source: str, field: str, value: int, top, what: str
) -> None:
    """``value`` (``field`` of ``source``, as messages name it) against the highest index
    present, ``top`` (``_highest``)."""
    if top is not None and top[0] >= value:
        index, name = top
        raise HFFormatError(
            f"{where[name].path}: unexpected tensor {name!r} ({what} {index}; {source} field "
            f"{field} = {value}{f': {what}s 0..{value - 1}' if value else ''})"
        )
    if value and (top is None or top[0] + 1 < value):
        holds = "no" if top is None else f"{what}s 0..{top[0]} only, no"
        raise HFFormatError(
            f"{source}: field {field} = {value}, but {listing} holds {holds} tensor of "
            f"{what} {0 if top is None else top[0] + 1}"
        )


def _axis_error(c: ModelConfig, s, path, shape, source: str) -> HFFormatError:
    """The error for tensor slot ``s`` stored with ``shape``: each axis that differs, named by
    the fields it is made of."""
    per_expert = len(s.index) == 2
    axes = [AXES[f][1:] if per_expert else AXES[f] for f in s.fields]
    hf_axes = ["".join(a[-1] for a in axes), *axes[0][:-1]]  # torch's [out (fused: summed), in]
    sym = symbols(c)
    bad = [
        f"axis {k} is {' + '.join(f'{sym[x][0]} = {sym[x][1]}' for x in letters)}"
        for k, (letters, n, want) in enumerate(zip(hf_axes, shape, s.hf_shape))
        if n != want
    ]
    if len(shape) != len(s.hf_shape):
        bad.append(f"{len(s.hf_shape)} axes")
    return HFFormatError(
        f"{path}: tensor {s.name!r} has shape {list(shape)}, expected {list(s.hf_shape)} "
        f"from {source}: {'; '.join(bad)}"
    )


def _check_first_layers(c: ModelConfig, where: dict, source: str) -> None:
    """The tensors of the first layer of each kind (dense, sparse) against their slots."""
    shapes, groups = layer_groups(c)
    kinds = c.sparse_layers
    for i in sorted({kinds.index(k) for k in set(kinds)}):
        for s in layer_slots(c, shapes, groups, i, kinds[i], {}):
            if s.name in where:
                path, shape = _where(where, s.name)
                if shape != s.hf_shape:
                    raise _axis_error(c, s, path, shape, source)


def check_checkpoint(
    c: ModelConfig, where: dict[str, SafetensorsFile], listing: str, source: str
) -> None:
    """Raise ``HFFormatError`` for the first value of ``c`` (read from ``source``) that the tensors
    ``where`` (``open_weights``; ``listing`` names them) contradict: the module docstring's list."""
    _check_tables(c, where, source)
    layers = "'num_hidden_layers'", c.num_layers, _highest(where, _LAYER)
    _check_count(where, listing, source, *layers, "layer")
    if get_family(c.family).moe != "none":
        experts = _hf_name(c, "num_experts"), c.num_experts, _highest(where, _EXPERT)
        _check_count(where, listing, source, *experts, "expert")
    _check_first_layers(c, where, source)
