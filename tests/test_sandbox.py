"""Red-team suite of the code sandbox: each attack runs under every isolation this machine has
(bwrap, unshare); nothing may escape, and the next run still works (the trainer keeps running).

Which mechanism stops which attack is in docs/architecture.md ("Verifiable rewards").
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relax.rewards.isolation import (
    SandboxUnavailable,
    choose,
    drop_privileges,
    runs_as_trainer,
    works,
)
from relax.rewards.sandbox import NOBODY, Sandbox, SandboxConfig

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX only")

LIMITS = dict(
    cpu_s=1, wall_s=2.5, memory_mb=512, max_processes=16, max_output_bytes=1 << 16, tmpfs_mb=8
)


def _available(mechanism: str) -> bool:
    return works(mechanism, NOBODY, NOBODY) is None


def _preferred() -> str | None:
    try:
        return choose("auto", NOBODY, NOBODY, allow_unisolated=False)
    except SandboxUnavailable:
        return None


# the mechanism the sandbox chooses here runs in `make test`; the other (a fallback) in `make test-all`
PREFERRED = _preferred()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(m, marks=() if m == PREFERRED else pytest.mark.slow)
        for m in ("bwrap", "unshare")
    ],
)
def box(request) -> Sandbox:
    if not _available(request.param):
        pytest.skip(f"{request.param}: {works(request.param, NOBODY, NOBODY)}")
    if runs_as_trainer(request.param):
        pytest.skip(
            f"{request.param} as a non-root trainer runs code as the trainer's uid: refused by default "
            "(test_trainer_uid_is_refused_unless_accepted)"
        )
    return Sandbox(SandboxConfig(isolation=request.param, **LIMITS))


def run(box: Sandbox, code: str, stdin: str = ""):
    t0 = time.monotonic()
    result = box.run({"main.py": code}, ["{python}", "-I", "src/main.py"], stdin=stdin)
    assert time.monotonic() - t0 < box.cfg.wall_s + 3, "the deadline did not hold"
    return result


def still_works(box: Sandbox) -> None:
    """The trainer keeps running: a normal program runs right after the attack."""
    r = run(box, "print(sum(range(10)))")
    assert r.ok and r.stdout.strip() == "45", r


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def assert_no_survivors(marker: str) -> None:
    for _ in range(20):  # the kernel tears a PID namespace down asynchronously
        if not processes_with(marker):
            return
        time.sleep(0.1)
    raise AssertionError(f"processes outlived the sandbox: {processes_with(marker)}")


def test_normal_run_and_clean_environment(box):
    os.environ["RELAX_REDTEAM_SECRET"] = secret = secrets.token_hex(8)
    try:
        r = run(
            box,
            "import os, sys; print(sys.stdin.read()[::-1]); print(sorted(os.environ)); print(os.getuid())",
            stdin="abc",
        )
    finally:
        del os.environ["RELAX_REDTEAM_SECRET"]
    assert r.ok and r.stdout.splitlines()[0] == "cba"
    assert secret not in r.stdout and "RELAX_REDTEAM_SECRET" not in r.stdout
    assert "LD_PRELOAD" not in r.stdout and "PYTHONPATH" not in r.stdout


def test_fork_bomb(box):  # RLIMIT_NPROC; the PID namespace's end kills what is left
    marker = f"forkbomb-{secrets.token_hex(4)}"
    r = run(
        box,
        f"""
import os, sys, time
sys.argv.append({marker!r})
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
""",
    )
    assert not r.ok
    assert_no_survivors(marker)
    still_works(box)


def test_infinite_loop(box):  # RLIMIT_CPU: SIGXCPU after cpu_s seconds of CPU
    # a deadline far past cpu_s, so that a loaded machine (CPU seconds come slower than wall
    # seconds) still shows the CPU limit, not the deadline, ending the loop
    patient = Sandbox(dataclasses.replace(box.cfg, wall_s=15.0))
    r = patient.run({"main.py": "while True:\n    pass"}, ["{python}", "-I", "src/main.py"])
    assert r.returncode != 0 and not r.timed_out  # unshare reports the signal as exit status 1
    still_works(box)


def test_memory_bomb(box):  # RLIMIT_AS
    r = run(box, "chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))")
    assert not r.ok and "MemoryError" in r.stderr
    still_works(box)


def test_sleep_past_deadline(box):  # the wall-clock deadline (no CPU used)
    r = run(box, "import time\ntime.sleep(60)")
    assert r.timed_out and not r.ok
    still_works(box)


def test_write_and_delete_outside(
    box, tmp_path
):  # bwrap: not mounted; unshare: permissions (nobody)
    decoy_dir = tmp_path / "decoy"
    decoy_dir.mkdir()
    decoy = decoy_dir / "keep.txt"
    decoy.write_text("intact")
    decoy_dir.chmod(0o755)
    decoy.chmod(0o644)
    tmp_path.chmod(0o755)
    repo_file = Path(__file__).resolve().parents[1] / "relax-redteam-was-here"
    home_file = Path.home() / "relax-redteam-was-here"
    targets = [repo_file, home_file, decoy_dir / "new.txt"]
    if box.isolation == "bwrap":  # world-writable /tmp is the host's under unshare
        targets.append(Path("/tmp") / f"relax-redteam-{secrets.token_hex(4)}")
    r = run(
        box,
        f"""
import os, shutil
for path in {[str(t) for t in targets]!r}:
    try:
        open(path, "w").write("escaped")
    except OSError as exc:
        print("blocked", path, type(exc).__name__)
for path in [{str(decoy)!r}]:
    try:
        open(path, "w").write("overwritten")
    except OSError:
        pass
    try:
        os.remove(path)
    except OSError:
        pass
shutil.rmtree({str(decoy_dir)!r}, ignore_errors=True)
""",
    )
    assert r.ok, r
    for t in targets:
        assert not t.exists(), f"{t} was written from the sandbox"
    assert decoy.read_text() == "intact"
    still_works(box)


def test_read_home_and_parent_environment(
    box,
):  # bwrap: no home; unshare: nobody cannot open /root (0700)
    if box.isolation == "unshare" and os.geteuid() != 0:
        pytest.skip(
            "under unshare a non-root user's own files stay readable (documented); use bwrap"
        )
    secret = secrets.token_hex(8)
    home_file = Path.home() / f".relax-redteam-{secrets.token_hex(4)}"
    home_file.write_text(secret)
    home_file.chmod(0o600)
    os.environ["RELAX_REDTEAM_SECRET"] = secret
    try:
        r = run(
            box,
            f"""
import glob, os
for path in [{str(home_file)!r}] + glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
    try:
        print(open(path, "rb").read().decode(errors="replace"))
    except OSError:
        pass
for root in ("/root", "/home", {str(Path.home())!r}):
    try:
        print(os.listdir(root))
    except OSError:
        pass
""",
        )
    finally:
        del os.environ["RELAX_REDTEAM_SECRET"]
        home_file.unlink()
    assert r.ok, r
    assert secret not in r.stdout and home_file.name not in r.stdout


def test_network(box):  # a network namespace with no interface up
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(1)
    port = server.getsockname()[1]
    hits = []
    thread = threading.Thread(target=lambda: hits.append(_accept(server)), daemon=True)
    thread.start()
    r = run(
        box,
        f"""
import socket
for addr in [("127.0.0.1", {port}), ("1.1.1.1", 80), ("8.8.8.8", 53)]:
    try:
        socket.create_connection(addr, timeout=1).close()
        print("connected", addr)
    except OSError as exc:
        print("blocked", addr, exc)
""",
    )
    thread.join(5)
    server.close()
    assert r.ok and "connected" not in r.stdout, r.stdout
    assert hits == [None]


def _accept(server: socket.socket):
    try:
        conn, _ = server.accept()
        conn.close()
        return "connection"
    except OSError:
        return None


def test_gigabytes_of_output(box):  # the output cap: killed once it passes max_output_bytes
    r = run(box, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert r.output_truncated and not r.ok
    assert len(r.stdout) <= box.cfg.max_output_bytes
    still_works(box)


def test_background_process_and_signal_tricks(box):  # the PID namespace ends with its first process
    marker = f"daemon-{secrets.token_hex(4)}"
    r = run(
        box,
        f"""
import os, signal, sys
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
    os._exit(0)
print("parent exits")
""",
    )
    assert r.ok and r.stdout.strip() == "parent exits"
    assert_no_survivors(marker)
    still_works(box)


def test_kill_every_process(
    box,
):  # the PID namespace: kill(-1) reaches only the sandbox's processes
    marker = f"bystander-{secrets.token_hex(4)}"
    bystander = subprocess.Popen(
        drop_privileges(NOBODY, NOBODY)
        + [sys.executable, "-c", "import time; time.sleep(30)", marker],
        env={},
    )
    try:
        time.sleep(0.2)
        r = run(box, "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('done')")
        assert bystander.poll() is None, "kill(-1) in the sandbox killed a process outside it"
    finally:
        bystander.kill()
        bystander.wait()
    assert r.returncode != 0 or r.stdout.strip() == "done"
    still_works(box)


def test_unisolated_is_refused_without_opt_in():
    with pytest.raises(SandboxUnavailable, match="allow_unisolated"):
        Sandbox(SandboxConfig(isolation="none"))


def test_trainer_uid_is_refused_unless_accepted(monkeypatch):
    """A trainer that is not root cannot drop to ``nobody``: under none the code would run as the
    trainer, its files in reach, which is refused unless accepted; bwrap and unshare mount none of
    them. Simulated (this machine may run as root) by the euid."""
    assert not runs_as_trainer("none") or os.geteuid() != 0
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert (
        runs_as_trainer("none") and not runs_as_trainer("unshare") and not runs_as_trainer("bwrap")
    )
    assert (
        drop_privileges(NOBODY, NOBODY) == []
    )  # nobody to switch to: the program keeps the trainer's uid
    cfg = SandboxConfig(isolation="none", allow_unisolated=True, **LIMITS)
    with pytest.raises(
        SandboxUnavailable,
        match=r"\(none\) would run generated code as the trainer's "
        r"own user \(uid 1000.*--sandbox\.allow-trainer-uid",
    ):
        Sandbox(cfg)
    box = Sandbox(dataclasses.replace(cfg, allow_trainer_uid=True))
    r = box.run({"main.py": "print(6 * 7)"}, ["{python}", "-I", "src/main.py"])
    assert r.ok and r.stdout.strip() == "42" and r.isolation == "none"


def test_file_names_stay_inside():
    box = Sandbox(SandboxConfig(isolation="none", allow_unisolated=True, **LIMITS))
    with pytest.raises(ValueError, match="leaves the sandbox"):
        box.run({"../escape.py": "print(1)"}, ["{python}", "-I", "src/escape.py"])
    r = box.run({"main.py": "print(7)"}, ["{python}", "-I", "src/main.py"])
    assert r.ok and r.stdout.strip() == "7" and r.isolation == "none"


# ---------------------------------------------------------------- issue 33: what the program may not do


def test_outliving_the_run_as_the_namespace_init(box):
    """The program clears its parent-death signal, starts a new session and forks a sleeper that
    does the same: it is all gone once the run returns (the namespace's init is killed from outside)."""
    marker = f"outlive-{secrets.token_hex(4)}"
    r = run(
        box,
        f"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None)
libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0
try:
    os.setsid()
except OSError:  # already a session leader (bwrap --as-pid-1 --new-session)
    pass
if os.fork() == 0:
    libc.prctl(1, 0, 0, 0, 0)
    os.setsid()
    for fd in (0, 1, 2):
        os.close(fd)
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
print("parent done", os.getpid(), flush=True)
os.close(1); os.close(2)
time.sleep(60)
""",
    )
    assert "parent done" in r.stdout
    assert_no_survivors(marker)
    still_works(box)


SYSCALLS = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def err(ret):
    return "ok" if ret == 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
print("ptrace", err(libc.ptrace(16, 1, 0, 0)))  # PTRACE_ATTACH to the namespace's init
print("unshare", err(libc.unshare(0x10000000)))  # CLONE_NEWUSER
print("mount", err(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)))
print("keyctl", "ok" if libc.syscall(KEYCTL, 0, -3, 0) >= 0 else errno.errorcode[ctypes.get_errno()])
print("setns", err(libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0)))
"""


def test_namespace_ptrace_and_keyring_calls_are_refused(box):
    from relax.rewards.seccomp import keyctl_number

    r = run(box, SYSCALLS.replace("KEYCTL", str(keyctl_number())))
    assert r.ok, r.stderr
    got = dict(line.split() for line in r.stdout.splitlines())
    assert got == {
        "ptrace": "EPERM",
        "unshare": "EPERM",
        "mount": "EPERM",
        "keyctl": "EPERM",
        "setns": "EPERM",
    }


def test_the_trainers_session_keyring_is_out_of_reach(box):
    """A key in the trainer's session keyring: the program neither finds it (/proc/keys) nor reads it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    name = f"relax-redteam-{secrets.token_hex(4)}".encode()
    key = libc.syscall(
        248 if os.uname().machine == "x86_64" else 217, b"user", name, b"s3cret", 6, -3
    )  # add_key
    if key < 0:
        pytest.skip(f"add_key failed here (errno {ctypes.get_errno()})")
    r = run(box, "print(open('/proc/keys').read())")
    assert name.decode() not in r.stdout and "s3cret" not in r.stdout


def test_runs_cannot_see_or_touch_each_other(box):
    """Two runs at once: one looks for the other's files and rewrites them; the victim is untouched."""
    victim_code = (
        "import time; time.sleep(1.2); print(open('src/main.py').read().count('VICTIM'))  # VICTIM"
    )
    attacker = """
import glob, os
hits = []
for pattern in ("/tmp/relax-sandbox-*/*/src", "/tmp/relax-sandbox-*/src", "/tmp/*/src", "/proc/*/cwd/src"):
    for d in glob.glob(pattern):
        try:
            open(os.path.join(d, "main.py"), "w").write("print('pwned')")
            hits.append(d)
        except OSError:
            pass
print("hits", len(hits))
"""
    results = {}
    victim = threading.Thread(target=lambda: results.setdefault("victim", run(box, victim_code)))
    victim.start()
    time.sleep(0.4)
    results["attacker"] = run(box, attacker)
    victim.join()
    assert results["attacker"].stdout.strip() == "hits 0"
    assert results["victim"].ok and results["victim"].stdout.strip() == "2"


def test_host_files_and_shared_directories_are_out_of_view(box, tmp_path):
    """A world-readable dataset, the host's /etc, /var/tmp and /dev/shm: not in the program's file
    system, whichever mechanism; what it writes to its /tmp and /dev/shm is gone with it."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"output": "the expected answer"}\n')
    os.chmod(tmp_path, 0o755)
    os.chmod(dataset, 0o644)
    token = secrets.token_hex(6)
    r = run(
        box,
        f"""
import os
for path in ({str(dataset)!r}, "/etc/passwd", "/var/tmp", "/root", "/home", "/work"):
    print(path, os.path.exists(path))
for d in ("/tmp", "/dev/shm"):
    open(d + "/{token}", "w").write("x" * 1000)
print("wrote")
""",
    )
    assert r.ok, r.stderr
    seen = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines() if line != "wrote")
    assert set(seen.values()) == {"False"}, seen
    assert not (Path("/tmp") / token).exists() and not (Path("/dev/shm") / token).exists()
