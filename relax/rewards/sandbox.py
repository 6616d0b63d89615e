"""Run generated code in a sandbox: a separate, isolated, resource-limited process.

    sandbox = Sandbox(SandboxConfig(wall_s=10))
    result = sandbox.run({"main.py": code}, ["{python}", "-I", "src/main.py"], stdin="1 2\\n")
    result.stdout, result.returncode, result.timed_out

Every run gets, whatever the isolation mechanism (``relax.rewards.isolation``: bwrap, unshare or,
only when opted into, none):

- its own temporary directory (removed afterwards), under a random name in a directory of mode
  0711 that only the trainer can list; the files are under ``src/`` of the working directory,
  read-only under bwrap;
- a clean environment: ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and nothing of the trainer's;
- a user: a root trainer's program runs as ``uid``/``gid`` (``nobody``); a non-root trainer's
  keeps its uid (outside its user namespace), which is refused under none (the trainer's files
  would be in reach) unless ``allow_trainer_uid`` (``relax.rewards.isolation``, "The user");
- its memory bounded as a whole, ``memory_mb`` for all its processes and tmpfs together: a memory
  cgroup per run where the host allows one, else ``RLIMIT_NPROC`` x ``RLIMIT_AS`` kept under it
  (``relax.rewards.memory_bound``; ``describe`` says which); every sandboxed process has
  ``oom_score_adj`` 1000, so a machine out of memory loses them before the trainer. A run the
  kernel killed processes of for memory is ``memory_exceeded`` (not ``ok``; logged, counted);
- these rlimits, set by a launcher inside the sandbox just before the program starts::

      RLIMIT_CPU    cpu_s (SIGXCPU), cpu_s + 1 (SIGKILL)   RLIMIT_AS     memory_mb (cgroup), or the split's
      RLIMIT_NPROC  max_processes (or the split's)         RLIMIT_NOFILE max_open_files
      RLIMIT_FSIZE  max_file_mb (each file written)        RLIMIT_CORE   0

- a fresh session keyring and a seccomp filter (``relax.rewards.seccomp``: no ``ptrace``, no
  keyrings, no mounts or namespace calls), installed by the launcher before the program starts;
- a wall-clock deadline ``wall_s``; at the deadline, past the output cap and always at the end,
  every process below the sandbox's first one is SIGKILLed, the PID namespace's init among them
  (under bwrap and unshare its death ends every process in the namespace, whatever they did to
  their session, process group or parent-death signal), then the process group;
- output caps: at most ``max_output_bytes`` of stdout and of stderr are kept; a program that
  writes more is killed (``output_truncated``).

The sandbox bounds what a program can do, not what it claims: whatever a program reports is data,
judged outside it (``relax.rewards.judge``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from relax.choices import check_choice
from relax.rewards import cgroup, fresh_root, seccomp
from relax.rewards import isolation as iso
from relax.rewards import memory_bound as mem

logger = logging.getLogger(__name__)

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
NOBODY = 65534

# Runs inside the sandbox with the sandbox's interpreter (-I -S: no site, no user paths): set the
# limits, join a fresh session keyring and install the seccomp filter, then become the program.
_LAUNCHER = (
    seccomp.INSTALL
    + fresh_root.SETUP
    + (
        "import json, os, resource, sys\n"
        "if sys.argv[4]:\n"
        "    fresh_root(sys.argv[4])\n"
        "for name, (soft, hard) in json.loads(sys.argv[1]).items():\n"
        "    resource.setrlimit(getattr(resource, name), (soft, hard))\n"
        "install_seccomp(sys.argv[2], int(sys.argv[3]))\n"
        "os.execvp(sys.argv[5], sys.argv[5:])\n"
    )
)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Isolation and limits of one sandboxed run (module docstring).

    ``isolation``: auto (bwrap, else unshare) | bwrap | unshare | none; ``allow_unisolated``: run
    anyway where no namespace can be made (the program can then use the network: unsafe);
    ``allow_trainer_uid``: run under none although the trainer is not root, so the
    program runs as the trainer's own user and can write and delete its files (unsafe).
    ``python``: the interpreter, looked up on ``/usr/local/bin:/usr/bin:/bin`` unless a path
    (it must be executable by ``uid``: root's pyenv under ``/root`` is not).
    ``tmpfs_mb``: size of each private tmpfs (the root under unshare, ``/sandbox``, ``/tmp``, ``/dev/shm``).
    ``memory_mb`` bounds a run as a whole, by ``memory_bound``: auto (a memory cgroup per run where
    the host lets the trainer make one, else the rlimit split) | cgroup (refuse to start without
    one) | rlimit (the split); ``cgroup_parent``: the cgroup directory the runs' cgroups go in
    (a delegated cgroup v2 with no processes of its own, or a cgroup v1 memory directory; empty:
    the trainer's own cgroup). ``relax.rewards.memory_bound`` says what each bound holds.
    """

    isolation: str = "auto"
    allow_unisolated: bool = False
    allow_trainer_uid: bool = False
    python: str = "python3"
    cpu_s: int = 10
    wall_s: float = 20.0
    memory_mb: int = 1024
    max_processes: int = 32
    max_open_files: int = 64
    max_file_mb: int = 16
    max_output_bytes: int = 1 << 20
    tmpfs_mb: int = 64
    uid: int = NOBODY
    gid: int = NOBODY
    memory_bound: str = "auto"
    """How memory-mb bounds a run as a whole: auto (a memory cgroup per run where one can be
    made, else the rlimit split), cgroup (refuse without one), rlimit (the split)."""
    cgroup_parent: str = ""
    """The cgroup directory to make the runs' cgroups in (empty: the trainer's own cgroup)."""

    def __post_init__(self):
        check_choice("isolation", self.isolation, iso.ISOLATIONS)
        check_choice("memory_bound", self.memory_bound, mem.MEMORY_BOUNDS)
        for name in (
            "cpu_s",
            "memory_mb",
            "max_processes",
            "max_open_files",
            "max_file_mb",
            "max_output_bytes",
            "tmpfs_mb",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.wall_s > 0:
            raise ValueError(f"SandboxConfig.wall_s must be > 0, got {self.wall_s}")

    def rlimits(self, bound: mem.MemoryBound) -> dict[str, tuple[int, int]]:
        """The launcher's rlimits; address space and processes as ``bound`` splits them."""
        mb = 1 << 20
        return {
            "RLIMIT_CPU": (self.cpu_s, self.cpu_s + 1),
            "RLIMIT_AS": (bound.process_mb * mb,) * 2,
            "RLIMIT_NPROC": (bound.nproc_limit(),) * 2,
            "RLIMIT_NOFILE": (self.max_open_files,) * 2,
            "RLIMIT_FSIZE": (self.max_file_mb * mb,) * 2,
            "RLIMIT_CORE": (0, 0),
        }


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What a run did. ``returncode``: the program's exit status, negative for a signal (``-9``
    after a kill; bwrap's 128 + N reads as -N; unshare reports a signal as 1); ``timed_out``:
    killed at the wall-clock deadline; ``output_truncated``: killed for writing more than
    ``max_output_bytes``; ``memory_exceeded``: the kernel killed processes of the run for passing
    ``memory_mb`` (known under a cgroup; under the rlimit split an allocation past it fails in the
    program instead, ``MemoryError`` or ``ENOMEM``)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    wall_s: float
    isolation: str
    memory_exceeded: bool = False

    @property
    def ok(self) -> bool:
        return (
            self.returncode == 0
            and not self.timed_out
            and not self.output_truncated
            and not self.memory_exceeded
        )


class Sandbox:
    """Runs programs as ``SandboxConfig`` says; the isolation and the memory bound are chosen (and
    tried) on creation, so a machine that cannot isolate fails at start-up, not at the first reward.
    ``memory_exceeded_runs`` counts the runs killed for memory."""

    def __init__(self, cfg: SandboxConfig = SandboxConfig()):
        self.cfg = cfg
        self.isolation = iso.choose(cfg.isolation, cfg.uid, cfg.gid, cfg.allow_unisolated)
        iso.check_user(self.isolation, cfg.allow_trainer_uid)
        self.bound = _memory_bound(cfg, self.isolation)
        self.memory_exceeded_runs = 0
        self.python = _resolve_python(cfg.python)
        self._prefix = iso.drop_privileges(
            cfg.uid, cfg.gid
        )  # what every run starts with, found once
        if self.isolation == "bwrap":
            self._prefix += iso.bwrap_prefix(
                shutil.which("bwrap"), iso.interpreter_prefix(self.python), cfg.tmpfs_mb << 20
            )
        elif self.isolation == "unshare":
            self._prefix += iso.unshare_prefix(shutil.which("unshare"))
        if not seccomp.supported():
            raise iso.SandboxUnavailable(
                f"no seccomp filter for this machine's architecture; the sandbox "
                f"supports {', '.join(seccomp.SYSCALLS)}"
            )
        self._launch = [
            self.python,
            "-I",
            "-S",
            "-c",
            _LAUNCHER,
            json.dumps(cfg.rlimits(self.bound)),
            seccomp.filter_program().hex(),
            str(seccomp.keyctl_number()),
        ]
        self._runs = _private_parent()
        probe = self.run({"probe.py": "print(6 * 7)"}, ["{python}", "-I", "src/probe.py"])
        if probe.stdout.strip() != "42":
            raise iso.SandboxUnavailable(
                f"the sandbox ({self.isolation}; {self.bound.describe()}) could not run "
                f"{self.python}: exit {probe.returncode}, stderr {probe.stderr.strip()[:300]!r}"
            )

    def run(self, files: Mapping[str, str], argv: Sequence[str], stdin: str = "") -> SandboxResult:
        """Write ``files`` under ``src/``, run ``argv`` (``{python}`` is replaced by the interpreter)
        in the sandbox with ``stdin``, and return what it did (limits in the module docstring)."""
        with tempfile.TemporaryDirectory(prefix="run-", dir=self._runs) as work:
            work = Path(work)
            _write_files(work / "src", files)
            if (
                os.geteuid() == 0 and self.isolation != "bwrap"
            ):  # the program writes its working directory
                os.chown(work, self.cfg.uid, self.cfg.gid)
            os.chmod(work, 0o755 if self.isolation == "bwrap" else 0o700)
            t0 = time.perf_counter()
            env = _clean_env(work, self.isolation)
            group = self.bound.new_cgroup()
            try:
                out, err, code, timed_out, truncated = _execute(
                    self._command(work, argv, group), work, env, stdin, self.cfg
                )
                exceeded = group is not None and group.oom_kills() > 0
            finally:
                if group is not None and not group.close():
                    logger.warning(
                        "sandbox: could not remove %s: processes still in it", group.path
                    )
            wall = time.perf_counter() - t0
        if self.isolation == "bwrap" and code > 128:  # bwrap reports a signal as 128 + its number
            code = 128 - code
        if exceeded:
            self.memory_exceeded_runs += 1
            logger.warning(
                "sandbox: a run passed --sandbox.memory-mb %d and the kernel killed processes of "
                "it (%d such runs); it is not ok",
                self.cfg.memory_mb,
                self.memory_exceeded_runs,
            )
        return SandboxResult(
            code,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            timed_out,
            truncated,
            wall,
            self.isolation,
            exceeded,
        )

    def _command(
        self, work: Path, argv: Sequence[str], group: cgroup.RunCgroup | None = None
    ) -> list[str]:
        program = [self.python if a == "{python}" else a for a in argv]
        per_run = iso.bwrap_program(work / "src") if self.isolation == "bwrap" else []
        root = (
            fresh_root.root_plan(
                work, iso.interpreter_prefix(self.python), self.cfg.tmpfs_mb << 20, iso.SANDBOX_DIR
            )
            if self.isolation == "unshare"
            else ""
        )
        procs = None if group is None else group.procs
        return mem.shim(procs) + self._prefix + per_run + self._launch + [root] + program


def describe(cfg: SandboxConfig) -> str:
    """One line for a run's start-up report: the isolation ``cfg`` gets here, whom the program
    runs as, and which memory bound is in force (``relax.rewards.memory_bound``). Chooses both as
    ``Sandbox`` does (``SandboxUnavailable`` where it would fail) without starting a run."""
    isolation = iso.choose(cfg.isolation, cfg.uid, cfg.gid, cfg.allow_unisolated)
    bound = _memory_bound(cfg, isolation)
    user = f"uid {cfg.uid}" if os.geteuid() == 0 else f"the trainer's uid {os.geteuid()}"
    return f"sandbox: {isolation}, programs run as {user}; {bound.describe()}"


def _memory_bound(cfg: SandboxConfig, isolation: str) -> mem.MemoryBound:
    return mem.choose(
        cfg.memory_bound,
        cfg.memory_mb,
        cfg.max_processes,
        isolation,
        cfg.tmpfs_mb,
        cfg.cgroup_parent,
    )


@functools.lru_cache(maxsize=8)
def sandbox_for(cfg: SandboxConfig) -> Sandbox:
    """One ``Sandbox`` per config per process (reward workers build theirs on first use)."""
    return Sandbox(cfg)


def _resolve_python(python: str) -> str:
    found = python if os.path.isabs(python) else shutil.which(python, path=SAFE_PATH)
    if found is None or not os.access(found, os.X_OK):
        raise iso.SandboxUnavailable(
            f"sandbox interpreter {python!r} not found on {SAFE_PATH}; set "
            "SandboxConfig.python to a path the sandbox user can execute"
        )
    return found


def _write_files(src: Path, files: Mapping[str, str]) -> None:
    src.mkdir(mode=0o755)
    for name, text in files.items():
        path = (src / name).resolve()
        if src.resolve() not in path.parents:
            raise ValueError(f"sandbox file name {name!r} leaves the sandbox directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o644)


def _clean_env(work: Path, isolation: str) -> dict[str, str]:
    home = str(work) if isolation == "none" else iso.SANDBOX_DIR
    return {
        "PATH": SAFE_PATH,
        "HOME": home,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _execute(cmd: list[str], work: Path, env: dict[str, str], stdin: str, cfg: SandboxConfig):
    """Run ``cmd`` in a new session; ``(stdout, stderr, returncode, timed_out, truncated)``. The
    process group is SIGKILLed at the deadline, past the output cap, and always at the end."""
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=work,
        env=env,
        start_new_session=True,
    )
    try:
        out, err, timed_out, truncated = _pump(
            proc, stdin.encode(), time.monotonic() + cfg.wall_s, cfg.max_output_bytes
        )
    finally:
        _kill_tree(proc.pid)
        _kill_group(proc.pid)
        code = proc.wait()
    return out, err, code, timed_out, truncated


def _pump(proc: subprocess.Popen, data: bytes, deadline: float, cap: int):
    """Feed stdin and collect stdout / stderr until both close, the deadline, or the cap."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    if data:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    view, open_outputs = memoryview(data), 2
    try:
        while open_outputs:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), True, False
            for key, _ in sel.select(timeout=min(left, 0.5)):
                f = key.fileobj
                if f is proc.stdin:
                    view = _feed(sel, proc.stdin, view)
                    continue
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    sel.unregister(f)
                    open_outputs -= 1
                    continue
                bufs[f] += chunk
                if len(bufs[f]) > cap:
                    del bufs[f][cap:]
                    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), False, True
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), False, False
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()


def _feed(sel: selectors.BaseSelector, stdin, view: memoryview) -> memoryview:
    try:
        view = view[os.write(stdin.fileno(), view[:65536]) :]
    except (BrokenPipeError, OSError):  # the program closed its stdin
        view = view[:0]
    if not view:
        sel.unregister(stdin)
        stdin.close()
    return view


def _private_parent() -> str:
    """The directory that holds every run's working directory: the trainer's own, mode 0711, so
    that a program can enter its own run (whose random name it is given) but list no other."""
    parent = tempfile.mkdtemp(prefix="relax-sandbox-")
    os.chmod(parent, 0o711)
    atexit.register(shutil.rmtree, parent, ignore_errors=True)
    return parent


def _children() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` of every process, read from ``/proc/*/stat``."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _kill_tree(pid: int) -> None:
    """SIGKILL every process below ``pid``. Under bwrap and unshare that includes the PID
    namespace's first process, whose death ends every process in the namespace, whatever they did
    to their session, process group or parent-death signal."""
    kids, todo, found = _children(), [pid], []
    while todo:
        for child in kids.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    for child in found:
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
