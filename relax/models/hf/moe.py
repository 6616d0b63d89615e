"""Mixture-of-experts fields of a Hugging Face ``config.json`` <-> :class:`ModelConfig`.

A family's record (``relax.models.config.families``) says how its config spells them: ``moe`` (which
layers are sparse), ``moe_names`` (each ``ModelConfig`` field's names in the file), ``moe_fixed``
(the fields the family fixes) and ``hf_defaults`` (transformers' values of absent ones, keyed by
``ModelConfig`` name). ``relax.models.hf.config`` calls these with its reader; the facts
(transformers 5.23):

- Qwen2-MoE / Qwen3-MoE (``moe="qwen"``): layer ``i`` is sparse iff ``i not in mlp_only_layers
  and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``; relax's ``dense_layers`` are the
  other layers, written back as ``mlp_only_layers`` with ``decoder_sparse_step = 1``. Qwen3-MoE
  writes ``num_local_experts`` (``num_experts`` is its alias); Qwen2-MoE ``num_experts``. A file
  with ``num_experts: 0`` is a dense model (every MoE field at ``ModelConfig``'s default).
- Mixtral (``moe="all"``): every layer sparse (``num_local_experts >= 1``), the experts' width is
  ``intermediate_size``, the top-k always renormalised (``norm_topk_prob`` fixed True).
- ``router_z_loss_coef`` is no transformers field: read when present (default 0), written when
  not 0.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from relax.models.config.family_record import FamilyRecord
from relax.models.config.model import ModelConfig

if TYPE_CHECKING:
    from relax.models.hf.reader import ConfigReader

__all__ = ["moe_fields", "moe_problems", "moe_to_hf"]

_KINDS = {
    "num_experts": "int_",
    "num_experts_per_tok": "int_",
    "moe_intermediate_size": "int_",
    "shared_expert_size": "int_",
    "norm_topk_prob": "bool_",
    "output_router_logits": "bool_",
    "router_aux_loss_coef": "float_",
    "router_z_loss_coef": "float_",
}  # ModelConfig field -> reader method
_DEFAULTS = dict(
    norm_topk_prob=False,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    router_z_loss_coef=0.0,
)  # transformers' for every MoE family (a record's hf_defaults win)
_IF_SET = ("router_z_loss_coef",)  # written only when not 0
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def _name(r: ConfigReader, names: tuple[str, ...]) -> str:
    """The first of ``names`` the file sets (not null), else the first (the written one)."""
    return next((n for n in names if r.d.get(n) is not None), names[0])


def _dense_layers(r: ConfigReader, rec: FamilyRecord, layers: int) -> tuple[int, ...]:
    """The layers whose MLP is dense: for ``moe="qwen"`` those in ``mlp_only_layers`` or off the
    ``decoder_sparse_step``; none for ``moe="all"``."""
    if rec.moe == "all":
        return ()
    only = r.get("mlp_only_layers", None) or []
    if not isinstance(only, list) or any(
        not isinstance(i, int) or isinstance(i, bool) for i in only
    ):
        raise r.fail("mlp_only_layers", f"must be a list of layer indices or null, got {only!r}")
    step = r.int_("decoder_sparse_step", 1)
    if step < 1:
        raise r.fail("decoder_sparse_step", f"must be >= 1, got {step}")
    only = set(only)  # a membership test per layer: linear in the layers
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def moe_fields(r: ConfigReader, rec: FamilyRecord, layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` MoE fields of the file read by ``r`` (none for a dense family or a
    model without experts); errors name the file's field."""
    if rec.moe == "none":
        return {}
    defaults = {**_DEFAULTS, **rec.hf_defaults}
    f: dict[str, Any] = {}
    for field, names in rec.moe_names.items():
        default = (defaults[field],) if field in defaults else ()  # none: the field is required
        f[field] = getattr(r, _KINDS[field])(_name(r, names), *default)
    experts_name = _name(r, rec.moe_names["num_experts"])
    if f["num_experts"] < (1 if rec.moe == "all" else 0):
        every = (
            f" (every {rec.model_type} layer is a mixture of experts)" if rec.moe == "all" else ""
        )
        raise r.fail(
            experts_name,
            f"must be >= {1 if rec.moe == 'all' else 0}, got {f['num_experts']}{every}",
        )
    if f["num_experts"] == 0:
        return {}
    if "shared_expert_size" in rec.moe_names and f["shared_expert_size"] < 1:
        raise r.fail(
            _name(r, rec.moe_names["shared_expert_size"]),
            f"must be >= 1 (every {rec.model_type} sparse layer has a shared expert), "
            f"got {f['shared_expert_size']}",
        )
    return {**f, **rec.moe_fixed, "dense_layers": _dense_layers(r, rec, layers)}


def moe_problems(cfg: ModelConfig, rec: FamilyRecord) -> list[str]:
    """What of ``cfg``'s mixture of experts the family's ``config.json`` cannot say."""
    fam = rec.model_type
    if rec.moe == "none":
        return [f"num_experts={cfg.num_experts} ({fam} has no experts)"] if cfg.num_experts else []
    if not cfg.num_experts:
        return (
            [f"num_experts=0 (every {fam} layer is a mixture of experts)"]
            if rec.moe == "all"
            else []
        )
    bad = [
        f"{k}={getattr(cfg, k)!r} ({fam} has {v!r})"
        for k, v in rec.moe_fixed.items()
        if getattr(cfg, k) != v
    ]
    if rec.moe == "all" and cfg.dense_layers:
        bad.append(f"dense_layers={cfg.dense_layers!r} (every {fam} layer is sparse)")
    for field, names in rec.moe_names.items():
        other = names[0]
        if (
            other != field
            and other in _CONFIG_FIELDS
            and getattr(cfg, other) != getattr(cfg, field)
        ):
            bad.append(
                f"{field}={getattr(cfg, field)!r} with {other}={getattr(cfg, other)!r} ({fam} has one {other})"
            )
    if "shared_expert_size" in rec.moe_names and cfg.shared_expert_size < 1:
        bad.append(
            f"shared_expert_size={cfg.shared_expert_size} ({fam} always has a shared expert)"
        )
    return bad


def moe_to_hf(cfg: ModelConfig, rec: FamilyRecord) -> dict[str, Any]:
    """The file's MoE fields (``moe_fields`` read back) of a config ``moe_problems`` passes."""
    if rec.moe == "none":
        return {}
    d = {
        names[0]: getattr(cfg, field)
        for field, names in rec.moe_names.items()
        if not (field in _IF_SET and getattr(cfg, field) == 0)
    }
    if rec.moe == "qwen":
        d.update(mlp_only_layers=list(cfg.dense_layers), decoder_sparse_step=1)
    return d
