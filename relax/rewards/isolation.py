"""How the sandbox isolates a program: the command prefix of each mechanism, and which one runs.

Three mechanisms, strongest first (``relax.rewards.sandbox`` picks with ``isolation="auto"``):

``bwrap``    bubblewrap (the sandbox of Flatpak): new user, PID, network, IPC, UTS and cgroup
             namespaces; a fresh root file system holding only ``/usr`` (read-only), the
             interpreter's prefix (read-only), the program (read-only, ``/sandbox/src``) and
             size-capped private tmpfs at ``/sandbox`` (the working directory), ``/tmp`` and
             ``/dev/shm``; no home, no ``/etc``, no ``/work``; every capability dropped; no
             nested user namespaces; a new session (no terminal); the program is the PID
             namespace's first process (``--as-pid-1``: no bwrap process in there to steer).
``unshare``  util-linux ``unshare``: new user, mount, PID, network, IPC and UTS namespaces, in
             which the launcher builds the same root as bwrap's (``relax.rewards.fresh_root``:
             ``/usr`` and the interpreter read-only, the program read-only, private size-capped
             tmpfs at ``/sandbox``, ``/tmp``, ``/dev/shm``, a fresh ``/proc``, five ``/dev`` nodes),
             ``chroot``s into it and drops every capability. For machines without bubblewrap.
``none``     no namespace: rlimits, a clean environment and the process-group kill only. The
             program can reach the network and the file system of its user; refused unless the
             caller opts out explicitly (``SandboxConfig.allow_unisolated``).

Under both namespace mechanisms the launcher joins a fresh session keyring and installs
``relax.rewards.seccomp``'s filter (no ptrace, keyrings, mounts, namespace calls) before it
becomes the program, and at the end of a run the sandbox SIGKILLs every process below the one it
started, the PID namespace's first process among them: the kernel then ends every process in the
namespace, whatever it did to its session, process group or parent-death signal.

The user: a trainer started as root runs the program as ``SandboxConfig.uid`` (``nobody``),
switching with util-linux ``setpriv`` before anything else (the kernel never applies
``RLIMIT_NPROC``, the fork-bomb limit, to root). A trainer that is not root cannot switch users:
the program keeps the trainer's uid outside its user namespace. Under ``bwrap`` and ``unshare``
it then reaches none of the trainer's files (they are not mounted) nor processes (PID namespace,
seccomp); under ``none`` it would read, write and delete whatever the trainer can ($HOME, the
repository, the run directory), so ``check_user`` refuses that unless
``SandboxConfig.allow_trainer_uid`` accepts it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

ISOLATIONS = ("auto", "bwrap", "unshare", "none")
SANDBOX_DIR = "/sandbox"  # the working directory inside bwrap; the program is under SANDBOX_DIR/src


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot run on this machine (the message says what is missing)."""


def drop_privileges(uid: int, gid: int) -> list[str]:
    """``setpriv`` to ``uid``/``gid`` with no supplementary groups when running as root, else nothing."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxUnavailable(
            "running as root needs util-linux `setpriv` to drop to an unprivileged user "
            "(the kernel does not limit root's processes)"
        )
    return [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]


def runs_as_trainer(mechanism: str) -> bool:
    """Whether ``mechanism`` would run the program as the trainer's own user with the trainer's
    files in reach: the trainer is not root (no user to drop to) and the host file system is
    visible (``none``; bwrap and unshare mount none of it)."""
    return os.geteuid() != 0 and mechanism == "none"


def check_user(mechanism: str, allow_trainer_uid: bool) -> None:
    """Raise ``SandboxUnavailable`` when ``runs_as_trainer(mechanism)`` and it is not accepted."""
    if runs_as_trainer(mechanism) and not allow_trainer_uid:
        raise SandboxUnavailable(
            f"the sandbox ({mechanism}) would run generated code as the trainer's own user (uid {os.geteuid()}: "
            "not root, so there is no unprivileged user to switch to) with the host's file system in reach: it "
            "could read, write and delete whatever this user can ($HOME, the repository, the run directory). "
            "Use bubblewrap or unshare (the code then sees none of these files), run the "
            "trainer as root (the code then runs as `nobody`), or accept it with allow_trainer_uid=True "
            "(--sandbox.allow-trainer-uid)"
        )


def bwrap_prefix(bwrap: str, interpreter_prefix: str, tmpfs_bytes: int) -> list[str]:
    """bubblewrap's arguments: namespaces, the minimal root file system, capped tmpfs (module doc);
    a run adds the binding of its program (``bwrap_program``)."""
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for name in ("bin", "lib", "lib32", "lib64", "sbin"):
        if Path(f"/{name}").is_symlink():  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
        elif Path(f"/{name}").is_dir():
            args += ["--ro-bind", f"/{name}", f"/{name}"]
    if not interpreter_prefix.startswith("/usr/"):
        args += ["--ro-bind", interpreter_prefix, interpreter_prefix]
    args += ["--proc", "/proc", "--dev", "/dev"]
    for mount in ("/tmp", "/dev/shm", SANDBOX_DIR):
        args += ["--size", str(tmpfs_bytes), "--tmpfs", mount]
    return args


def bwrap_program(src: Path) -> list[str]:
    """One run's program directory, read-only at ``SANDBOX_DIR/src``, and the working directory."""
    return ["--ro-bind", str(src), f"{SANDBOX_DIR}/src", "--chdir", SANDBOX_DIR, "--"]


def unshare_prefix(unshare: str) -> list[str]:
    """util-linux ``unshare``'s arguments: user, mount, PID, network, IPC and UTS namespaces (the
    launcher then builds the root, ``relax.rewards.fresh_root``); the namespace's first process is
    killed when ``unshare`` dies, and the namespace with it."""
    return [
        unshare,
        "--user",
        "--map-root-user",
        "--mount",
        "--net",
        "--pid",
        "--fork",
        "--kill-child",
        "--ipc",
        "--uts",
        "--",
    ]


def interpreter_prefix(python: str) -> str:
    """The installation prefix that holds ``python`` (bound read-only into a bwrap sandbox)."""
    real = Path(python).resolve()
    return str(real.parent.parent)


@functools.cache
def works(mechanism: str, uid: int, gid: int) -> str | None:
    """None when ``mechanism`` (bwrap | unshare) can start a process here, else why not.

    Tried once per process with ``true`` (cached): user namespaces may be disabled by the kernel
    (``user.max_user_namespaces = 0``, Debian's ``kernel.unprivileged_userns_clone = 0``), by
    AppArmor (Ubuntu 24.04) or by a container's seccomp profile."""
    exe = shutil.which(mechanism)
    if exe is None:
        return f"`{mechanism}` is not installed"
    true = shutil.which("true") or "/bin/true"
    if mechanism == "bwrap":
        cmd = [
            exe,
            "--unshare-all",
            "--unshare-user",
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            true,
        ]
    else:
        cmd = unshare_prefix(exe) + [true]
    try:
        cmd = drop_privileges(uid, gid) + cmd
        done = subprocess.run(cmd, capture_output=True, timeout=30, env={}, cwd="/")
    except (OSError, subprocess.TimeoutExpired, SandboxUnavailable) as exc:
        return f"`{mechanism}` failed to start: {exc}"
    if done.returncode != 0:
        return f"`{mechanism}` failed: {done.stderr.decode(errors='replace').strip()[:300]}"
    return None


def choose(isolation: str, uid: int, gid: int, allow_unisolated: bool) -> str:
    """The mechanism to use: ``isolation`` itself if it works, or for ``auto`` the strongest that
    works; ``SandboxUnavailable`` naming what failed otherwise (``none`` needs ``allow_unisolated``)."""
    if isolation == "none" or (isolation == "auto" and sys.platform != "linux"):
        if not allow_unisolated:
            raise SandboxUnavailable(
                "no namespace isolation: generated code would reach the network and the files of its user. "
                "Set allow_unisolated=True (--sandbox.allow-unisolated) to run it anyway"
            )
        return "none"
    tried = ("bwrap", "unshare") if isolation == "auto" else (isolation,)
    why = {m: works(m, uid, gid) for m in tried}
    for mechanism in tried:
        if why[mechanism] is None:
            return mechanism
    if allow_unisolated and isolation == "auto":
        return "none"
    reasons = "; ".join(f"{m}: {r}" for m, r in why.items())
    raise SandboxUnavailable(
        f"cannot isolate generated code ({reasons}). Install bubblewrap (`apt-get install bubblewrap`) or allow "
        "user namespaces; or set allow_unisolated=True to run without a network namespace (unsafe)"
    )
