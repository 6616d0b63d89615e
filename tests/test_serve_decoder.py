"""The service's request decoder against hostile bodies (relax.serve.wire): every malformed body
a 400 (or 413) naming its field, arrays and typed batches that do not fit refused, decoding costs
no more than the in-flight budget charges, and a fuzz of every route's body over HTTP (random
and mutated msgpack): 2xx or 4xx, never a 500, and the server answers afterwards."""

from __future__ import annotations

import copy
import tracemalloc

import msgpack
import numpy as np
import pytest
from starlette.testclient import TestClient
from test_serve_http import TOKEN, MiB, local_client, service

from relax.serve.server import make_app
from relax.serve.wire import (
    MAX_VALUES,
    RequestError,
    decode_batch,
    decode_request,
    from_msgpack,
    to_msgpack,
)


def test_decode_costs_what_it_is_charged():
    """The budget's model of a body's cost, against what decoding it allocates (tracemalloc):
    arrays at most 2x their bytes beyond the body, small values at most ``VALUE_BYTES`` each."""
    arrays = to_msgpack({f"a{i}": np.ones(MiB // 4, np.float32) for i in range(4)})
    values = msgpack.packb({"x": [{} for _ in range(MAX_VALUES // 8)], "y": list(range(9**5))})
    for body in (arrays, values):
        charged = []
        tracemalloc.start()
        try:
            decode_request(body, charge=charged.append)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= 2 * len(body) + sum(charged), (len(body), peak, sum(charged))
    with pytest.raises(RequestError, match="more than") as e:
        decode_request(msgpack.packb({"x": [[] for _ in range(MAX_VALUES)]}))
    assert e.value.status == 413


# ------------------------------------------------------------------------------ decoder


def deep(levels: int):
    out: list = []
    for _ in range(levels):
        out = [out]
    return out


MALFORMED = [  # (body, the field named, what the message says)
    (b"", "body", "not a msgpack body"),
    (b"\xc1", "body", "not a msgpack body"),
    (to_msgpack({"rank": 4})[:-1], "body", "not a msgpack body"),
    (to_msgpack({"rank": 4}) + b"\x00", "body", "not a msgpack body"),
    (to_msgpack([1, 2]), "body", "must be a map, got a list"),
    (to_msgpack(7), "body", "must be a map"),
    (
        to_msgpack({"__ndarray__": "int32", "shape": [1], "data": b"\0" * 4}),
        "body",
        "must be a map",
    ),
    (msgpack.packb({1: 2}), "body", "not a msgpack body"),
    (msgpack.packb({"a": 1, b"b": 2}), "body", "map key must be a string"),
    (msgpack.packb({"a": {b"a": 1}}), "a", "map key must be a string"),
    (msgpack.packb({"a": msgpack.ExtType(5, b"x")}), "body", "extension type 5"),
    (msgpack.packb({"a": msgpack.Timestamp(0)}), "a", "Timestamp"),
    (msgpack.packb({"seed": 2**64 - 1}), "seed", "beyond int64"),
    (msgpack.packb({"p": {"lr": float("nan")}}), "p.lr", "not a finite float32"),
    (msgpack.packb({"p": [0.1, float("inf")]}), "p[1]", "not a finite float32"),
    (msgpack.packb({"p": 1e300}), "p", "not a finite float32"),
    (msgpack.packb({"name": "a\0b"}), "name", "NUL"),
    (msgpack.packb({"a\0": 1}), "body", "NUL"),
    (msgpack.packb({"x": deep(40)}), "x" + "[0]" * 31, "nested deeper than 32"),
    (b"\x81\xa1x" + b"\x91" * 5000 + b"\xc0", "body", "nested too deep"),
    (
        msgpack.packb({"x": {"__ndarray__": "float32", "shape": [2**40, 2**40, 0], "data": b""}}),
        "x",
        "too large",
    ),
    (
        msgpack.packb({"x": {"__ndarray__": "int8", "shape": [1] * 40, "data": b"\0"}}),
        "x",
        "at most 32",
    ),
    (msgpack.packb({"x": {"__ndarray__": "int8", "shape": [True], "data": b"\0"}}), "x", "a shape"),
    (msgpack.packb({"x": {"__ndarray__": ["int8"], "shape": [1], "data": b"\0"}}), "x", "dtype"),
    (
        msgpack.packb({"d": [{"t": {"__ndarray__": "int32", "shape": [2], "data": b"\0"}}]}),
        "d[0].t",
        "needs 8 bytes",
    ),
]


@pytest.mark.parametrize("body,field,match", MALFORMED, ids=[m for _, _, m in MALFORMED])
def test_malformed_bodies_are_refused_naming_the_field(body, field, match):
    with pytest.raises(RequestError, match=match) as e:
        decode_request(body)
    assert e.value.field == field and e.value.status in (400, 413)


def test_malformed_arrays_and_batches_are_refused():
    ok = decode_request(
        msgpack.packb({"m": {"__ndarray__": "bool", "shape": [3], "data": b"\0\1\7"}})
    )
    assert ok["m"].dtype == bool and ok["m"].tolist() == [False, True, True]
    rows = {
        "prompt_ids": np.ones((1, 2), np.int64),
        "prompt_mask": np.ones((1, 2), np.int32),
        "tokens": np.full((1, 1, 2), 2**40, np.int64),
        "mask": np.ones((1, 1, 2), np.int32),
        "loss_mask": np.ones((1, 1, 2), np.int32),
        "old_logprobs": np.zeros((1, 1, 2), np.float64),
        "advantages": np.zeros((1, 1), np.float32),
    }
    with pytest.raises(RequestError, match="beyond int32") as e:
        decode_batch({"type": "LossRows", "fields": rows}, "batch")
    assert e.value.field == "batch.tokens"
    rows["tokens"] = np.ones((1, 1, 2), np.int64)
    rows["old_logprobs"] = np.full((1, 1, 2), 1e300)  # finite in float64, inf in float32
    with pytest.raises(RequestError, match="non-finite") as e:
        decode_batch({"type": "LossRows", "fields": rows}, "batch")
    assert e.value.field == "batch.old_logprobs"
    for kind in (["LossRows"], {"a": 1}, None, 3):
        with pytest.raises(RequestError, match="unknown batch type") as e:
            decode_batch({"type": kind, "fields": {}}, "batch")
        assert e.value.field == "batch.type"


# --------------------------------------------------------------------------------- fuzz


def valid_bodies(client: TestClient, tag: str) -> list[tuple[str, dict]]:
    """A valid body for every route, on a session and a saved state made for them."""
    sid = from_msgpack(
        client.post("/v1/sessions", content=to_msgpack({"rank": 4, "seed": 1})).content
    )["session"]
    state = from_msgpack(
        client.post(
            f"/v1/sessions/{sid}/save_state", content=to_msgpack({"name": f"s0{tag}"})
        ).content
    )["path"]
    snap = from_msgpack(
        client.post(
            f"/v1/sessions/{sid}/save_weights_for_sampler", content=to_msgpack({"name": f"p0{tag}"})
        ).content
    )["path"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 16, 9).astype(np.int32)
    datum = {
        "tokens": tokens[:-1],
        "inputs": {
            "target_tokens": tokens[1:],
            "weights": np.ones(8, np.float32),
            "logprobs": np.full(8, -1.0, np.float32),
            "advantages": np.linspace(-1, 1, 8).astype(np.float32),
        },
    }
    loss = {"data": [datum, datum], "loss_fn": "importance_sampling", "loss_fn_config": {}}
    rows = {
        "type": "LossRows",
        "fields": {
            "prompt_ids": np.full((1, 4), 5, np.int32),
            "prompt_mask": np.ones((1, 4), np.int32),
            "tokens": np.full((1, 2, 4), 6, np.int32),
            "mask": np.ones((1, 2, 4), np.int32),
            "loss_mask": np.ones((1, 2, 4), np.int32),
            "old_logprobs": np.full((1, 2, 4), -1.0, np.float32),
            "advantages": np.array([[1.0, -1.0]], np.float32),
        },
    }
    s = f"/v1/sessions/{sid}"
    return [
        ("/v1/sessions", {"rank": 2, "seed": 3, "alpha": 4.0}),
        ("/v1/sessions/from_state", {"path": state}),
        (f"{s}/forward_backward", loss),
        (f"{s}/forward", {**loss, "loss_fn": "cross_entropy"}),
        (
            f"{s}/forward_backward",
            {"batch": rows, "loss_fn": "grpo", "loss_fn_config": {"beta": 0.0}},
        ),
        (
            f"{s}/optim_step",
            {
                "adam_params": {
                    "learning_rate": 1e-3,
                    "beta1": 0.9,
                    "beta2": 0.95,
                    "eps": 1e-8,
                    "weight_decay": 0.0,
                    "max_grad_norm": 1.0,
                }
            },
        ),
        (f"{s}/save_state", {"name": f"s1{tag}"}),
        (f"{s}/load_state", {"path": state}),
        (f"{s}/save_weights", {"name": f"w1{tag}", "format": "peft"}),
        (f"{s}/save_weights_for_sampler", {"name": f"p1{tag}"}),
        (
            "/v1/sample",
            {
                "model_path": snap,
                "num_samples": 2,
                "prompts": [np.array([5, 6, 7], np.int32)],
                "sampling_params": {
                    "max_tokens": 4,
                    "temperature": 1.0,
                    "top_k": -1,
                    "top_p": 1.0,
                    "seed": 1,
                },
            },
        ),
        (f"{s}/close", {}),
    ]


POOL = [
    None,
    True,
    -1,
    0,
    3,
    2**31,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1e300,
    1e-320,
    float("nan"),
    float("-inf"),
    "",
    "\0",
    "x" * 300,
    "../../etc",
    b"\0\xff",
    [],
    {},
    [1, "a", None],
    {"__ndarray__": "float32", "shape": [2**40, 2**40], "data": b""},
    {"__ndarray__": "object", "shape": [1], "data": b"\0" * 8},
    np.zeros((2, 3), np.float64),
    np.zeros(0, np.int32),
    np.full(3, 2**40, np.int64),
    np.full(8, np.nan, np.float32),
    np.ones((1, 1, 1, 1), np.int8),
    msgpack.ExtType(7, b"x"),
    deep(40),
]


def paths(tree, at=()):
    yield at
    items = (
        tree.items()
        if isinstance(tree, dict)
        else enumerate(tree)
        if isinstance(tree, list)
        else ()
    )
    for key, value in items:
        yield from paths(value, (*at, key))


def mutate(body: dict, rng: np.random.Generator) -> bytes:
    """``body`` mutated in its structure (a value replaced, removed or added; an array's dtype,
    shape or values changed) or in its bytes (flipped, inserted, deleted, cut)."""
    if rng.random() < 0.35:
        raw = bytearray(to_msgpack(body))
        for _ in range(int(rng.integers(1, 4))):
            if not raw:
                break
            i, op = int(rng.integers(len(raw))), rng.integers(4)
            if op == 0:
                raw[i] ^= 1 << int(rng.integers(8))
            elif op == 1:
                raw[i:i] = rng.bytes(int(rng.integers(1, 9)))
            elif op == 2:
                del raw[i : i + int(rng.integers(1, 9))]
            else:
                del raw[i:]
                break
        return bytes(raw)
    body = copy.deepcopy(body)
    where = list(paths(body))
    at = where[int(rng.integers(len(where)))]
    if not at:
        body[f"extra{rng.integers(9)}"] = POOL[int(rng.integers(len(POOL)))]
        return to_msgpack(body)
    parent = body
    for key in at[:-1]:
        parent = parent[key]
    key, value, op = at[-1], parent[at[-1]], rng.integers(4)
    if op == 0:
        parent[key] = POOL[int(rng.integers(len(POOL)))]
    elif op == 1:
        del parent[key]
    elif op == 2 and isinstance(value, np.ndarray):
        kind = rng.integers(3)
        if kind == 0:
            parent[key] = value.astype(rng.choice(["float64", "int64", "bool", "uint8", "float16"]))
        elif kind == 1:
            parent[key] = value.reshape(-1)[: int(rng.integers(value.size + 1))]
        else:
            parent[key] = value * rng.choice([-1, 1e30, 2**20, 0])
    elif isinstance(parent, dict):
        parent[f"extra{rng.integers(9)}"] = POOL[int(rng.integers(len(POOL)))]
    else:
        parent.append(POOL[int(rng.integers(len(POOL)))])
    return to_msgpack(body)


def fuzz(tmp_path, cases: int, seed: int) -> list[tuple[str, bytes, int, str]]:
    svc = service(tmp_path)
    with local_client(make_app(svc, token=TOKEN)) as client:
        for path, body in valid_bodies(
            client, "a"
        ):  # every route's body as it is: taken (close: last)
            response = client.post(path, content=to_msgpack(body))
            assert response.status_code == 200, (path, from_msgpack(response.content))
        bodies = valid_bodies(client, "b")[:-1]  # not close: the session stays for the rest
        rng = np.random.default_rng(seed)
        failures = []
        for _ in range(cases):
            path, body = bodies[int(rng.integers(len(bodies)))]
            raw = mutate(body, rng)
            response = client.post(path, content=raw)
            if not (200 <= response.status_code < 300 or 400 <= response.status_code < 500):
                failures.append((path, raw, response.status_code, response.content[:300]))
        assert client.get("/v1/info").status_code == 200
    return failures


@pytest.mark.slow
def test_fuzz_every_route_answers_2xx_or_4xx(tmp_path):
    failures = fuzz(tmp_path, cases=300, seed=0)
    assert not failures, "\n".join(f"{p} {s} {c!r} body={r[:200]!r}" for p, r, s, c in failures)


@pytest.mark.slow
def test_fuzz_every_route_answers_2xx_or_4xx_long(tmp_path):
    failures = fuzz(tmp_path, cases=3000, seed=1)
    assert not failures, "\n".join(f"{p} {s} {c!r} body={r[:200]!r}" for p, r, s, c in failures)
