"""The examples' command lines: every field of a run config is a flag (tyro).

A policy loss is a typed choice (``relax.objectives.registry``): ``--grpo.policy-loss dapo
--grpo.policy-loss.epsilon-high 0.3`` (the first becomes tyro's subcommand ``grpo.policy-loss:dapo``,
put first; the other arguments may come in any order). GRPO's clip flags from before the registry keep working,
renamed with a warning (``--grpo.epsilon-high`` is ``--grpo.policy-loss.epsilon-high``);
``--ppo.policy-loss-args field=value`` is refused with the flag to use instead."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import tyro

from relax.algorithms.cli.configure import flat_fields

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


def parse_flags(
    config_cls: type[Config],
    argv: list[str],
    *,
    builtin: Callable[[], Config],
    real: Callable[[], Config],
    description: str | None = None,
    prog: str | None = None,
) -> Config:
    """Flags -> config. The defaults are ``builtin()`` (the built-in task, sized for a CPU) unless
    ``--model`` is among the flags, then ``real()``; the flags override them. ``prog``: the command
    ``--help`` names (``relax grpo``; None: the script's name)."""
    default = real() if uses_model(argv) else builtin()
    if any(a in ("-h", "--help") for a in argv):
        description = (
            (description or "") + "\n\n" + defaults_note(builtin(), real(), uses_model(argv))
        )
    return cli(config_cls, default=default, args=argv, description=description, prog=prog)


RENAMED_LOSS_FLAGS = {
    "epsilon-low": "epsilon-low",
    "epsilon-high": "epsilon-high",
    "delta": "delta",
    "clip-ratio-c": "clip-ratio-c",
    "importance-sampling-level": "importance",
}
"""GRPO's clip flags before the loss registry -> the registry loss's option."""


def cli(
    config_cls: type[Config],
    *,
    args: list[str],
    default: Config | None = None,
    description: str | None = None,
    prog: str | None = None,
) -> Config:
    """``tyro.cli`` on ``loss_flags(args)``, subcommand arguments in any order."""
    return tyro.cli(
        config_cls,
        default=default,
        args=loss_flags(args),
        description=description,
        prog=prog,
        config=(tyro.conf.CascadeSubcommandArgs,),
    )


def loss_flags(argv: list[str]) -> list[str]:
    """``argv`` with the policy-loss flags as tyro reads them (module docstring)."""
    out: list[str] = []
    choices: list[
        str
    ] = []  # tyro's subcommands, first: an option given before its loss's name applies to it
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        prefix, _, name = flag.removeprefix("--").rpartition(".")
        if flag.startswith("--") and name == "policy-loss-args":
            raise SystemExit(
                f"{flag} was replaced by typed options: --{prefix}.policy-loss NAME "
                f"--{prefix}.policy-loss.FIELD VALUE (e.g. --{prefix}.policy-loss.epsilon-high 0.3)"
            )
        if flag.startswith("--") and name == "policy-loss" and prefix:
            choice = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            choices.append(f"{prefix}.policy-loss:{choice.replace('-', '_')}")
            i += 1 if eq else 2
            continue
        if flag.startswith("--") and prefix == "grpo" and name in RENAMED_LOSS_FLAGS:
            new = f"--grpo.policy-loss.{RENAMED_LOSS_FLAGS[name]}"
            warnings.warn(
                f"{flag} is now {new} (an option of the policy loss)", FutureWarning, stacklevel=2
            )
            out.append(new + (eq + value if eq else ""))
            i += 1
            continue
        out.append(argv[i])
        i += 1
    return choices + out


def flag_values(cfg: Any, prefix: str = "--") -> dict[str, Any]:
    """``{flag: value}`` of every leaf field of the (nested) dataclass ``cfg``, named as the flags are
    (``--grpo.optimizer.learning-rate``; a trailing ``_`` dropped, as ``--async``)."""
    out = {}
    flat = flat_fields(type(cfg))
    for field in dataclasses.fields(cfg):
        name = prefix + field.name.rstrip("_").replace("_", "-")
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(flag_values(value, prefix if field.name in flat else name + "."))
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
    lines = [
        f"The defaults below are those of {shown}. These differ between the two modes "
        "(built-in task -> --model run):"
    ]
    lines += [f"  {k}: {b.get(k)!r} -> {r[k]!r}" for k in differ]
    return "\n".join(lines)
