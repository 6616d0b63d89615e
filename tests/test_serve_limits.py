"""Red team of the training service's bounds and numerics (issue 52): hostile sizes and values
sent to a ``Service`` as a client would send them, each refused with its status and field, the
service unchanged and still serving; compiled programs keyed by shape and structure, numbers as
arguments, the cache bounded; free memory read from cgroups and devices; saves that fail leave
nothing. (The HTTP attacks, bodies and origins, are tests/test_serve_http.py's.)"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.algorithms.online.batch import LossRows
from relax.data.packing import PackedBatch
from relax.models import ModelConfig, init
from relax.models.layers.lora import LoRAConfig
from relax.serve import memory
from relax.serve.limits import ServiceLimits
from relax.serve.programs import ProgramCache
from relax.serve.server import run
from relax.serve.service import _LORA_CHECKS, Service, ServiceConfig
from relax.serve.types import Datum, ModelInput
from relax.serve.wire import encode_batch, materialize
from relax.train import free_memory

CFG = ModelConfig(
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    eos_token_id=3,
)
BASE = init(CFG, jax.random.key(0), std=0.3)


def make(tmp_path, **limits) -> Service:
    return Service(
        BASE,
        None,
        ServiceConfig(
            model="tiny",
            state_dir=str(tmp_path),
            lora=LoRAConfig(rank=2),
            limits=ServiceLimits(**limits),
        ),
    )


def datums(seed: int = 0, count: int = 2, advantage: float | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(4, 8))
        tokens = rng.integers(4, 16, n + 1)
        adv = rng.normal(size=n) if advantage is None else np.full(n, advantage)
        out.append(
            Datum(
                ModelInput.from_ints(tokens[:-1]),
                {
                    "target_tokens": tokens[1:],
                    "weights": np.ones(n, np.float32),
                    "logprobs": (-rng.uniform(0.5, 3.0, n)).astype(np.float32),
                    "advantages": adv.astype(np.float32),
                },
            ).to_wire()
        )
    return out


def refused(call, field: str, status: int = 400) -> str:
    """``call`` answered as the server answers it: refused with ``status`` naming ``field``."""
    got, out = run(call)
    assert (got, out.get("field")) == (status, field), out
    return out["error"]


def snapshot(session) -> list[np.ndarray]:
    """Every array of the session's state and pending gradients, on the host."""
    leaves = jax.tree.leaves((session.state, session.pending))
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in leaves
        if isinstance(x, jax.Array)
    ]


def unchanged(session, before: list[np.ndarray]) -> None:
    after = snapshot(session)
    assert len(after) == len(before)
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A service and a session with gradients pending (one compile of each program, shared)."""
    svc = make(tmp_path_factory.mktemp("served"))
    sid = svc.create_session({"rank": 2, "seed": 1})["session"]
    svc.forward_backward(sid, {"data": datums(1), "loss_fn": "importance_sampling"})
    return svc, sid


# ---------------------------------------------------------------------------------- programs


def test_program_cache_takes_numbers_as_arguments_and_guards_branches(caplog):
    cache = ProgramCache(max_programs=3)
    x = jnp.arange(4.0)

    def step(o, x):
        if o["scale"] < 0:  # a config's check: asked again of every value
            raise ValueError("scale must be >= 0")
        y = x * o["scale"] if o["scale"] > 1 else x - o["scale"]  # a branch on the value
        return jnp.minimum(y, o["cap"])  # jnp takes no stand-in: cap is compiled as a constant

    def want(scale, cap):
        return np.minimum(np.arange(4.0) * scale if scale > 1 else np.arange(4.0) - scale, cap)

    with caplog.at_level(logging.INFO, logger="relax.serve"):
        for scale in (2.0, 3.0, 5.5):
            np.testing.assert_allclose(
                cache.run(("k",), step, {"scale": scale, "cap": 9.0}, x), want(scale, 9.0)
            )
    assert cache.compiles == 1 and "options cap are compiled as constants" in caplog.text
    np.testing.assert_allclose(cache.run(("k",), step, {"scale": 0.5, "cap": 9.0}, x), want(0.5, 9))
    assert cache.compiles == 2  # the other branch: its own program
    np.testing.assert_allclose(cache.run(("k",), step, {"scale": 4.0, "cap": 2.0}, x), want(4, 2))
    assert cache.compiles == 3  # a new constant
    with pytest.raises(ValueError, match="scale must be >= 0"):
        cache.run(("k",), step, {"scale": -1.0, "cap": 9.0}, x)
    with caplog.at_level(logging.INFO, logger="relax.serve"):
        for n in range(5, 9):  # new shapes: each compiles, the oldest are evicted
            cache.run(("k",), step, {"scale": 2.0, "cap": 9.0}, jnp.arange(float(n)))
            assert len(cache) <= 3
    assert cache.evictions == 4 and "evicted the least recently used" in caplog.text


@pytest.mark.slow
def test_distinct_options_compile_once_and_the_cache_is_bounded(tmp_path):
    """40 requests with distinct floats once compiled 40 programs and kept each: now the clip
    thresholds and the learning rate are arguments of one program each, and at most
    ``max_programs`` are kept."""
    svc = make(tmp_path, max_programs=2)
    sid = svc.create_session({"rank": 2})["session"]
    data = datums(2)
    session = svc.session(sid)
    policy = session.state.policy
    losses = []
    for low, high in ((0.9, 1.1), (0.8, 1.2), (0.95, 1.05), (0.7, 1.3)):
        config = {"clip_low_threshold": low, "clip_high_threshold": high}
        out = svc.forward_backward(
            sid, {"data": data, "loss_fn": "ppo", "loss_fn_config": config}, backward=False
        )
        want = 0.0  # -sum min(r A, clip(r, low, high) A), r = p / q, from the returned log-probs
        for d, o in zip(data, out["loss_fn_outputs"]):
            r = np.exp(o["logprobs"] - d["inputs"]["logprobs"])
            a = d["inputs"]["advantages"]
            want -= np.minimum(r * a, np.clip(r, low, high) * a).sum()
        np.testing.assert_allclose(out["metrics"]["loss"], want, rtol=1e-5)
        losses.append(out["metrics"]["loss"])
    assert svc.bounds.programs.compiles == 1 and len(set(losses)) == 4
    assert session.state.policy is policy
    for lr in (1e-3, 2e-3, 3e-3):
        svc.forward_backward(sid, {"data": data, "loss_fn": "cross_entropy"})
        svc.optim_step(sid, {"adam_params": {"learning_rate": lr}})
    info = svc.info()["programs"]
    # ppo's forward, cross_entropy's forward_backward, the optimizer step, the accumulation... at
    # most 2 kept: each new one evicted the least recently used
    assert info["cached"] <= 2 and info["evicted"] == info["compiled"] - info["cached"] > 0
    assert info["compiled"] < 3 + 3 + 1  # not one per learning rate


# ---------------------------------------------------------------------------------- sizes


def test_hostile_sizes_are_refused_before_anything_runs(tmp_path):
    svc = make(tmp_path)
    sid = svc.create_session({"rank": 2})["session"]
    session = svc.session(sid)
    before = snapshot(session)
    long = PackedBatch(*(np.ones((1, 4096), np.int32),) * 3)  # 4,096 tokens on 64 positions
    refused(
        lambda: svc.forward_backward(
            sid, {"batch": materialize(encode_batch(long)), "loss_fn": "causal_lm"}
        ),
        "batch.ids",
    )
    P, G, N, L = 1, 2, 40, 30  # prompt 30 + completion 40 > 64
    rows = LossRows(
        prompt_ids=np.full((P, L), 4, np.int32),
        prompt_mask=np.ones((P, L), np.int32),
        tokens=np.full((P, G, N), 5, np.int32),
        mask=np.ones((P, G, N), np.int32),
        loss_mask=np.ones((P, G, N), np.int32),
        old_logprobs=np.zeros((P, G, N), np.float32),
        advantages=np.zeros((P, G), np.float32),
    )
    refused(
        lambda: svc.forward_backward(
            sid, {"batch": materialize(encode_batch(rows)), "loss_fn": "grpo"}
        ),
        "batch.tokens",
    )
    assert "--limits.max-lora-rank" in refused(
        lambda: svc.create_session({"rank": 200_000}), "rank", 413
    )
    refused(lambda: svc.create_session({"rank": 1024}), "rank", 413)  # 100 of them: none
    prompt = np.array([4, 5], np.int32)
    request = {"model_path": "base", "prompts": [prompt], "num_samples": 200_000}
    assert "--limits.max-samples" in refused(lambda: svc.sample(request), "num_samples", 413)
    request = {"model_path": "base", "prompts": [prompt] * 4097}
    refused(lambda: svc.sample(request), "prompts", 413)
    assert list(svc.sessions) == [sid] and svc.bounds.programs.compiles == 0
    assert session.pending is None
    unchanged(session, before)


@pytest.mark.slow
def test_sessions_tokens_and_memory_have_limits(tmp_path):
    svc = make(tmp_path, max_sessions=2, max_tokens=256)
    first = svc.create_session({"rank": 2})["session"]
    svc.create_session({"rank": 1})
    assert "--limits.max-sessions" in refused(lambda: svc.create_session({}), "session", 429)
    svc.close_session(first)
    second = svc.create_session({"rank": 2})["session"]  # closing one frees its place
    many = datums(3, count=20)  # 32 rows of 16 positions: 512 > 256
    refused(
        lambda: svc.forward_backward(second, {"data": many, "loss_fn": "cross_entropy"}),
        "data",
        413,
    )
    tight = make(tmp_path / "m")
    tight.bounds = dataclasses.replace(tight.bounds, devices=(Device(40 << 20),))
    sid = tight.create_session({"rank": 2})["session"]

    def packed(rows: int) -> dict:
        batch = PackedBatch(*(np.full((rows, 64), 5, np.int32),) * 3)
        return {"batch": materialize(encode_batch(batch)), "loss_fn": "causal_lm"}

    message = refused(lambda: tight.forward_backward(sid, packed(2560)), "batch", 413)
    assert "floor" in message and "--limits.memory-mb" in message  # ~50 MiB before compiling
    assert tight.bounds.programs.compiles == 0
    message = refused(lambda: tight.forward_backward(sid, packed(512)), "batch", 413)
    assert "by XLA's count" in message  # a 10 MiB floor, ~68 MiB compiled: refused before it runs
    assert tight.bounds.programs.compiles == 1 and tight.session(sid).pending is None
    tight.forward_backward(sid, {"data": datums(3), "loss_fn": "cross_entropy"})
    assert tight.session(sid).pending is not None


class Device:
    """A device that reports its memory as an accelerator does (``memory_stats``)."""

    def __init__(self, free: int):
        self.free = free

    def memory_stats(self) -> dict:
        return {"bytes_limit": 10 << 30, "bytes_in_use": (10 << 30) - self.free}


def test_free_memory_from_cgroups_and_devices(tmp_path, monkeypatch):
    cgroup = tmp_path / "cgroup"
    (cgroup / "user" / "job").mkdir(parents=True)
    (cgroup / "user" / "memory.max").write_text("3000000000\n")  # the ancestor's limit binds
    (cgroup / "user" / "memory.current").write_text("2000000000\n")
    (cgroup / "user" / "memory.stat").write_text("anon 1\ninactive_file 100000000\n")
    (cgroup / "user" / "job" / "memory.max").write_text("max\n")
    (cgroup / "user" / "job" / "memory.current").write_text("5\n")
    proc = tmp_path / "cgroup-file"
    proc.write_text("0::/user/job\n")
    assert free_memory.cgroup_free(cgroup, proc) == 1_100_000_000
    v1 = tmp_path / "v1" / "memory" / "docker"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2500000000")
    (v1 / "memory.usage_in_bytes").write_text("2400000000")
    (v1.parent / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "no limit"
    (v1.parent / "memory.usage_in_bytes").write_text("1")
    proc.write_text("4:memory:/docker\n1:cpu:/\n")
    assert free_memory.cgroup_free(tmp_path / "v1", proc) == 100_000_000

    devices = [Device(4 << 30), Device(2 << 30)]
    assert free_memory.free_bytes(devices, None)[0] == 2 << 30
    memory.check_fits("prompts", 3 << 30, devices, None, "a sample")  # 1.5 GiB each: fits
    with pytest.raises(Exception, match="needs 2,048 MiB per device") as e:
        memory.check_fits("prompts", 4 << 30, devices, None, "a sample")
    assert e.value.status == 413 and e.value.field == "prompts"
    with pytest.raises(Exception, match="--limits.memory-mb"):  # the lower limit counts
        memory.check_fits("prompts", 1 << 30, devices, (10 << 10) - 2000, "a sample")


# ---------------------------------------------------------------------------------- values


def test_hostile_numbers_are_refused_naming_the_field(served):
    svc, sid = served
    session = svc.session(sid)
    before, sessions = snapshot(session), dict(svc.sessions)
    adam = {
        "learning_rate": [1e300, 1e38, 0.0, -1e-4, math.nan],  # 1e300: inf in float32
        "weight_decay": [1e300, 2e4],  # 2e4 x 1e-4 = 2: the decay overshoots
        "eps": [1e-320, 0.0],  # 0 in float32
        "beta2": [0.99999999, 1.0],  # 1 in float32
        "beta1": [-0.1, math.inf],
        "max_grad_norm": [0.0, 1e-45],
    }
    for name, values in adam.items():
        for v in values:
            message = refused(
                lambda: svc.optim_step(sid, {"adam_params": {name: v}}), f"adam_params.{name}"
            )
            assert "float32" in message or "must be" in message
    sample = {"model_path": "base", "prompts": [np.array([4, 5], np.int32)]}
    for k, v in (
        ("temperature", math.nan),
        ("temperature", -1.0),
        ("temperature", 1e39),
        ("top_p", 0.0),
        ("top_p", math.nan),
        ("seed", 2**64 - 1),
        ("seed", -1),
        ("max_tokens", 10_000),
        ("top_k", 2**40),
    ):
        refused(lambda: svc.sample({**sample, "sampling_params": {k: v}}), f"sampling_params.{k}")
    for k, v in (
        ("alpha", math.nan),
        ("alpha", -16.0),
        ("dropout", math.nan),
        ("seed", 2**64 - 1),
        ("seed", -1),
        ("rank", True),
        ("use_rslora", "yes"),
        ("target_modules", [1]),
        ("vision", True),  # text models only: no tower to adapt
        ("vision", "yes"),
    ):
        refused(lambda: svc.create_session({k: v}), k)
    config = {"data": datums(4), "loss_fn": "ppo"}
    refused(
        lambda: svc.forward_backward(sid, {**config, "loss_fn_config": {"delta": 1e300}}),
        "loss_fn_config.delta",
    )
    refused(
        lambda: svc.forward_backward(sid, {**config, "loss_fn_config": {b"delta": 2.0}}),
        "loss_fn_config",
    )  # mixed str / bytes keys
    refused(lambda: svc.create_session({b"rank": 4, "seed": 1}), "body")
    refused(lambda: svc.load_state(sid, {"path": "states/x\0y"}), "path")
    refused(lambda: svc.create_session_from_state({"path": "\0"}), "path")
    refused(lambda: svc.save_state(sid, {"name": "a\0b"}), "name")
    refused(lambda: svc.sample({**sample, "model_path": "session:s1/sampler/\0"}), "model_path")
    huge = datums(5, advantage=1e30)  # finite, but the gradient's norm is not in float32
    refused(
        lambda: svc.forward_backward(sid, {"data": huge, "loss_fn": "importance_sampling"}), "data"
    )
    assert svc.sessions == sessions and not (svc.root / "states").exists()
    unchanged(session, before)
    assert np.isfinite(svc.optim_step(sid, {"adam_params": {}})["metrics"]["grad_norm"])


def test_non_finite_step_is_refused_and_the_session_kept_bit_for_bit(served):
    svc, sid = served
    session = svc.session(sid)
    svc.forward_backward(sid, {"data": datums(6), "loss_fn": "cross_entropy"})
    good = session.pending
    leaves, treedef = jax.tree.flatten(good)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.inf)  # as if an overflow got through
    session.pending = jax.tree.unflatten(treedef, leaves)
    before = snapshot(session)
    message = refused(lambda: svc.optim_step(sid, {"adam_params": {}}), "adam_params", 422)
    assert "the session is unchanged" in message
    unchanged(session, before)
    session.pending = good
    step = int(session.state.step)
    assert svc.optim_step(sid, {"adam_params": {}})["metrics"]["step"] == step + 1


def test_every_lora_option_is_checked():
    from dataclasses import fields

    assert set(_LORA_CHECKS) == {f.name for f in fields(LoRAConfig)}


# ---------------------------------------------------------------------------------- files


def test_a_failed_save_leaves_nothing_and_keeps_its_name(served, monkeypatch):
    import relax.serve.service as service_module

    svc, sid = served
    real = service_module.save_adapter

    def full_disk(policy, path, **kwargs):
        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_model.safetensors").write_bytes(b"\0" * 1024)  # half written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(service_module, "save_adapter", full_disk)
    message = refused(lambda: svc.save_weights(sid, {"name": "w1"}), "name", 507)
    assert "the name is free" in message
    assert list((svc.root / "weights").iterdir()) == []  # no partial directory, hidden or not
    monkeypatch.setattr(service_module, "save_adapter", real)
    path = Path(svc.save_weights(sid, {"name": "w1"})["path"])
    assert path.name == "w1" and (path / "adapter_config.json").is_file()
    assert [p.name for p in (svc.root / "weights").iterdir()] == ["w1"]


def test_a_failed_state_save_leaves_nothing(served, monkeypatch):
    """A disk that fills after the checkpoint is written, before its session file."""
    import json
    import types

    import relax.serve.service as service_module

    svc, sid = served

    def full_disk(obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(service_module, "json", types.SimpleNamespace(dumps=full_disk))
    refused(lambda: svc.save_state(sid, {"name": "st"}), "name", 507)
    assert list((svc.root / "states").iterdir()) == []
    monkeypatch.setattr(service_module, "json", json)
    path = svc.save_state(sid, {"name": "st"})["path"]
    assert svc.load_state(sid, {"path": path})["step"] == int(svc.session(sid).state.step)


# ---------------------------------------------------------------------------------- fuzz

HOSTILE = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63 - 1,
    1e300,
    -1e-320,
    math.nan,
    math.inf,
    "",
    "\0",
    "x" * 5000,
    b"\xff",
    [],
    [None, {"a": []}],
    {},
    {"a": {"b": [1.5]}},
    {1: 2},
    np.array([np.nan, 1.0]),
    np.zeros((2, 3), np.int64),
    np.zeros(0, np.float32),
    np.full(3, 2**40, np.int64),
]


def _mutations(rng, request: dict, depth: int = 0):
    """``request`` with one value (at any depth of its maps and lists) replaced by a hostile
    one, a key added, or a field dropped."""
    out = dict(request)
    key = list(out)[rng.integers(len(out))] if out else None
    r = rng.random()
    if key is None or r < 0.15:
        out[["seed", "rank", "name", "path", "x", "\0"][rng.integers(6)]] = HOSTILE[
            rng.integers(len(HOSTILE))
        ]
    elif r < 0.25:
        del out[key]
    elif isinstance(out[key], dict) and depth < 3 and rng.random() < 0.6:
        out[key] = _mutations(rng, out[key], depth + 1)
    elif isinstance(out[key], list) and out[key] and isinstance(out[key][0], dict):
        out[key] = [_mutations(rng, out[key][0], depth + 1), *out[key][1:]]
    else:
        out[key] = HOSTILE[rng.integers(len(HOSTILE))]
    return out


@pytest.mark.slow
def test_fuzzed_requests_are_answered_never_500(served):
    """Mutated requests to every operation: each answered 2xx or 4xx (``run``, the server's own
    mapping: a 500 is an unexpected exception), and the service still serves."""
    svc, sid = served
    svc.save_weights_for_sampler(sid, {"name": "fz"})
    templates = {
        "create_session": ({"rank": 2, "seed": 3, "alpha": 8.0, "target_modules": ["q_proj"]},),
        "optim_step": (sid, {"adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "eps": 1e-8}}),
        "sample": (
            {
                "model_path": f"session:{sid}/sampler/fz",
                "prompts": [np.array([4, 5, 6], np.int32)],
                "num_samples": 2,
                "sampling_params": {"max_tokens": 4, "temperature": 0.5, "seed": 1},
            },
        ),
        "forward_backward": (sid, {"data": datums(7), "loss_fn": "importance_sampling"}),
        "load_state": (sid, {"path": str(svc.root / "states" / "none")}),
        "save_weights": (sid, {"name": "fw", "format": "peft"}),
        "create_session_from_state": ({"path": "/etc"},),
    }
    rng = np.random.default_rng(56)
    statuses = []
    for i in range(240):
        op = list(templates)[i % len(templates)]
        *args, request = templates[op]
        request = _mutations(rng, request)
        status, out = run(lambda: getattr(svc, op)(*args, request))
        assert status in (200, 400, 404, 413, 422, 429, 507), (op, request, out)
        statuses.append(status)
        if op == "create_session" and status == 200:
            svc.close_session(out["session"])
        if op == "save_weights" and status == 200:
            import shutil

            shutil.rmtree(out["path"])
    assert statuses.count(200) > 10 and statuses.count(400) > 100
    assert svc.forward_backward(sid, {"data": datums(8), "loss_fn": "cross_entropy"})["metrics"]
