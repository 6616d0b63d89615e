"""What bounds a sandboxed run's memory as a whole, and the first step of every run that applies it.

``RLIMIT_AS`` bounds one process's address space: alone, it lets a run of ``max_processes``
processes hold ``max_processes x memory_mb`` (32 GiB with the defaults), and a machine out of
memory may have the kernel kill the trainer. So ``memory_mb`` bounds a run as a whole, by the first
of these the host allows (``SandboxConfig.memory_bound``: auto | cgroup | rlimit):

``cgroup v2`` / ``cgroup v1``
    a memory cgroup per run (``relax.rewards.cgroup``): the kernel counts everything the run's
    processes hold (memory, the tmpfs they write, kernel memory) and, past ``memory_mb``, kills
    inside the run only. Each process still gets ``RLIMIT_AS`` = ``memory_mb`` and the run
    ``RLIMIT_NPROC`` = ``max_processes``, as before.
``rlimit split``
    where no memory cgroup can be made (the common case in containers): at most ``processes``
    processes (``RLIMIT_NPROC``) of ``process_mb`` address space each (``RLIMIT_AS``), with
    ``processes x process_mb + tmpfs x tmpfs_mb <= memory_mb``. It is a bound because a process
    holds at most its address space; threads share their process's (and count as processes);
    and the launcher sets ``RLIMIT_NPROC`` inside the run's own user namespace, where since Linux
    5.14 the kernel counts only that namespace's processes of the user (before 5.14 it counts all
    of the user's, other runs too: fewer, never more). The tmpfs mounts (``/sandbox``, ``/tmp``,
    ``/dev/shm``, and the root under unshare) are taken off the budget first; what remains is
    split into processes of ``SPLIT_PROCESS_MB`` or more (fewer processes rather than smaller
    ones: most programs are one process), e.g. 1024 MiB with 64 MiB tmpfs under bwrap: 6
    processes of 138 MiB. ``--sandbox.max-processes`` trades processes for size (2: two of 416
    MiB). Outside the bound: the isolation tool's own process (bwrap's monitor, unshare's parent:
    about 1 MiB resident each) and kernel memory (page tables, pipe buffers: bounded by
    ``max_open_files``).

A watcher that samples the run's memory and kills past the bound is not one: between two samples
a run can fault in gigabytes. Both bounds are fixed before the program's first instruction.

Every run starts with ``SHIM`` (``shim``), a ``sh`` line run as the trainer's user before any
privilege is dropped or namespace made: it sets the process's ``oom_score_adj`` to 1000, inherited
by every process of the run, so that if the machine runs out of memory the kernel kills sandboxed
processes before the trainer (a trainer holding ``CAP_SYS_RESOURCE``, root on most hosts, also
fixes 1000 as their floor; otherwise a program may lower its own back to the trainer's value,
never below); and it writes its pid to the run's ``cgroup.procs``, then ``exec``s the sandbox's
command, so the whole run is in its cgroup. If either write fails the program does not run (exit
125, the shell's message on stderr).
"""

from __future__ import annotations

import dataclasses
import shutil

from relax.rewards import cgroup
from relax.rewards.isolation import SandboxUnavailable

MEMORY_BOUNDS = ("auto", "cgroup", "rlimit")
SPLIT_PROCESS_MB = 128  # the least address space a process gets under the split, unless the budget
# is smaller (then one process gets it all): Python starts in 16 MiB; this leaves a program about
# 100 MiB of data, or a thread's 8 MiB stack and 64 MiB malloc arena
PYTHON_START_MB = 32  # the least budget the split accepts: below it the interpreter cannot start
OOM_SCORE_ADJ = 1000  # the kernel's first choice when it must kill
TMPFS_COUNT = {
    "bwrap": 3,
    "unshare": 4,
    "none": 0,
}  # private tmpfs per run (relax.rewards.isolation)
OWN_PROCESSES = {"bwrap": 0, "unshare": 1, "none": 0}  # the tool's processes in the run's namespace
SHIM = (
    f"echo {OOM_SCORE_ADJ} >/proc/self/oom_score_adj || exit 125; "
    'if [ -n "$1" ]; then echo $$ >"$1" || exit 125; fi; shift; exec "$@"'
)


@dataclasses.dataclass(frozen=True)
class MemoryBound:
    """The bound in force for a sandbox's runs (module docstring). ``processes`` and ``process_mb``:
    the program's processes (``RLIMIT_NPROC``) and each one's address space (``RLIMIT_AS``);
    ``parent``: where the runs' cgroups go (None under the split, ``why`` then says why)."""

    kind: str
    memory_mb: int
    processes: int
    process_mb: int
    mechanism: str
    tmpfs_mb: int
    parent: cgroup.Parent | None = None
    why: str = ""

    def nproc_limit(self) -> int:
        """``RLIMIT_NPROC`` as the launcher sets it: the program's processes and the tool's own
        process in the run's user namespace (unshare's parent)."""
        return self.processes + OWN_PROCESSES[self.mechanism]

    def new_cgroup(self) -> cgroup.RunCgroup | None:
        """A fresh cgroup for one run (None under the split)."""
        if self.parent is None:
            return None
        return cgroup.RunCgroup(self.parent, self.memory_mb << 20, self.nproc_limit() + 1)

    def describe(self) -> str:
        """One line for the start-up report: which bound is in force, and its figures."""
        oom = f"sandboxed processes oom_score_adj {OOM_SCORE_ADJ}"
        if self.parent is not None:
            return (
                f"memory: {self.kind}, a memory cgroup per run under {self.parent.path}: {self.memory_mb} MiB "
                f"for all its processes and tmpfs together, no swap; {oom}"
            )
        tmpfs = TMPFS_COUNT[self.mechanism]
        return (
            f"memory: rlimit split ({self.why}): at most {self.processes} processes x "
            f"{self.process_mb} MiB address space + {tmpfs} tmpfs x {self.tmpfs_mb} MiB <= "
            f"{self.memory_mb} MiB per run; {oom}"
        )


def split(memory_mb: int, max_processes: int, tmpfs: int, tmpfs_mb: int) -> tuple[int, int]:
    """``(processes, process_mb)`` of the rlimit split: ``memory_mb`` less the tmpfs, in at most
    ``max_processes`` processes of at least ``SPLIT_PROCESS_MB`` (one process if less is left)."""
    budget = memory_mb - tmpfs * tmpfs_mb
    if budget < PYTHON_START_MB:
        raise SandboxUnavailable(
            f"--sandbox.memory-mb {memory_mb} leaves {budget} MiB for the program's processes after "
            f"{tmpfs} tmpfs of --sandbox.tmpfs-mb {tmpfs_mb} (rlimit split; the interpreter needs "
            f"{PYTHON_START_MB}): raise memory-mb or lower tmpfs-mb"
        )
    processes = max(1, min(max_processes, budget // SPLIT_PROCESS_MB))
    return processes, budget // processes


def choose(
    how: str,
    memory_mb: int,
    max_processes: int,
    mechanism: str,
    tmpfs_mb: int,
    cgroup_parent: str = "",
) -> MemoryBound:
    """The bound for runs under ``mechanism``: a cgroup where ``how`` allows one and the host lets
    the trainer make it, else the rlimit split; ``SandboxUnavailable`` when ``how`` is ``cgroup``
    and none can be made."""
    why = "--sandbox.memory-bound rlimit"
    if how != "rlimit":
        try:
            parent = cgroup.find_parent(cgroup_parent)
            return MemoryBound(
                f"cgroup v{parent.version}",
                memory_mb,
                max_processes,
                memory_mb,
                mechanism,
                tmpfs_mb,
                parent,
            )
        except cgroup.CgroupUnavailable as exc:
            if how == "cgroup":
                raise SandboxUnavailable(f"no memory cgroup for the sandbox's runs: {exc}") from exc
            why = f"no memory cgroup: {exc}"
    processes, process_mb = split(memory_mb, max_processes, TMPFS_COUNT[mechanism], tmpfs_mb)
    return MemoryBound(
        "rlimit split", memory_mb, processes, process_mb, mechanism, tmpfs_mb, why=why
    )


def shim(procs: str | None) -> list[str]:
    """The command that starts every run: ``SHIM`` joining ``procs`` (a ``cgroup.procs``; None:
    no cgroup); the sandbox's command follows it."""
    sh = shutil.which("sh", path="/usr/bin:/bin")
    if sh is None:
        raise SandboxUnavailable("no `sh` on /usr/bin:/bin to start the sandbox's runs")
    return [sh, "-c", SHIM, "relax-sandbox", procs or ""]
