"""A user's environment named on the command line: ``--env my_module:make_env``.

    make_env = load_factory("my_envs:Guess")   # my_envs.py in the working directory, or installed
    env = make_env()                           # a fresh environment per trajectory
    schemas = tool_schemas(env)                # its tools, for the chat template (None: no tools)

``verifiers:<id>[?key=value&...]`` names a ``verifiers`` environment
(``relax.environments.verifiers_env``; the library is imported only then).

``module:name`` names a callable of no arguments (a class or a function) that returns an
``Environment`` or ``AsyncEnvironment`` (``relax.environments.protocol``). The module is imported
as Python imports it, with the working directory first on the path (as ``python -m`` would): a
file ``my_envs.py`` next to where the command runs is found. A spec that does not resolve, a name
that is not callable and an object that is not an environment are errors naming the spec.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.environments.protocol import AsyncEnvironment, Environment


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable ``spec`` (``"module:name"``, ``name`` may be dotted) names; ``ValueError``
    naming the spec when it does not resolve to a callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--env {spec!r}: expected module:factory, e.g. my_envs:make_env")
    try:
        module = _import(module_name)
    except ImportError as e:
        raise ValueError(f"--env {spec!r}: cannot import {module_name!r}: {e}") from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--env {spec!r}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--env {spec!r}: {attr} is a {type(target).__name__}, not a callable")
    return target


def _import(module_name: str):
    """``module_name`` imported with the working directory first on ``sys.path``."""
    cwd = str(Path.cwd())
    if cwd in sys.path:
        return importlib.import_module(module_name)
    sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(cwd)


def make_checked(spec: str) -> tuple[Callable[[], Any], Any]:
    """``(factory, env)``: ``spec``'s factory and one environment it made, checked to follow the
    environment protocol (``reset`` / ``step`` or ``areset`` / ``astep``)."""
    if spec.startswith("verifiers:"):
        from relax.environments.verifiers_env import verifiers_factory

        factory = verifiers_factory(spec)
        return factory, factory()
    factory = load_factory(spec)
    env = factory()
    if not isinstance(env, (Environment, AsyncEnvironment)):
        raise ValueError(
            f"--env {spec!r}: {type(env).__name__} has neither reset/step nor areset/astep "
            "(relax.environments.Environment)"
        )
    return factory, env


def tool_schemas(env: Any) -> list[dict] | None:
    """The JSON schemas of ``env``'s tools for the chat template's ``tools=``: its ``schemas()``
    (as ``ToolEnvironment`` has), else None (no tools in the prompt)."""
    schemas = getattr(env, "schemas", None)
    return None if schemas is None else (list(schemas()) or None)
