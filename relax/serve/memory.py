"""What a request would need in memory, against what the service's devices have free.

    free, where, split = free_bytes(devices, memory_mb=None)
    floor = fb_bytes(config, sequences=8, length=512, trained=adapter_bytes, itemsize=2)
    check_fits("batch", floor, devices, None, "forward_backward")     # RequestError 413 if not

Free memory: a device that reports it (``device.memory_stats()``: GPU, TPU) has
``bytes_limit - bytes_in_use`` (with ``--limits.memory-mb`` as a lower limit); the host (CPU
devices) has the least of ``MemAvailable`` (``/proc/meminfo``), the process's cgroup headroom
(v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes - memory.usage_in_bytes``, page
cache counted free, every ancestor's limit too), ``RLIMIT_AS`` minus the address space in use,
and ``--limits.memory-mb`` minus the process's resident size. On several devices the least of
them counts, against the request's need divided over them.

A request is measured twice before it runs. Before anything is compiled, against a floor of
what it must need, in bytes, from the model's config (``L`` layers, width ``D``, MLP width
``F``, ``K`` key/value heads of size ``d``, vocabulary ``V``, ``b`` bytes per value):

- a session: ``(6 + samplers_kept) * A``, ``A`` the bytes of what it trains (its adapters, a
  value head; rank 0: the whole model): the weights, two Adam moments, the pending gradients,
  the step's new weights and moments before the old ones are freed, and a snapshot each;
- a forward_backward over ``S`` sequences of ``T`` positions (padded):
  ``S T (L (2 D + F) b + 4 V) + 2 A``: each layer's input and MLP activation kept for the
  backward, the float32 logits, the gradients and their sum into the pending ones;
- a sample request of ``P`` prompts of ``Lp`` tokens, ``G`` completions of ``N`` new tokens:
  ``W + 2 L K d b (P Lp + P G N) + 4 P G V``: the merged per-rollout copy of the weights ``W``,
  the KV caches (prompts once, completions each), a decode step's float32 logits.

Then, once its program is compiled (``relax.serve.programs``), against what XLA's buffer
assignment says the program allocates (``memory_analysis``: temporaries and outputs) plus the
host arrays it copies in: the exact figure, attention scores and adapter activations included,
which the floor leaves out. A request is refused (413 naming ``--limits.memory-mb``) when either
is over ``SAFETY`` of the free memory: the rest is left for what neither counts (the host's
copies of results, the allocator's slack).
"""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path
from typing import Any

import jax

from relax.serve.wire import RequestError

__all__ = [
    "SAFETY",
    "check_fits",
    "fb_bytes",
    "free_bytes",
    "sample_bytes",
    "session_bytes",
    "tree_bytes",
]

SAFETY = 0.9
MIB = 1 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup")


def tree_bytes(tree: Any) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) leaf of ``tree``."""
    return sum(
        math.prod(x.shape) * x.dtype.itemsize
        for x in jax.tree.leaves(tree)
        if hasattr(x, "shape") and hasattr(x, "dtype")
    )


def session_bytes(trained: int, samplers_kept: int) -> int:
    """A new session's bytes, ``trained`` the bytes it trains (module docstring)."""
    return (6 + samplers_kept) * trained


def fb_bytes(c, sequences: int, length: int, trained: int, itemsize: int) -> int:
    """The floor of a forward(_backward) over ``sequences`` of ``length`` (module docstring)."""
    per_token = c.num_layers * (2 * c.hidden_size + c.intermediate_size) * itemsize
    return sequences * length * (per_token + 4 * c.vocab_size) + 2 * trained


def sample_bytes(
    c, weights: int, prompts: int, prompt_len: int, samples: int, new: int, itemsize: int
) -> int:
    """The floor of a sample request, ``weights`` the sampling model's bytes (module docstring)."""
    rows = prompts * samples
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize
    return weights + kv * (prompts * prompt_len + rows * new) + 4 * rows * c.vocab_size


# ---------------------------------------------------------------------------------- free memory


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs(root: Path, cgroups: Path) -> list[tuple[Path, str, str, str]]:
    """``(directory, limit file, usage file, inactive-file stat)`` of the process's memory cgroup
    and each ancestor (v2 and v1), from ``cgroups`` (``/proc/self/cgroup``)."""
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = root / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = Path(path).parts[1:]
        for i in range(len(parts), -1, -1):
            out.append((base.joinpath(*parts[:i]), *files))
    return out


def cgroup_free(root: Path = CGROUP_ROOT, cgroups: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least headroom of the process's memory cgroup and its ancestors (None: no limit)."""
    free = None
    for d, limit_file, usage_file, inactive in _cgroup_dirs(root, cgroups):
        limit, usage = _read_int(d / limit_file), _read_int(d / usage_file)
        if limit is None or usage is None or limit >= 1 << 60:  # v1 writes "no limit" as ~2**63
            continue
        headroom = limit - usage + _stat(d / "memory.stat", inactive)
        free = headroom if free is None else min(free, headroom)
    return free


def _proc_kib(path: str, key: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_free(memory_mb: int | None) -> tuple[int, str]:
    """The host's free bytes for this process (module docstring) and what bounds them."""
    bounds = []
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        bounds.append((available, "the host's available memory"))
    cgroup = cgroup_free()
    if cgroup is not None:
        bounds.append((cgroup, "the process's memory cgroup"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    size = _proc_kib("/proc/self/status", "VmSize")
    if soft != resource.RLIM_INFINITY and size is not None:
        bounds.append((soft - size, "RLIMIT_AS"))
    rss = _proc_kib("/proc/self/status", "VmRSS")
    if memory_mb is not None:
        bounds.append((memory_mb * MIB - (rss or 0), f"--limits.memory-mb {memory_mb}"))
    if not bounds:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the host"
    return min(bounds)


def free_bytes(devices: list, memory_mb: int | None) -> tuple[int, str, int]:
    """The least free bytes over ``devices``, what bounds them, and over how many devices a
    request's need is split (1 on CPU devices, which share the host's memory)."""
    out = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return (*host_free(memory_mb), 1)
        limit = stats["bytes_limit"]
        if memory_mb is not None:
            limit = min(limit, memory_mb * MIB)
        out.append((limit - stats.get("bytes_in_use", 0), f"device {d}"))
    return (*min(out), len(out))


def check_fits(field: str, need: int, devices: list, memory_mb: int | None, what: str) -> None:
    """Refuse (413) a request whose ``need`` (``what`` needs it, and by whose count) is over
    ``SAFETY`` of the free memory of ``devices`` (the need split over them)."""
    free, where, split = free_bytes(devices, memory_mb)
    share = -(-need // split)
    if share > SAFETY * free:
        raise RequestError(
            field,
            f"{what} needs {share / MIB:,.0f} MiB per device and {max(free, 0) / MIB:,.0f} MiB "
            f"are free ({where}); at most {SAFETY:.0%} of it is given to one request "
            "(--limits.memory-mb bounds what the service uses): send less at once",
            status=413,
        )
