"""Red team of the sandbox's memory bound per run as a whole (``relax.rewards.memory_bound``).

A program forks 6 children that each touch 120 MiB (720 MiB against ``memory_mb`` 512; the
issue's 6 x 350 MiB against 1024, scaled down): under each isolation (bwrap, unshare) and each
bound this machine has (a memory cgroup where the trainer can make one; the rlimit split, always),
the run's processes never hold more than ``memory_mb`` at once, measured from outside (the sum of
their proportional anonymous memory, sampled every 10 ms), and a trainer whose own memory limit
leaves room for one run's ``memory_mb`` and no more survives the attack (exit 0).

What these tests cannot show: sampling may miss a peak between two samples (the children hold
their memory for 0.6 s, dozens of samples), and one sample is not one instant (``SLACK_MB``);
where no memory cgroup can be made the trainer's tight limit cannot be made either, and the
trainer test then only shows that it finishes with the run bounded.
``test_the_sampler_sees_an_unbounded_fork`` and ``test_an_unbounded_trainer_is_killed`` show that
the measures would catch the attack if the bound did not hold.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relax.rewards import cgroup
from relax.rewards import memory_bound as mem
from relax.rewards.code_exec import CodeExec
from relax.rewards.isolation import SandboxUnavailable, choose, works
from relax.rewards.sandbox import NOBODY, Sandbox, SandboxConfig, describe

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux only")

MEMORY_MB = 512
CHILDREN, CHILD_MB = 6, 120
ATTACK = f"""
import os, time
for i in range({CHILDREN}):
    try:
        pid = os.fork()
    except OSError as exc:
        print("fork refused", exc, flush=True)
        break
    if pid == 0:
        try:
            blob = b"x" * ({CHILD_MB} << 20)  # every page written
            print("held", flush=True)
            time.sleep(0.6)
        except MemoryError:
            print("refused memory", flush=True)
        os._exit(0)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
print("done")
"""
# The sampler reads the processes one after another, not at one instant: a child read just before
# the kernel frees it (killed for memory) and one read just after it took that memory count twice.
# A scan takes a few ms, in which a child faults in some MiB: measured up to 23 MiB over (5%).
SLACK_MB = 48
LIMITS = dict(memory_mb=MEMORY_MB, max_processes=8, tmpfs_mb=8, wall_s=8.0, cpu_s=5)


def _cgroup_parent() -> cgroup.Parent | None:
    try:
        return cgroup.find_parent()
    except cgroup.CgroupUnavailable:
        return None


def _preferred() -> str | None:
    try:
        return choose("auto", NOBODY, NOBODY, allow_unisolated=False)
    except SandboxUnavailable:
        return None


PARENT = _cgroup_parent()
PREFERRED = _preferred()


def _params():
    """(isolation, bound): the preferred isolation in ``make test``, the other in ``make test-all``."""
    return [
        pytest.param(m, b, marks=[] if m == PREFERRED else [pytest.mark.slow], id=f"{m}-{b}")
        for m in ("bwrap", "unshare")
        for b in ("cgroup", "rlimit")
    ]


def _box(mechanism: str, bound: str, **limits) -> Sandbox:
    if works(mechanism, NOBODY, NOBODY) is not None:
        pytest.skip(f"{mechanism}: {works(mechanism, NOBODY, NOBODY)}")
    if bound == "cgroup" and PARENT is None:
        pytest.skip("no memory cgroup can be made on this machine")
    if os.geteuid() != 0:
        pytest.skip(
            "the attacks run as root's `nobody` (test_sandbox.py covers a non-root trainer)"
        )
    return Sandbox(SandboxConfig(isolation=mechanism, memory_bound=bound, **{**LIMITS, **limits}))


class PeakSampler:
    """The most anonymous memory (MiB) that the processes whose command line holds ``marker``
    held at once, summed over them from ``/proc`` every 10 ms: their proportional
    share (``Pss_Anon``), so that a page a fork left shared counts once, as the kernel charges it."""

    def __init__(self, marker: str):
        self.marker, self.peak_mb = marker.encode(), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def _loop(self):
        while not self._stop.is_set():
            total = 0
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    if self.marker not in Path(entry.path, "cmdline").read_bytes():
                        continue
                    rollup = Path(entry.path, "smaps_rollup").read_text()
                except OSError:
                    continue
                for line in rollup.splitlines():
                    if line.startswith("Pss_Anon:"):
                        total += int(line.split()[1])
            self.peak_mb = max(self.peak_mb, total / 1024)
            time.sleep(0.01)


def _attack(box: Sandbox):
    marker = f"memory-attack-{secrets.token_hex(4)}"
    with PeakSampler(marker) as sampler:
        r = box.run({"main.py": ATTACK}, ["{python}", "-I", "src/main.py", marker])
    return r, sampler


@pytest.mark.parametrize("mechanism,bound", _params())
def test_a_forking_program_holds_at_most_memory_mb(mechanism, bound):
    box = _box(mechanism, bound)
    r, sampler = _attack(box)
    assert sampler.peak_mb >= CHILD_MB, (
        f"the sampler saw no child's memory: {sampler.peak_mb:.0f} MiB"
    )
    assert sampler.peak_mb <= MEMORY_MB + SLACK_MB, f"the run held {sampler.peak_mb:.0f} MiB"
    held = r.stdout.count("held")
    if bound == "cgroup":  # the kernel killed children past the limit: reported, not ok
        assert r.memory_exceeded and not r.ok and box.memory_exceeded_runs == 1, r
    else:  # fewer processes, each with less address space: the fork itself is refused
        assert "fork refused" in r.stdout and held < CHILDREN and not r.memory_exceeded, r
        assert held <= box.bound.processes - 1
    r = box.run({"main.py": "print(sum(range(10)))"}, ["{python}", "-I", "src/main.py"])
    assert r.ok and r.stdout.strip() == "45"  # and the next run works


def test_the_sampler_sees_an_unbounded_fork():
    """The measure above can fail: the same attack, unsandboxed, is seen holding it all."""
    marker = f"memory-attack-{secrets.token_hex(4)}"
    with PeakSampler(marker) as sampler:
        done = subprocess.run(
            [sys.executable, "-I", "-c", ATTACK, marker], capture_output=True, text=True, timeout=30
        )
    assert done.stdout.count("held") == CHILDREN
    assert sampler.peak_mb > CHILDREN * CHILD_MB * 0.9 > MEMORY_MB + SLACK_MB, sampler.peak_mb


@pytest.mark.parametrize("bound", ["cgroup", "rlimit"])
def test_a_correct_program_runs_under_the_bound(bound):
    """The defaults (1024 MiB, 32 processes, 64 MiB tmpfs): under the split 6 processes of 138 MiB
    (bwrap); a program with 100 MiB of data, the usual imports and a thread runs as before."""
    if PREFERRED is None:
        pytest.skip("no isolation on this machine")
    box = _box(PREFERRED, bound, memory_mb=1024, max_processes=32, tmpfs_mb=64)
    code = """
import collections, functools, heapq, itertools, json, math, re, threading
data = [0] * (12 << 20)  # 96 MiB of pointers
out = []
t = threading.Thread(target=lambda: out.append(sum(itertools.islice(data, 1000)) + 7))
t.start(); t.join()
print(len(data), out[0])
"""
    r = box.run({"main.py": code}, ["{python}", "-I", "src/main.py"])
    assert r.ok and r.stdout.split() == [str(12 << 20), "7"], r


def test_sandboxed_processes_are_the_kernels_first_choice():
    """``oom_score_adj`` 1000 in the program and its children; where the trainer holds
    CAP_SYS_RESOURCE the program cannot lower it (here it may hold it or not)."""
    if PREFERRED is None:
        pytest.skip("no isolation on this machine")
    box = _box(PREFERRED, "rlimit")
    code = """
import os
if os.fork() == 0:
    print("child", open("/proc/self/oom_score_adj").read().strip(), flush=True)
    os._exit(0)
os.wait()
print("parent", open("/proc/self/oom_score_adj").read().strip())
try:
    open("/proc/self/oom_score_adj", "w").write("0")
    print("lowered", open("/proc/self/oom_score_adj").read().strip())
except OSError:
    print("lowering refused")
"""
    r = box.run({"main.py": code}, ["{python}", "-I", "src/main.py"])
    lines = r.stdout.splitlines()
    assert r.ok and lines[:2] == ["child 1000", "parent 1000"], r
    status = Path("/proc/self/status").read_text()
    cap_eff = int(next(x for x in status.splitlines() if x.startswith("CapEff:")).split()[1], 16)
    if cap_eff >> 24 & 1:  # CAP_SYS_RESOURCE: 1000 is then the floor
        assert lines[2] == "lowering refused", r


def test_a_run_killed_for_memory_scores_nothing():
    """Under a cgroup, a program that prints the right output while its children pass
    ``memory_mb`` (each under its own ``RLIMIT_AS``) is not ok, and ``code_exec`` scores it 0."""
    if PREFERRED is None or PARENT is None or os.geteuid() != 0:
        pytest.skip("needs an isolation and a memory cgroup")
    reward = CodeExec(sandbox=SandboxConfig(isolation=PREFERRED, memory_bound="cgroup", **LIMITS))
    hog = (
        "```python\nimport os, time\nfor _ in range(2):\n    if os.fork() == 0:\n"
        "        blob = b'x' * (300 << 20)\n        time.sleep(0.3)\n        os._exit(0)\n"
        "for _ in range(2):\n    os.wait()\nprint('ok')\n```"
    )
    honest = "```python\nprint('ok')\n```"
    tests = [{"input": "", "output": "ok"}]
    assert reward(["q", "q"], [hog, honest], tests=[tests, tests]) == [0.0, 1.0]


TRAINER = """
import json, sys
ballast = b"x" * (160 << 20)  # a trainer larger than any child: the kernel's pick without the bound
from relax.rewards.sandbox import Sandbox, SandboxConfig
cfg = json.loads(sys.argv[1])
box = Sandbox(SandboxConfig(**cfg)) if cfg else None
print("ready", flush=True)
sys.stdin.readline()
if box is None:  # the control: the attack with no sandbox, as the trainer's own child
    import subprocess
    subprocess.run([sys.executable, "-I", "-c", sys.argv[2]], capture_output=True)
    print(json.dumps({"ok": True}), flush=True)
else:
    r = box.run({"main.py": sys.argv[2]}, ["{python}", "-I", "src/main.py"])
    print(json.dumps({"ok": r.ok, "memory_exceeded": r.memory_exceeded}), flush=True)
"""
HEADROOM_MB = 48  # the trainer's limit: its anonymous memory once ready + memory_mb + this


def _run_trainer(cfg: dict) -> tuple[int, str, bool]:
    """The trainer in a memory cgroup whose limit, set once it is ready, leaves room for one run
    of ``memory_mb`` (no limit where no cgroup can be made); (exit status, stdout, limited)."""
    group = cgroup.RunCgroup(PARENT, 16 << 30, 4096) if PARENT is not None else None
    join = ["sh", "-c", 'echo $$ >"$0" && exec "$@"', group.procs] if group else []
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [*join, sys.executable, "-c", TRAINER, json.dumps(cfg), ATTACK],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(90, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        if group is not None:
            _limit(group, _anon(group) + ((MEMORY_MB + HEADROOM_MB) << 20))
        out, _ = proc.communicate("go\n")
        return proc.returncode, out, group is not None
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        if group is not None:
            group.close()


def _anon(group: cgroup.RunCgroup) -> int:
    """The anonymous memory charged to ``group`` (its page cache is reclaimed under pressure)."""
    stat = dict(line.split() for line in (group.path / "memory.stat").read_text().splitlines())
    return int(stat["anon"] if group.version == 2 else stat["total_rss"])


def _limit(group: cgroup.RunCgroup, limit: int) -> None:
    names = ["memory.max"] if group.version == 2 else ["memory.limit_in_bytes"]
    if group.version == 1 and (group.path / "memory.memsw.limit_in_bytes").exists():
        names.append("memory.memsw.limit_in_bytes")  # lowered after the memory limit
    for name in names:
        (group.path / name).write_text(str(limit))


@pytest.mark.parametrize("bound", ["auto", pytest.param("rlimit", marks=pytest.mark.slow)])
def test_a_trainer_in_a_tight_memory_limit_survives(bound):
    """The issue's attack, where the kernel killed the trainer (exit 137): here it finishes, the
    run bounded; ``auto`` is whichever bound this machine has (the cgroup here, where there is one)."""
    if PREFERRED is None or os.geteuid() != 0 or shutil.which("sh") is None:
        pytest.skip("needs an isolation and a root trainer")
    cfg = dict(isolation=PREFERRED, memory_bound=bound, **LIMITS)
    code, out, limited = _run_trainer(cfg)
    assert code == 0, f"the trainer died ({code}; limited: {limited})"
    result = json.loads(out.splitlines()[-1])
    assert not (result["memory_exceeded"] and result["ok"])
    if bound == "auto" and PARENT is not None:  # a cgroup: the kernel killed inside the run
        assert result["memory_exceeded"] and not result["ok"]


@pytest.mark.slow
def test_an_unbounded_trainer_is_killed():
    """The control of the test above: the same trainer and limit, the attack run with no bound,
    and the kernel kills the trainer, the largest process in its limit."""
    if PARENT is None or os.geteuid() != 0:
        pytest.skip("no memory cgroup for the trainer on this machine")
    code, out, limited = _run_trainer({})
    assert limited and code == -9, (code, out)


# ------------------------------------------------------------------ the choice, and what it reports


@pytest.mark.parametrize(
    "memory_mb,max_processes,tmpfs,tmpfs_mb,expected",
    [
        (1024, 32, 3, 64, (6, 138)),  # the defaults under bwrap: 832 MiB in processes of >= 128
        (1024, 32, 4, 64, (6, 128)),  # under unshare (one more tmpfs, its root)
        (1024, 2, 3, 64, (2, 416)),  # --sandbox.max-processes 2: two larger ones
        (256, 16, 3, 8, (1, 232)),  # less than two processes' worth: one gets it all
        (512, 8, 4, 8, (3, 160)),
        (100, 32, 0, 64, (1, 100)),  # none: no tmpfs of its own
    ],
)
def test_the_rlimit_split(memory_mb, max_processes, tmpfs, tmpfs_mb, expected):
    processes, process_mb = mem.split(memory_mb, max_processes, tmpfs, tmpfs_mb)
    assert (processes, process_mb) == expected
    assert processes * process_mb + tmpfs * tmpfs_mb <= memory_mb and processes <= max_processes


def test_the_split_refuses_a_budget_the_interpreter_cannot_start_in():
    with pytest.raises(SandboxUnavailable, match=r"memory-mb 256 leaves 0 MiB .*tmpfs-mb 64"):
        mem.split(256, 16, 4, 64)


def test_cgroups_are_found_from_proc_files():
    hybrid = (  # this machine's kind: cgroup v1 memory, a v2 mount without it
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    own = "4:memory:/process_api/abc\n8:pids:/\n0::/\n"
    assert cgroup.candidates(own, hybrid) == [
        cgroup.Parent(2, Path("/sys/fs/cgroup/unified")),
        cgroup.Parent(1, Path("/sys/fs/cgroup/memory/process_api/abc")),
    ]
    container = "1 0 0:1 /docker/xyz /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert cgroup.candidates("0::/docker/xyz/job\n", container) == [
        cgroup.Parent(2, Path("/sys/fs/cgroup/job"))
    ]
    assert cgroup.candidates("0::/elsewhere\n", container) == []  # not below what it shows
    spaced = r"1 0 0:1 / /sys/fs/my\040cgroups rw - cgroup2 cgroup2 rw" + "\n"
    assert cgroup.candidates("0::/\n", spaced) == [cgroup.Parent(2, Path("/sys/fs/my cgroups"))]


def test_cgroup_required_but_not_available_names_where_and_why(tmp_path):
    with pytest.raises(SandboxUnavailable, match=f"no memory cgroup.*{tmp_path}.*neither"):
        mem.choose("cgroup", 512, 8, "bwrap", 8, str(tmp_path))


def test_the_report_says_which_bound_is_in_force():
    if PREFERRED is None:
        pytest.skip("no isolation on this machine")
    line = describe(SandboxConfig(isolation=PREFERRED, memory_bound="rlimit", **LIMITS))
    assert line.startswith(f"sandbox: {PREFERRED}, programs run as ")
    tmpfs = mem.TMPFS_COUNT[PREFERRED]
    processes, process_mb = mem.split(MEMORY_MB, 8, tmpfs, 8)
    assert (
        f"rlimit split (--sandbox.memory-bound rlimit): at most {processes} processes x {process_mb} MiB"
        in line
    )
    assert "oom_score_adj 1000" in line
    auto = describe(SandboxConfig(isolation=PREFERRED, **LIMITS))
    if PARENT is not None:
        assert (
            f"cgroup v{PARENT.version}, a memory cgroup per run under {PARENT.path}: 512 MiB"
            in auto
        )
    else:
        assert "rlimit split (no memory cgroup: " in auto
