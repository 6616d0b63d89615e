"""A memory cgroup per sandboxed run, where the host lets the trainer make one: the kernel's own
bound on everything a run holds.

    parent = find_parent()                  # CgroupUnavailable saying why not
    group = RunCgroup(parent, memory_bytes=256 << 20, max_pids=34)
    ...                                     # the run's first process joins: its pid to group.procs
    group.oom_kills()                       # processes the kernel killed for the run's memory
    group.close()                           # kills what is left, removes the cgroup

Where the cgroups go (``find_parent``):

- **cgroup v2** (the unified hierarchy), in a directory whose ``cgroup.subtree_control`` has, or
  can be given, the ``memory`` controller. cgroup v2 gives controllers to the children only of a
  cgroup with no processes of its own (the root excepted), so this is either a delegated cgroup
  kept empty for the purpose (``SandboxConfig.cgroup_parent``), or the trainer's own cgroup when
  it is the root of its hierarchy (a VM, a container with its own cgroup namespace and nothing
  else in it). Each run's cgroup: ``memory.max`` = the bound, ``memory.swap.max`` = 0,
  ``memory.oom.group`` = 1 (an OOM kill ends the whole run), ``pids.max``.
- **cgroup v1**, the ``memory`` hierarchy, under the trainer's own memory cgroup (v1 has no rule
  against processes beside child cgroups). Each run's cgroup: ``memory.limit_in_bytes`` and,
  where swap is accounted, ``memory.memsw.limit_in_bytes`` = the bound (no swap beyond it).

Either way the kernel charges to the run's cgroup what its processes use: anonymous memory, page
cache, what they write to their tmpfs (``/tmp``, ``/dev/shm``, ``/sandbox``), kernel memory; past
the bound it reclaims, then OOM-kills inside that cgroup only, so the trainer (outside it) is never
the one killed for a run's memory. A run's cgroup is named ``relax-sandbox-<random>`` and removed
after the run, every process still in it killed first (``cgroup.kill`` where the kernel has it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import signal
import time
from pathlib import Path

REMOVE_WAIT_S = 5.0  # how long ``close`` waits for the killed processes to leave the cgroup


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here (the message says where it was tried and why not)."""


@dataclasses.dataclass(frozen=True)
class Parent:
    """The directory that holds the runs' cgroups, and its hierarchy's version (1 or 2)."""

    version: int
    path: Path


def own_cgroups(proc_cgroup: str) -> dict[str, str]:
    """``{controller: path}`` from ``/proc/self/cgroup``; cgroup v2's entry is under ``""``."""
    found = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


def cgroup_mounts(mountinfo: str) -> list[tuple[int, str, str]]:
    """``(version, root, mount point)`` of the cgroup v2 mounts and the cgroup v1 ``memory``
    mounts in ``/proc/self/mountinfo`` (``root``: the cgroup the mount shows as its top)."""
    found = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            found.append((2, _unescape(fields[3]), _unescape(fields[4])))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            found.append((1, _unescape(fields[3]), _unescape(fields[4])))
    return found


def candidates(proc_cgroup: str, mountinfo: str) -> list[Parent]:
    """The trainer's own cgroup directory in each hierarchy that could bound memory, v2 first."""
    own = own_cgroups(proc_cgroup)
    found: dict[int, Parent] = {}
    for version, root, point in cgroup_mounts(mountinfo):
        path = own.get("" if version == 2 else "memory")
        if path is None or version in found:
            continue
        rel = os.path.relpath(path, root)
        if rel != ".." and not rel.startswith("../"):  # our cgroup is below what the mount shows
            found[version] = Parent(version, Path(point) / rel)
    return [found[v] for v in (2, 1) if v in found]


def find_parent(configured: str = "") -> Parent:
    """Where this trainer can make memory-bounded cgroups: ``configured`` (a cgroup directory) or
    else the trainer's own cgroup, cgroup v2 first (module docstring). Tried by making and removing
    one; ``CgroupUnavailable`` naming each place tried and why it failed."""
    if configured:
        path = Path(configured)
        if (path / "cgroup.controllers").exists():
            tried = [Parent(2, path)]
        elif (path / "memory.limit_in_bytes").exists():
            tried = [Parent(1, path)]
        else:
            raise CgroupUnavailable(
                f"{configured} is neither a cgroup v2 directory (no cgroup.controllers) nor a "
                "cgroup v1 memory one (no memory.limit_in_bytes)"
            )
    else:
        tried = candidates(_read("/proc/self/cgroup"), _read("/proc/self/mountinfo"))
        if not tried:
            raise CgroupUnavailable(
                "no cgroup v2 hierarchy and no cgroup v1 memory hierarchy mounted"
            )
    reasons = []
    for parent in tried:
        try:
            if parent.version == 2:
                _delegate_memory(parent.path)
            RunCgroup(parent, 64 << 20, 8).close()
            return parent
        except (OSError, CgroupUnavailable) as exc:
            reasons.append(f"cgroup v{parent.version} at {parent.path}: {exc}")
    raise CgroupUnavailable("; ".join(reasons))


def _delegate_memory(path: Path) -> None:
    """Give ``path``'s children the memory controller (and pids where offered), or say why not."""
    if "memory" in _read(path / "cgroup.subtree_control").split():
        return
    offered = _read(path / "cgroup.controllers").split()
    if "memory" not in offered:
        raise CgroupUnavailable(
            f"no memory controller (cgroup.controllers: {' '.join(offered) or 'none'})"
        )
    try:
        _write(path / "cgroup.subtree_control", "+memory" + (" +pids" if "pids" in offered else ""))
    except OSError as exc:
        raise CgroupUnavailable(
            f"cannot give its children the memory controller ({exc.strerror}): a cgroup v2 with "
            "processes of its own cannot; set --sandbox.cgroup-parent to a delegated, empty cgroup"
        ) from exc


class RunCgroup:
    """One run's cgroup, made with its limits set; the run's first process joins it by writing its
    pid to ``procs`` before anything of the program runs, so every process of the run is in it."""

    def __init__(self, parent: Parent, memory_bytes: int, max_pids: int):
        self.version = parent.version
        self.path = parent.path / f"relax-sandbox-{secrets.token_hex(6)}"
        self.path.mkdir()
        try:
            if self.version == 2:
                if not (self.path / "memory.max").exists():
                    raise CgroupUnavailable(
                        f"{parent.path} does not give its children the memory controller"
                    )
                _write(self.path / "memory.max", str(memory_bytes))
                self._write_if_there("memory.swap.max", 0)
                self._write_if_there("memory.oom.group", 1)
                self._write_if_there("pids.max", max_pids)
            else:
                _write(self.path / "memory.limit_in_bytes", str(memory_bytes))
                self._write_if_there("memory.memsw.limit_in_bytes", memory_bytes)
        except BaseException:
            self.path.rmdir()
            raise

    @property
    def procs(self) -> str:
        return str(self.path / "cgroup.procs")

    def oom_kills(self) -> int:
        """Processes the kernel OOM-killed in this cgroup (v1 kernels before 4.13 count no kills:
        there, 1 when the limit was hit at all)."""
        if self.version == 2:
            return _field(_read(self.path / "memory.events"), "oom_kill")
        kills = _field(_read(self.path / "memory.oom_control"), "oom_kill", default=None)
        if kills is None:
            return int(int(_read(self.path / "memory.failcnt")) > 0)
        return kills

    def close(self) -> bool:
        """Kill every process still in the cgroup and remove it; False (the cgroup left behind)
        when it still holds processes after ``REMOVE_WAIT_S``."""
        if (self.path / "cgroup.kill").exists():
            _write(self.path / "cgroup.kill", "1")
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            for pid in _read(self.path / "cgroup.procs").split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self.path.rmdir()
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)

    def _write_if_there(self, name: str, value: int) -> None:
        if (self.path / name).exists():
            _write(self.path / name, str(value))


def _field(text: str, name: str, default: int | None = 0) -> int | None:
    """The number after ``name`` in a cgroup file of ``name value`` lines."""
    found = re.search(rf"^{name} (\d+)$", text, re.MULTILINE)
    return int(found[1]) if found else default


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _read(path: str | Path) -> str:
    with open(path) as f:
        return f.read()


def _write(path: Path, text: str) -> None:
    """A cgroup file takes one write; its error (EBUSY, EINVAL, EACCES) is raised here."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
