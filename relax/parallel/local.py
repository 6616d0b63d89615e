"""Each process's own copy of the policy, for host loops that every process runs on its own rows.

A multi-turn rollout (``relax.environments.rollout``) calls the device between its
environments' steps, and how many calls a batch takes depends on what its environments answer.
On a mesh over several processes every process must make the same calls with the same shapes
(collectives), which rows that end at different turns cannot promise. So each process samples
its own rows on its own devices, against a copy of the trainer's policy laid out over them:

- ``local_mesh(mesh)``: this process's devices of ``mesh`` with its axes: ``tensor``, ``expert``
  and ``fsdp`` as on ``mesh`` where they fit (``gcd`` with what is left of the process's device
  count; a divisor of an axis a parameter splits over splits it too), ``data`` the rest.
- ``ProcessCopy(mesh)(tree)``: the models in ``tree`` (global arrays laid out on ``mesh``) as
  arrays on ``local_mesh(mesh)``, by the same sharding rules. One compiled reshard over every
  process (an all-gather across processes, each device keeping ``1 / local devices`` of each
  parameter), then each process takes the arrays on its own devices as its copy; ``view(state)``
  is a state for a host stage: this copy as the policy, the other models dropped and the
  replicated leaves (step, key) as this process's values.

The copy costs one reshard per use and ``params / local devices`` more memory per device while it
lives. On one process it is the state itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from relax.models.decoder.transformer import Transformer
from relax.parallel import distributed
from relax.parallel.mesh import AXES, DEFAULT_RULES, Rules, param_shardings

PROCESS_AXIS = "process"
# a TrainState's model fields (as relax.parallel.step's MODEL_FIELDS): only the policy samples
OTHER_MODELS = ("opt_state", "ref", "critic", "critic_opt_state")


def local_shape(shape: dict[str, int], devices: int) -> dict[str, int]:
    """The axes (``AXES``) of a process's ``devices`` for a mesh of ``shape``: ``tensor``,
    ``expert`` and ``fsdp`` as in ``shape`` as far as they divide what is left, ``data`` the rest."""
    out, left = {}, devices
    for axis in ("tensor", "expert", "fsdp"):
        out[axis] = math.gcd(shape.get(axis, 1), left)
        left //= out[axis]
    out["data"] = left
    return {a: out[a] for a in AXES}


def _grid(mesh: Mesh) -> np.ndarray:
    """``mesh``'s devices as ``[process, *local_shape]``, each process's in id order."""
    devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
    n = processes(mesh)
    per = len(devices) // n
    if per * n != len(devices):
        raise ValueError("a process copy needs the same number of mesh devices on every process")
    shape = local_shape(dict(mesh.shape), per)
    return np.asarray(devices, dtype=object).reshape(n, *shape.values())


def host_mesh(mesh: Mesh, process: int) -> Mesh:
    """Process ``process``'s devices of ``mesh`` as a mesh of its own (module docstring)."""
    grid = _grid(mesh)
    mine = [i for i in range(grid.shape[0]) if grid[i].flat[0].process_index == process]
    return Mesh(grid[mine[0]], AXES)


def local_mesh(mesh: Mesh) -> Mesh:
    """This process's devices of ``mesh`` (module docstring)."""
    return host_mesh(mesh, jax.process_index())


def processes(mesh: Mesh) -> int:
    """How many processes hold ``mesh``'s devices."""
    return len({d.process_index for d in mesh.devices.flat})


class ProcessCopy:
    """This process's copy of the models of a state on ``mesh`` (module docstring)."""

    def __init__(self, mesh: Mesh, rules: Rules = DEFAULT_RULES):
        self.rules = rules
        grid = _grid(mesh)
        self.spread = Mesh(grid, (PROCESS_AXIS, *AXES))
        self.mesh = local_mesh(mesh)
        self._reshard = {}

    def __call__(self, model: Transformer) -> Transformer:
        """``model`` (global arrays) as arrays on this process's devices; every process calls it."""
        if not distributed.multi_process():
            return model
        shardings = param_shardings(model, self.spread, self.rules)
        treedef = jax.tree.structure(model)
        if treedef not in self._reshard:
            self._reshard[treedef] = jax.jit(lambda m: m, out_shardings=shardings)
        spread = self._reshard[treedef](model)
        return jax.tree.map(
            lambda x, s: jax.make_array_from_single_device_arrays(
                x.shape, NamedSharding(self.mesh, s.spec), [a.data for a in x.addressable_shards]
            ),
            spread,
            shardings,
        )

    def view(self, state: Any) -> Any:
        """``state`` for a host stage of this process: the policy copied, the other models
        dropped, every other leaf as this process's value (replicated: the whole value)."""
        if not distributed.multi_process():
            return state
        models = ("policy", *OTHER_MODELS)
        rest = {
            f.name: jax.tree.map(_local, getattr(state, f.name))
            for f in dataclasses.fields(state)
            if f.name not in models
        }
        return state.replace(policy=self(state.policy), **dict.fromkeys(OTHER_MODELS), **rest)


def _local(x: Any) -> Any:
    """A replicated global leaf as this process's value (PRNG keys stay keys)."""
    if not distributed.is_global(x):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = distributed.to_local(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.numpy.asarray(distributed.to_local(x))


def process_rows(local: int) -> tuple[slice, int]:
    """Where this process's ``local`` rows sit among every process's (each holding as many,
    in process order, as ``relax.data.prompts`` deals them): ``(its slice, the total)``."""
    i, n = jax.process_index(), jax.process_count()
    return slice(i * local, (i + 1) * local), n * local
