"""Free memory on the devices a program runs on: what the trainers' start-up check
(``relax.train.fits``) and the service's request limits (``relax.serve.memory``) compare a
program's need against.

A device that reports its memory (``device.memory_stats()``: GPU, TPU) has ``bytes_limit -
bytes_in_use`` free (``memory_mb``, a caller's limit, as a lower ``bytes_limit``). CPU devices
share the host's memory: the least of ``MemAvailable`` (``/proc/meminfo``), the process's cgroup
headroom (v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes -
memory.usage_in_bytes``, page cache counted free, every ancestor's limit too), ``RLIMIT_AS``
minus the address space in use, and ``memory_mb`` minus the process's resident size.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

MIB = 1 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup")


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
        bounds.append((memory_mb * MIB - (rss or 0), f"a limit of {memory_mb} MiB"))
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
