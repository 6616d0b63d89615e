"""The examples' command lines: every field of a run config is a flag (tyro)."""

from __future__ import annotations

from typing import Callable, TypeVar

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
    return tyro.cli(config_cls, default=default, args=argv, description=description)
