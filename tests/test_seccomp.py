"""relax.rewards.seccomp: the filter, installed in a fresh interpreter, refuses what it lists and
leaves what ordinary programs do (fork, threads, subprocesses, files) alone."""

import platform
import struct
import subprocess
import sys

import pytest

from relax.rewards import seccomp

pytestmark = pytest.mark.skipif(
    not seccomp.supported() or sys.platform != "linux", reason="Linux x86-64 / arm64"
)

PROGRAM = """
import ctypes, errno, os, subprocess, threading
ns = {}
exec(INSTALL, ns)
ns["install_seccomp"](HEX, KEYCTL)
libc = ctypes.CDLL(None, use_errno=True)
def err(ret):
    return "ok" if ret >= 0 else errno.errorcode[ctypes.get_errno()]
print("ptrace", err(libc.ptrace(16, os.getppid(), 0, 0)))
print("unshare", err(libc.unshare(0x00020000)))
print("keyctl", err(libc.syscall(KEYCTL, 0, -3, 0)))
print("mount", err(libc.mount(b"none", b"/", b"tmpfs", 0, None)))
print("chroot", err(libc.chroot(b"/")))
t = threading.Thread(target=lambda: print("thread", "ok"))
t.start(); t.join()
print("subprocess", "ok" if subprocess.run(["true"]).returncode == 0 else "failed")
print("fork", "ok" if os.waitpid(os.fork() or os._exit(0), 0) else "failed")
print("file", "ok" if open("/proc/self/status").read() else "failed")
"""


def test_filter_refuses_the_listed_calls_and_nothing_ordinary():
    code = (
        PROGRAM.replace("INSTALL", repr(seccomp.INSTALL))
        .replace("HEX", repr(seccomp.filter_program().hex()))
        .replace("KEYCTL", str(seccomp.keyctl_number()))
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = dict(line.split() for line in out.stdout.splitlines())
    assert got == {
        "ptrace": "EPERM",
        "unshare": "EPERM",
        "keyctl": "EPERM",
        "mount": "EPERM",
        "chroot": "EPERM",
        "thread": "ok",
        "subprocess": "ok",
        "fork": "ok",
        "file": "ok",
    }


@pytest.mark.parametrize("machine", sorted(seccomp.SYSCALLS))
def test_every_table_builds_a_well_formed_program(machine):
    prog = seccomp.filter_program(machine)
    insns = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert len(prog) % 8 == 0 and len(insns) < 4096
    assert set(seccomp.DENIED) <= set(seccomp.SYSCALLS[machine][1])
    for i, (code, jt, jf, _) in enumerate(insns):  # every jump lands inside the program
        if code & 0x07 == 0x05:
            assert i + 1 + max(jt, jf) < len(insns)
    assert insns[-1] == (0x06, 0, 0, 0x7FFF0000)  # the default: allow
    with pytest.raises(ValueError, match="no seccomp syscall table"):
        seccomp.filter_program("sparc")
    assert platform.machine() in seccomp.SYSCALLS
