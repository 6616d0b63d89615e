"""``relax.rewards.pool``: reward functions in worker processes (timeouts, crashes, overlap, close).

Spawned workers take ~1 s each to start, so most tests share one module-scoped pool whose
``behave`` function does what each sample's ``mode`` field asks (score, raise, hang, die...).
"""

import logging
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from relax.rewards.functions import (
    RewardError,
    RewardFunction,
    score,
    score_groups,
    start_score_groups,
)
from relax.rewards.pool import PendingScores, PoolConfig, RewardPool

TIMEOUT_S = 0.5
SLOW_S = 0.1


def length(prompts, completions, **_):
    return [len(c) for c in completions]


def behave(prompts, completions, mode, **_):
    """Per sample, as ``mode`` says: "ok" 1.0, "none" missing, "raise", "hang" (past the timeout),
    "kill" (SIGKILL to its own worker), "slow" (100 ms), "pid" (100 ms, then the worker's pid), "cpu"."""
    out = []
    for m in mode:
        if m == "raise":
            raise ValueError("boom")
        if m == "hang":
            time.sleep(60)
        if m == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if m in ("slow", "pid"):
            time.sleep(SLOW_S)
        if m == "cpu":
            import jax

            out.append(
                float(jax.devices()[0].platform == "cpu" and jax.config.jax_platforms == "cpu")
            )
            continue
        out.append(
            {"none": None, "pid": float(os.getpid())}.get(m, 1.0)
        )  # pids < 2**22: exact in float32
    return out


def make_contains(word):
    def contains(prompts, completions, **_):  # a closure: shipped by value
        return [None if not c else float(word in c) for c in completions]

    return contains


FNS = (
    RewardFunction(length, weight=0.1),
    RewardFunction(make_contains("7"), weight=2.0),
    RewardFunction(
        lambda prompts, completions, **_: [-1.0] * len(prompts), name="flat", weight=0.5
    ),
    RewardFunction(behave),
)


@pytest.fixture(scope="module")
def pool():
    """2 workers, one sample per task; JAX_PLATFORMS unset while they spawn, so the "cpu" check
    sees the initializer's setting rather than the test environment's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("JAX_PLATFORMS", raising=False)
        p = RewardPool(FNS, PoolConfig(num_workers=2, timeout_s=TIMEOUT_S, chunk_size=1))
    with p:
        yield p


def batch(modes):
    n = len(modes)
    return (
        [f"p{i}" for i in range(n)],
        [("" if i % 5 == 4 else f"a{i}") for i in range(n)],
        {"mode": list(modes)},
    )


def test_values_equal_in_process_score(pool):
    prompts, completions, fields = batch(["ok", "none", "ok", "ok", "none", "ok", "ok", "ok"])
    want = score(FNS, prompts, completions, fields)
    got = score(FNS, prompts, completions, fields, pool=pool)
    np.testing.assert_array_equal(got[0], want[0])
    assert list(got[1]) == list(want[1])
    for name in want[1]:
        np.testing.assert_array_equal(got[1][name], want[1][name])
    assert np.isnan(got[1]["contains"][4]) and np.isnan(got[1]["behave"][1])  # None -> NaN
    info = got[2]
    assert (info["errors"], info["timeouts"], info["crashes"], info["failed"]) == (0, 0, 0, ())
    assert info["missing"] == want[2]["missing"] and info["all_missing"] == 0
    assert all(0 < info[f"time_s/{f.name}"] < 5 for f in FNS)


@pytest.mark.slow
def test_chunks_of_three_and_score_groups():
    """Uneven chunks (7 samples in 3 + 3 + 1) and worker recycling give the same values."""
    fns = FNS[:3]
    before = {c.pid for c in multiprocessing.active_children()}
    with RewardPool(fns, PoolConfig(num_workers=2, chunk_size=3, max_tasks_per_worker=5)) as p:
        prompts, completions, _ = batch(["ok"] * 7)
        got, want = score(fns, prompts, completions, pool=p), score(fns, prompts, completions)
        np.testing.assert_array_equal(got[0], want[0])
        first = {c.pid for c in multiprocessing.active_children()} - before
        tokens = np.arange(12).reshape(2, 3, 2)
        decode = lambda t, m: [str(int(row.sum())) for row in t]  # noqa: E731
        want = score_groups(fns, decode, ["a", "b"], {}, tokens, tokens > 0)
        for got in (
            score_groups(fns, decode, ["a", "b"], {}, tokens, tokens > 0, pool=p),
            start_score_groups(fns, decode, ["a", "b"], {}, tokens, tokens > 0, pool=p).result(),
        ):
            np.testing.assert_array_equal(got[0], want[0])
            assert got[0].shape == (2, 3) and got[3] == want[3]
            np.testing.assert_array_equal(got[1]["contains"], want[1]["contains"])
        assert {
            c.pid for c in multiprocessing.active_children()
        } - before != first  # 18 tasks, 5 a worker


def test_raising_chunk_is_missing_or_raises(pool, caplog):
    prompts, completions, fields = batch(["ok", "raise", "ok", "ok"])
    with caplog.at_level(logging.WARNING):
        per, info = pool.submit(prompts, completions, fields).result(on_error="missing")
    np.testing.assert_array_equal(per["behave"], [1.0, np.nan, 1.0, 1.0])
    np.testing.assert_array_equal(per["length"], [2, 2, 2, 2])
    assert (info["errors"], info["timeouts"], info["crashes"], info["failed"]) == (
        1,
        0,
        0,
        ("behave",),
    )
    assert "'behave' raised ValueError: boom" in caplog.text and "sample 1" in caplog.text
    with pytest.raises(
        RewardError, match=r"'behave' raised ValueError: boom at sample 1 .*completion='a1'"
    ):
        score(FNS, prompts, completions, fields, pool=pool)


def test_raise_locates_the_sample_inside_a_chunk():
    fns = (RewardFunction(behave),)
    with RewardPool(fns, PoolConfig(num_workers=2, chunk_size=4)) as p:
        prompts, completions, fields = batch(["ok", "ok", "ok", "ok", "ok", "ok", "raise", "ok"])
        with pytest.raises(RewardError, match=r"'behave' raised ValueError: boom at sample 6 "):
            score(fns, prompts, completions, fields, pool=p)
        per, info = p.submit(prompts, completions, fields).result(on_error="missing")
        np.testing.assert_array_equal(per["behave"], [1.0] * 4 + [np.nan] * 4)  # the chunk is lost
        assert info["errors"] == 1


def test_timeout_kills_the_chunk_and_the_pool_goes_on(pool):
    prompts, completions, fields = batch(["ok", "hang", "ok"])
    t0 = time.perf_counter()
    per, info = pool.submit(prompts, completions, fields).result(on_error="missing")
    assert time.perf_counter() - t0 < TIMEOUT_S + 5
    np.testing.assert_array_equal(per["behave"], [1.0, np.nan, 1.0])
    assert (info["errors"], info["timeouts"], info["crashes"]) == (0, 1, 0)
    with pytest.raises(
        RewardError,
        match=r"'behave' timed out after 0.5s \(its worker was killed .* on sample 1 "
        r".*completion='a1'",
    ):
        pool.submit(prompts, completions, fields).result(on_error="raise")
    per, info = pool.submit(*batch(["ok", "ok"])).result()
    np.testing.assert_array_equal(per["behave"], [1.0, 1.0])


def test_killed_worker_is_a_crash_and_the_pool_goes_on(pool):
    prompts, completions, fields = batch(["ok", "kill", "ok", "ok"])
    per, info = pool.submit(prompts, completions, fields).result(on_error="missing")
    np.testing.assert_array_equal(per["behave"], [1.0, np.nan, 1.0, 1.0])
    assert (info["errors"], info["timeouts"], info["crashes"], info["failed"]) == (
        0,
        0,
        1,
        ("behave",),
    )
    with pytest.raises(
        RewardError,
        match=r"'behave' crashed its worker process \(exit code -9; replaced\) on "
        r"sample 1 ",
    ):
        pool.submit(prompts, completions, fields).result(on_error="raise")
    prompts, completions, fields = batch(["ok", "none", "ok"])
    np.testing.assert_array_equal(
        score(FNS, prompts, completions, fields, pool=pool)[0],
        score(FNS, prompts, completions, fields)[0],
    )


def wait_for_workers(pool, n, limit_s=30.0):
    """Until n workers answer at once (a killed one is replaced in the background)."""
    t0 = time.perf_counter()
    while len(set(pool.submit(*batch(["pid"] * n)).result()[0]["behave"])) < n:
        assert time.perf_counter() - t0 < limit_s, f"{n} workers not up after {limit_s}s"


@pytest.mark.slow  # timed: in a full run it failed twice of four (submit 0.56 s, scoring 1.37 s); make test-all
def test_submit_returns_at_once_and_workers_overlap(pool):
    wait_for_workers(pool, 2)
    n = 16
    prompts, completions, fields = batch(["slow"] * n)
    t0 = time.perf_counter()
    pending = pool.submit(prompts, completions, fields)
    t_submit = time.perf_counter() - t0
    assert isinstance(pending, PendingScores) and not pending.done()
    per, info = pending.result()
    elapsed = time.perf_counter() - t0
    # submit hands the chunks over and returns: a small part of the scoring time (a ratio, so that
    # a loaded machine, which slows both, does not fail it)
    assert t_submit < 0.25 * elapsed and pending.done(), (t_submit, elapsed)
    np.testing.assert_array_equal(per["behave"], np.ones(n))
    serial = n * SLOW_S
    assert serial / 2 <= elapsed < 0.75 * serial, (t_submit, elapsed)


def test_workers_ignore_ctrl_c(pool):
    wait_for_workers(pool, 2)
    pids = {int(x) for x in pool.submit(*batch(["pid"] * 2)).result()[0]["behave"]}
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    per, info = pool.submit(*batch(["pid"] * 2)).result()
    assert {int(x) for x in per["behave"]} == pids and info["crashes"] == 0


def test_workers_run_jax_on_the_cpu(pool):
    per, _ = pool.submit(*batch(["cpu"] * 4)).result()
    np.testing.assert_array_equal(per["behave"], np.ones(4))


def test_close_leaves_no_process_behind():
    before = {p.pid for p in multiprocessing.active_children()}
    fns = (RewardFunction(behave),)
    p = RewardPool(fns, PoolConfig(num_workers=2, chunk_size=1))
    pids = {int(x) for x in p.submit(*batch(["pid"] * 6)).result()[0]["behave"]}
    pending = p.submit(*batch(["hang"]))  # running while we close
    workers = {c.pid for c in multiprocessing.active_children()} - before
    assert pids and pids <= workers and len(workers) == 2
    p.close()
    p.close()  # idempotent
    assert not {c.pid for c in multiprocessing.active_children()} - before
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RewardError, match="reward pool closed while reward function 'behave'"):
        pending.result()
    with pytest.raises(RuntimeError, match="RewardPool is closed"):
        p.submit(*batch(["ok"]))


def test_pool_must_host_the_scored_functions(pool):
    prompts, completions, fields = batch(["ok"])
    with pytest.raises(ValueError, match="reward pool hosts .* same RewardFunction objects"):
        score(FNS[:2], prompts, completions, fields, pool=pool)
    with pytest.raises(ValueError, match="timeout_s=2.0 with a reward pool"):
        score(FNS, prompts, completions, fields, pool=pool, timeout_s=2.0)


def test_start_score_groups_without_pool_is_done():
    tokens = np.ones((1, 2, 3), np.int32)
    handle = start_score_groups(
        [length], lambda t, m: ["ab", "c"], ["p"], {}, tokens, tokens > 0, pool=None
    )
    assert handle.done()
    np.testing.assert_array_equal(handle.result()[0], [[2.0, 1.0]])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_workers=0), "num_workers"),
        (dict(chunk_size=1.5), "chunk_size"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(max_tasks_per_worker=0), "max_tasks_per_worker"),
        (dict(start_timeout_s=float("inf")), "start_timeout_s"),
        (dict(context="fork"), "context"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PoolConfig(**kwargs)


def test_unpicklable_function_is_named():
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="reward function 'locked' cannot be pickled"):
        RewardPool(
            [RewardFunction(lambda p, c, **_: [bool(lock)] * len(p), name="locked")], PoolConfig()
        )


def test_function_that_does_not_unpickle_in_a_worker_is_named(tmp_path, monkeypatch):
    """Pickled by reference to a module the workers cannot import: named at start-up."""
    (tmp_path / "gone_reward.py").write_text(
        "def gone(prompts, completions, **_):\n    return [1.0] * len(prompts)"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_reward

    (tmp_path / "gone_reward.py").unlink()
    with pytest.raises(
        RuntimeError, match="reward function 'gone' did not unpickle in a worker: ModuleNotFound"
    ):
        RewardPool([length, gone_reward.gone], PoolConfig(num_workers=1))
