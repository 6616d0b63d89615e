"""Multi-host runs: ``initialize`` and the host <-> global array boundary.

Every process of a multi-host run (a TPU pod slice, a GPU cluster, or local CPU processes in
tests) runs the SAME program. ``initialize`` connects them through ``jax.distributed``; after it
``jax.devices()`` lists every device of every process and a ``jax.sharding.Mesh`` over them is
global. Then:

- data: each process reads its own contiguous slice of the global prompt batch
  (``relax.data.prompts`` slices by ``jax.process_index()``) and ``to_global`` assembles the global
  array with ``jax.make_array_from_process_local_data``; host code (reward functions, decoding)
  sees its process's rows only (``to_local``).
- checkpoints: every process calls ``Checkpointer.save`` / ``restore`` (orbax writes each
  process's shards and commits once), on a file system all hosts share (GCS, NFS).
- logging: only process 0 writes (``relax.train.logs.is_main_process``).

Where the coordinator comes from, first match wins:

1. arguments / flags (``coordinator_address``, ``num_processes``, ``process_id``);
2. environment: ``RELAX_COORDINATOR`` (``host:port``), ``RELAX_NUM_PROCESSES``,
   ``RELAX_PROCESS_ID``;
3. nothing given: ``jax.distributed.initialize()`` auto-detects the cluster (TPU VMs, SLURM,
   Open MPI, Kubernetes). This is only attempted when asked for (``auto=True``), since on a
   plain machine there is nothing to detect.

A coordinator that cannot be reached fails after ``timeout_s`` with an error naming the address
and the process, instead of hanging: non-coordinator processes first poll the coordinator's TCP
port (jax's own client aborts the process when its connect deadline passes), then jax's
``initialization_timeout`` bounds the rest of the handshake.

On CPU, cross-process collectives go through gloo (``jax_cpu_collectives_implementation``,
set here before the backend starts). ``barrier`` waits on the coordination service instead of
a collective, so it outlasts gloo's 30 s wait for a late peer.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
import time
from typing import Any

import jax
import numpy as np

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "RELAX_COORDINATOR",
    "RELAX_NUM_PROCESSES",
    "RELAX_PROCESS_ID",
)
_initialized = False


class CoordinatorError(RuntimeError):
    """The coordinator could not be reached (or the handshake did not finish) in time."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float, *, process_id: int | None = None) -> None:
    """Poll ``address`` (host:port) until it accepts a TCP connection; ``CoordinatorError`` after
    ``timeout_s`` seconds."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(timeout_s, 0.1))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            who = "" if process_id is None else f"process {process_id}: "
            raise CoordinatorError(
                f"{who}cannot reach the jax.distributed coordinator at {address} within {timeout_s:g}s "
                f"({last}). Is process 0 running, is the address/port right ({ENV_COORDINATOR} or "
                f"--parallel.coordinator), and is the port open between hosts?"
            )
        time.sleep(0.2)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Any = None,
    timeout_s: float = 300.0,
    auto: bool = False,
) -> bool:
    """Join a multi-process run; returns True if ``jax.distributed`` was initialised.

    Arguments override ``RELAX_COORDINATOR`` / ``RELAX_NUM_PROCESSES`` / ``RELAX_PROCESS_ID``.
    With neither, ``auto=True`` lets jax detect the cluster (TPU VM, SLURM, ...) and
    ``auto=False`` does nothing (a single-process run). Must run before anything touches a jax
    device. Calling it again is a no-op.
    """
    global _initialized
    if _initialized:
        return True
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if coordinator_address is None and num_processes is None and process_id is None and not auto:
        return False
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if coordinator_address is not None:
        if num_processes is None or process_id is None:
            raise ValueError(
                f"coordinator {coordinator_address} given without num_processes/process_id "
                f"(flags or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})"
            )
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(
                f"process_id={process_id} is not in [0, num_processes={num_processes})"
            )
        _split_address(coordinator_address)
        if process_id != 0:  # process 0 hosts the coordinator service itself
            wait_for_coordinator(coordinator_address, timeout_s, process_id=process_id)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU cross-process collectives
    # jax's client ABORTS the process (DEADLINE_EXCEEDED) when the peers do not all register in
    # time; say first what was being waited for, so that the log explains the abort.
    where = (
        "auto-detected cluster"
        if coordinator_address is None
        else f"coordinator {coordinator_address}"
    )
    print(
        f"relax: joining {num_processes if num_processes is not None else '?'} processes through {where} as "
        f"process {process_id if process_id is not None else '?'} (waiting up to {timeout_s:g}s for all of "
        f"them)",
        file=sys.stderr,
        flush=True,
    )
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=max(int(np.ceil(timeout_s)), 1),
        )
    except Exception as e:  # jax's messages do not say which address / process
        raise CoordinatorError(
            f"jax.distributed.initialize(coordinator={coordinator_address}, "
            f"num_processes={num_processes}, process_id={process_id}) failed "
            f"within {timeout_s:g}s: {e}"
        ) from e
    _initialized = True
    return True


def multi_process() -> bool:
    return jax.process_count() > 1


def max_over_processes(value: int) -> int:
    """The largest of every process's ``value`` (this process's own with one process)."""
    if not multi_process():
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


BARRIER_TIMEOUT_S = 3600
_barriers = itertools.count()  # every process calls the barriers in the same order


def barrier(name: str) -> None:
    """Every process waits here until all have arrived, for up to ``BARRIER_TIMEOUT_S`` (a no-op
    on one process). It is the coordination service's barrier (orbax's ``get_barrier_sync_fn``), not a
    device collective: on CPU a collective whose peer is more than 30 s late fails (gloo's
    context set-up), where a process that compiled more slowly than the others is waited for
    here."""
    if multi_process():
        from orbax.checkpoint import multihost

        key = f"relax-{name}-{next(_barriers)}"
        multihost.get_barrier_sync_fn()(key=key, timeout_ms=BARRIER_TIMEOUT_S * 1000)


def all_rows(x: np.ndarray) -> np.ndarray:
    """Every process's rows ``x`` (leading axes may differ in length), concatenated in process
    order (every process calls this; one process: ``x``)."""
    x = np.asarray(x)
    if not multi_process():
        return x
    from jax.experimental import multihost_utils

    sizes = multihost_utils.process_allgather(np.int64(x.shape[0]))
    padded = np.zeros((int(sizes.max()),) + x.shape[1:], x.dtype)
    padded[: x.shape[0]] = x
    rows = multihost_utils.process_allgather(padded)
    return np.concatenate([row[:size] for row, size in zip(rows, sizes)])


def all_arrays(x: np.ndarray) -> list[np.ndarray]:
    """Every process's array ``x`` (of any shape, up to 8 axes; one dtype on all), in process
    order (every process calls this; one process: ``[x]``)."""
    x = np.ascontiguousarray(x)
    if not multi_process():
        return [x]
    if x.ndim > 8:
        raise ValueError(f"all_arrays takes arrays of up to 8 axes, got {x.shape}")
    header = np.zeros((1, 9), np.int64)
    header[0, 0], header[0, 1 : 1 + x.ndim] = x.ndim, x.shape
    headers, flat = all_rows(header), all_rows(x.reshape(-1))
    out, at = [], 0
    for h in headers:
        shape = tuple(int(d) for d in h[1 : 1 + h[0]])
        size = int(np.prod(shape, dtype=np.int64))
        out.append(flat[at : at + size].reshape(shape))
        at += size
    return out


def is_global(x: Any) -> bool:
    """True for a jax.Array laid out over the run's devices (on several processes, one that is not
    fully addressable); host values and single-process arrays are "local"."""
    return isinstance(x, jax.Array) and (not multi_process() or not x.is_fully_addressable)


def to_global(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array with ``sharding`` from this process's part ``x`` (its rows of the batch axis
    for a batch sharding, the whole value for a replicated one). A global array is resharded."""
    if isinstance(x, jax.Array) and (is_global(x) or not multi_process()):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return laid_out_as(x, sharding)
        return jax.device_put(x, sharding)
    if not multi_process():
        return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def laid_out_as(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` under ``sharding``, a layout equivalent to its own: the same buffers, no copy and no
    program, so that a jitted call sees one spelling of each argument's sharding (the rule's, not
    the compiler's) and finds the program compiled for it (``relax.train.ahead``)."""
    if x.sharding == sharding:
        return x
    shards = [s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def put(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` that also works across processes for host values:
    there every process must hold the SAME full value of each leaf (e.g. a model loaded or
    initialised identically everywhere) and builds its own shards from it."""
    if not multi_process():
        return jax.device_put(tree, shardings)

    def leaf(x, sharding):
        if is_global(x):
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x))
            global_data = jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx])
            return jax.random.wrap_key_data(global_data, impl=jax.random.key_impl(x))
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

    return jax.tree.map(leaf, tree, shardings)


def to_local(x: Any) -> np.ndarray:
    """This process's rows of a batch-sharded global array (the whole value if replicated), as
    numpy. Assumes only the leading axis is sharded (the batch layout of ``relax.parallel``)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    pieces: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        if start not in pieces:  # copy each row block once (other axes hold duplicates of it)
            pieces[start] = np.asarray(shard.data)
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=0)


def on_host_memory(enabled: bool):
    """Load / initialise the model in host memory when it is going to be sharded anyway (so a
    model larger than one accelerator never lands whole on device 0)."""
    if enabled and jax.devices()[0].platform != "cpu":
        try:
            return jax.default_device(jax.devices("cpu")[0])
        except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
            pass
    return contextlib.nullcontext()
