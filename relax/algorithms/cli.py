"""The examples' command lines: every field of a run config is a flag (tyro)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

import tyro

Config = TypeVar("Config")


def uses_model(argv: list[str]) -> bool:
    """Whether the flags name a model (``--model DIR``): a real run rather than the built-in task."""
    return any(a == "--model" or a.startswith("--model=") for a in argv)


def flag_value(argv: list[str], flag: str, default: str) -> str:
    """The value of ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``), or ``default``: for defaults
    that depend on a flag (``--preset``, ``--task``) before the full parse."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def parse_flags(config_cls: type[Config], argv: list[str], *, builtin: Callable[[], Config],
                real: Callable[[], Config], description: str | None = None) -> Config:
    """Flags -> config. The defaults are ``builtin()`` (the built-in task, sized for a CPU) unless
    ``--model`` is among the flags, then ``real()``; the flags override them."""
    default = real() if uses_model(argv) else builtin()
    if any(a in ("-h", "--help") for a in argv):
        description = (description or "") + "\n\n" + defaults_note(builtin(), real(), uses_model(argv))
    return tyro.cli(config_cls, default=default, args=argv, description=description)


def flag_values(cfg: Any, prefix: str = "--") -> dict[str, Any]:
    """``{flag: value}`` of every leaf field of the (nested) dataclass ``cfg``, named as the flags are
    (``--grpo.optimizer.learning-rate``; a trailing ``_`` dropped, as ``--async``)."""
    out = {}
    for field in dataclasses.fields(cfg):
        name = prefix + field.name.rstrip("_").replace("_", "-")
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(flag_values(value, name + "."))
        else:
            out[name] = value
    return out


def defaults_note(builtin: Any, real: Any, with_model: bool) -> str:
    """What ``--help`` says of the two sets of defaults: the flags whose default differs between
    the built-in task and a ``--model`` run, with both values (the listed defaults are the mode's
    that the other flags on the command line select)."""
    b, r = flag_values(builtin), flag_values(real)
    differ = [k for k in r if r[k] != b.get(k) and k not in ("--model", "--data")]
    shown = "--model runs" if with_model else "the built-in task (no --model)"
    lines = [f"The defaults below are those of {shown}. These differ between the two modes "
             "(built-in task -> --model run):"]
    lines += [f"  {k}: {b.get(k)!r} -> {r[k]!r}" for k in differ]
    return "\n".join(lines)
