"""Algorithm configs nest their parts (``GenerationConfig``, ``ForwardConfig``, the policy loss)
and read flat: a nested config marked ``FLAT`` has its fields on the command line under the
algorithm's prefix (``--grpo.temperature``, not ``--grpo.generation.temperature``), and
``configure`` takes them flat in Python too::

    configure(GRPOConfig, num_generations=4, temperature=0.7, beta=0.04, policy_loss="dapo", epsilon_high=0.3)

A policy loss may be named (``policy_loss="dapo"``) and its options given flat, as the GRPO
config had them before the registry (``epsilon_low``, ``epsilon_high``, ``delta``,
``clip_ratio_c``, ``importance_sampling_level``)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, TypeVar

import tyro

from relax.objectives.registry import POLICY_LOSSES, policy_loss

FLAT = tyro.conf.arg(name="")
"""``Annotated[SomeConfig, FLAT]``: the nested config's flags have no name of their own."""

C = TypeVar("C")
LOSS_OPTION_NAMES = {"importance_sampling_level": "importance"}  # the GRPO flag's old name


@functools.cache
def flat_fields(cls: type) -> tuple[str, ...]:
    """The fields of the dataclass ``cls`` annotated ``FLAT``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple(name for name, hint in hints.items() if FLAT in getattr(hint, "__metadata__", ()))


def configure(cls: type[C], **values: Any) -> C:
    """``cls`` with ``values`` given flat (module docstring); an unknown name is a ``TypeError``
    listing where it was looked for."""
    own = {f.name for f in dataclasses.fields(cls)}
    direct = {k: v for k, v in values.items() if k in own}
    rest = {k: v for k, v in values.items() if k not in own}
    for name in flat_fields(cls):
        nested = direct.get(name, _default(cls, name))
        mine = {
            k: rest.pop(k) for k in list(rest) if k in {f.name for f in dataclasses.fields(nested)}
        }
        if mine:
            direct[name] = dataclasses.replace(nested, **mine)
    if isinstance(direct.get("policy_loss"), str):
        direct["policy_loss"] = policy_loss(direct["policy_loss"]).config
    loss_options = {
        LOSS_OPTION_NAMES.get(k, k): rest.pop(k)
        for k in list(rest)
        if "policy_loss" in own and LOSS_OPTION_NAMES.get(k, k) in _loss_fields()
    }
    if loss_options:
        direct["policy_loss"] = dataclasses.replace(
            direct.get("policy_loss", _default(cls, "policy_loss")), **loss_options
        )
    if rest:
        raise TypeError(
            f"{cls.__name__} has no option(s) {sorted(rest)} (nor its nested "
            f"{', '.join(flat_fields(cls)) or 'configs'})"
        )
    return cls(**direct)


def _default(cls: type, name: str) -> Any:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


@functools.cache
def _loss_fields() -> frozenset[str]:
    return frozenset(f.name for c in POLICY_LOSSES.values() for f in dataclasses.fields(c))
