"""The sandbox's seccomp filter: the system calls a sandboxed program may not make.

A classic-BPF program for the kernel's ``SECCOMP_MODE_FILTER`` (``seccomp(2)``), as container
runtimes ship by default, built here with ``struct`` (no libseccomp). The sandbox's launcher
installs it (``prctl(PR_SET_NO_NEW_PRIVS)``, then ``prctl(PR_SET_SECCOMP)``) right before it
becomes the program; a filter cannot be removed, and every child inherits it.

Refused with ``EPERM``:

- ``ptrace``, ``process_vm_readv`` / ``_writev``, ``kcmp``: no reading or steering other processes
  (the sandbox's own init included, which would otherwise outlive the run on the program's behalf);
- ``keyctl``, ``add_key``, ``request_key``: no kernel keyrings (the trainer's session keyring);
- ``mount``, ``umount2``, ``pivot_root``, ``chroot``, the new mount API (``fsopen``, ``fsmount``,
  ``fspick``, ``move_mount``, ``open_tree``, ``mount_setattr``), ``unshare``, ``setns``, and ``clone``
  with any ``CLONE_NEW*`` flag: no changing or leaving the namespaces the sandbox made;
- ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_setup``, module, ``kexec``, ``reboot``,
  ``swapon``, ``acct``, ``quotactl``, ``syslog``, ``open_by_handle_at``, ``name_to_handle_at``: kernel
  attack surface no test needs.

``clone3`` answers ``ENOSYS`` (its flags sit in memory BPF cannot read), so the C library falls back
to ``clone``, whose flags it can. Another architecture's system calls (x32 on x86-64, a foreign
``AUDIT_ARCH``) kill the process.
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF opcodes
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
_RET_ERRNO = 0x00050000
_NR, _ARCH, _ARG0_LO = 0, 4, 16  # offsets in struct seccomp_data (little-endian)
_X32_BIT = 0x40000000
CLONE_NEW = (
    0x00020000
    | 0x02000000
    | 0x04000000
    | 0x08000000
    | 0x10000000
    | 0x20000000
    | 0x40000000
    | 0x00000080
)
# NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "keyctl",
    "add_key",
    "request_key",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "reboot",
    "swapon",
    "acct",
    "quotactl",
    "syslog",
    "open_by_handle_at",
    "name_to_handle_at",
)

SYSCALLS = {  # (AUDIT_ARCH, {name: number}) per machine
    "x86_64": (
        0xC000003E,
        {
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "kcmp": 312,
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
            "mount": 165,
            "umount2": 166,
            "pivot_root": 155,
            "chroot": 161,
            "fsopen": 430,
            "fsmount": 432,
            "fspick": 433,
            "move_mount": 429,
            "open_tree": 428,
            "mount_setattr": 442,
            "unshare": 272,
            "setns": 308,
            "bpf": 321,
            "perf_event_open": 298,
            "userfaultfd": 323,
            "io_uring_setup": 425,
            "init_module": 175,
            "finit_module": 313,
            "delete_module": 176,
            "kexec_load": 246,
            "reboot": 169,
            "swapon": 167,
            "acct": 163,
            "quotactl": 179,
            "syslog": 103,
            "open_by_handle_at": 304,
            "name_to_handle_at": 303,
            "clone": 56,
            "clone3": 435,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "kcmp": 272,
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
            "mount": 40,
            "umount2": 39,
            "pivot_root": 41,
            "chroot": 51,
            "fsopen": 430,
            "fsmount": 432,
            "fspick": 433,
            "move_mount": 429,
            "open_tree": 428,
            "mount_setattr": 442,
            "unshare": 97,
            "setns": 268,
            "bpf": 280,
            "perf_event_open": 241,
            "userfaultfd": 282,
            "io_uring_setup": 425,
            "init_module": 105,
            "finit_module": 273,
            "delete_module": 106,
            "kexec_load": 104,
            "reboot": 142,
            "swapon": 224,
            "acct": 89,
            "quotactl": 60,
            "syslog": 116,
            "open_by_handle_at": 265,
            "name_to_handle_at": 264,
            "clone": 220,
            "clone3": 435,
        },
    ),
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def supported(machine: str | None = None) -> bool:
    return (machine or platform.machine()) in SYSCALLS


def filter_program(machine: str | None = None) -> bytes:
    """The filter's instructions (``struct sock_filter[]``) for ``machine`` (default: this one);
    ``ValueError`` on an architecture without a syscall table here."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise ValueError(f"no seccomp syscall table for {machine!r} (have {', '.join(SYSCALLS)})")
    arch, nr = SYSCALLS[machine]
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    prog = [
        _insn(_LD_W_ABS, 0, 0, _ARCH),
        _insn(_JEQ_K, 1, 0, arch),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _NR),
    ]
    if machine == "x86_64":
        prog += [_insn(_JSET_K, 0, 1, _X32_BIT), _insn(_RET_K, 0, 0, _RET_KILL_PROCESS)]
    for name in DENIED:
        prog += [_insn(_JEQ_K, 0, 1, nr[name]), _insn(_RET_K, 0, 0, eperm)]
    prog += [_insn(_JEQ_K, 0, 1, nr["clone3"]), _insn(_RET_K, 0, 0, enosys)]
    # clone: refuse namespace flags (its first argument's low 32 bits), allow the rest
    prog += [
        _insn(_JEQ_K, 0, 3, nr["clone"]),
        _insn(_LD_W_ABS, 0, 0, _ARG0_LO),
        _insn(_JSET_K, 0, 1, CLONE_NEW),
        _insn(_RET_K, 0, 0, eperm),
    ]
    prog += [_insn(_RET_K, 0, 0, _RET_ALLOW)]
    return b"".join(prog)


# Run by the sandbox's launcher (``-I -S``: the standard library only) with the filter as hex:
# a fresh session keyring first (keyctl is refused after), then no_new_privs and the filter.
INSTALL = r"""
def install_seccomp(hex_program, keyctl_nr):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(keyctl_nr, 1, 0)  # KEYCTL_JOIN_SESSION_KEYRING, anonymous: the trainer's is left
    prog = bytes.fromhex(hex_program)
    buf = ctypes.create_string_buffer(prog, len(prog))
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Fprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP failed")
"""


def keyctl_number(machine: str | None = None) -> int:
    return SYSCALLS[machine or platform.machine()][1]["keyctl"]
