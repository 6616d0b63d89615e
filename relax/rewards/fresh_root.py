"""A fresh root file system for the ``unshare`` mechanism: what bubblewrap builds, built by the
sandbox's launcher inside util-linux ``unshare``'s new user and mount namespaces.

``unshare --user --map-root-user --mount --pid --fork ...`` starts the launcher as root of its own
user namespace (``nobody`` or the trainer outside), with a private copy of the host's mounts.
``SETUP`` then, before anything of the program runs:

1. makes every mount private (nothing propagates back to the host);
2. mounts a size-capped tmpfs as the new root, inside the run's directory, and binds into it,
   read-only: ``/usr``, the ``/bin`` ``/lib*`` ``/sbin`` directories (symlinks where ``/usr`` is
   merged), the interpreter's prefix and the program (``/sandbox/src``); a fresh ``/proc`` of the
   run's PID namespace; ``/dev`` with only ``null``, ``zero``, ``full``, ``random``, ``urandom``;
   private size-capped tmpfs at ``/sandbox`` (the working directory), ``/tmp`` and ``/dev/shm``;
3. ``chroot``s into it and drops every capability from the bounding set (the program, uid 0 of
   the namespace, then execs with none).

The host's other files (home directories, the repository, the dataset, other runs, ``/etc``,
host sockets, the host's ``/tmp``, ``/var/tmp`` and ``/dev/shm``) are not in it. The seccomp
filter installed next (``relax.rewards.seccomp``) refuses ``mount``, ``umount2``, ``chroot``,
``pivot_root``, ``unshare`` and ``setns``, so none of this can be undone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEV_NODES = ("null", "zero", "full", "random", "urandom")


def root_plan(work: Path, interpreter_prefix: str, tmpfs_bytes: int, sandbox_dir: str) -> str:
    """The JSON ``SETUP`` reads: where the new root goes, what is bound into it, and the sizes."""
    top = []
    for name in ("bin", "lib", "lib32", "lib64", "sbin"):
        path = Path(f"/{name}")
        if path.is_symlink():
            top.append(["symlink", os.readlink(path), f"/{name}"])
        elif path.is_dir():
            top.append(["bind", f"/{name}", f"/{name}"])
    binds = [["bind", "/usr", "/usr"], *top]
    if not interpreter_prefix.startswith("/usr/"):
        binds.append(["bind", interpreter_prefix, interpreter_prefix])
    return json.dumps(
        {
            "root": str(work / "root"),
            "src": str(work / "src"),
            "binds": binds,
            "size": tmpfs_bytes,
            "sandbox": sandbox_dir,
            "dev": list(DEV_NODES),
        }
    )


# Run by the launcher (``-I -S``: the standard library only) as root of the new user namespace.
SETUP = r"""
def fresh_root(plan_json):
    import ctypes, json, os
    plan = json.loads(plan_json)
    libc = ctypes.CDLL(None, use_errno=True)
    RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()
        if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
            raise OSError(ctypes.get_errno(), "mount %s on %s failed" % (src, dst))
    def bind_ro(src, dst):
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
        mount(src, dst, None, BIND | REC)
        st = os.statvfs(src)  # a remount must keep the flags the host locked on that mount
        keep = st.f_flag & (NOSUID | NODEV | NOEXEC)
        keep |= (1024 if st.f_flag & 1024 else 0) | (2048 if st.f_flag & 2048 else 0)
        keep |= (1 << 21) if st.f_flag & 4096 else 0  # ST_RELATIME -> MS_RELATIME
        mount(None, dst, None, REMOUNT | BIND | RDONLY | keep)
    def tmpfs(dst, size):
        os.makedirs(dst, exist_ok=True)
        mount("tmpfs", dst, "tmpfs", NOSUID | NODEV, "size=%d,mode=1777" % size)
    mount(None, "/", None, REC | PRIVATE)
    root, size = plan["root"], plan["size"]
    os.makedirs(root, exist_ok=True)
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=%d,mode=0755" % size)
    for kind, src, dst in plan["binds"]:
        if kind == "symlink":
            os.symlink(src, root + dst)
        else:
            bind_ro(src, root + dst)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    os.makedirs(root + "/dev")
    for node in plan["dev"]:
        if os.path.exists("/dev/" + node):
            os.close(os.open(root + "/dev/" + node, os.O_CREAT | os.O_WRONLY, 0o666))
            mount("/dev/" + node, root + "/dev/" + node, None, BIND)
    for d in ("/tmp", "/dev/shm", plan["sandbox"]):
        tmpfs(root + d, size)
    os.chmod(root + plan["sandbox"], 0o755)
    bind_ro(plan["src"], root + plan["sandbox"] + "/src")
    os.chroot(root)
    os.chdir(plan["sandbox"])
    for cap in range(64):  # PR_CAPBSET_DROP: nothing left to regain at exec
        libc.prctl(24, cap, 0, 0, 0)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
"""
