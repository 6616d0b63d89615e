"""The training service (relax.serve): the wire format, Tinker's datum losses against numpy, named
objectives equal to the in-process call, bad requests refused with the field named and the
session untouched, independent and deterministic sessions, save / restart / load, weights in
PEFT and Hugging Face form, and the HTTP server itself (token, routes, a client that leaves)."""

from __future__ import annotations

import socket
import threading
import time

import equinox as eqx
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import uvicorn

from relax.algorithms.online.batch import LossRows
from relax.data.pairs import PairBatch
from relax.models import ModelConfig, init
from relax.models.adapters.operations import merge_lora
from relax.models.adapters.peft import load_adapter
from relax.models.decoder.transformer import hidden_states, project
from relax.models.hf.checkpoint import load_pretrained
from relax.models.layers.lora import LoRAConfig
from relax.serve import objectives
from relax.serve.client import LocalServiceClient, ServiceClient, ServiceError
from relax.serve.server import ServeConfig, check_binding, check_parallel, make_app
from relax.serve.service import Service, ServiceConfig
from relax.serve.types import AdamParams, Datum, ModelInput, SamplingParams
from relax.serve.wire import RequestError, decode_batch, encode_batch, from_msgpack, to_msgpack

CFG = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    eos_token_id=3,
)
BASE = init(CFG, jax.random.key(0), std=0.3)


def service(tmp_path, rank: int = 4) -> Service:
    return Service(
        BASE, None, ServiceConfig(model="tiny", state_dir=str(tmp_path), lora=LoRAConfig(rank=rank))
    )


def datums(seed: int, count: int = 3) -> list[Datum]:
    """Random sequences of lengths 4..9 with every loss input (advantages 0 on a 2-token prompt)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(4, 10))
        tokens = rng.integers(4, 16, n + 1)
        adv = np.where(np.arange(n) < 2, 0.0, rng.normal(size=n)).astype(np.float32)
        out.append(
            Datum(
                ModelInput.from_ints(tokens[:-1]),
                {
                    "target_tokens": tokens[1:],
                    "weights": (np.arange(n) >= 2).astype(np.float32),
                    "logprobs": (-rng.uniform(0.5, 3.0, n)).astype(np.float32),
                    "advantages": adv,
                },
            )
        )
    return out


def adapters(client_session) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(client_session.state.policy.layers.lora)]


def reference_logp(policy, datum: Datum) -> np.ndarray:
    """log pi(target_t | tokens_<=t) from the unpacked forward, log-softmax in numpy (float64)."""
    ids = jnp.asarray([datum.model_input.tokens])
    logits = np.asarray(project(policy, hidden_states(policy, ids)), np.float64)[0]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return logits[np.arange(len(logits)), datum.loss_fn_inputs["target_tokens"]] - logz


# ---------------------------------------------------------------------------------------- wire


def test_wire_round_trip_and_refusals():
    for dtype in ("bool", "int32", "int64", "uint8", "float16", "float32", "float64"):
        a = (np.arange(12).reshape(3, 4) % 3).astype(dtype)
        b = from_msgpack(to_msgpack({"a": a}))["a"]
        assert b.dtype == a.dtype and np.array_equal(a, b)
    with pytest.raises(RequestError, match="not a msgpack body") as e:
        from_msgpack(b"\xc1\x00")
    assert e.value.field == "body"
    with pytest.raises(RequestError, match="needs 48 bytes"):
        from_msgpack(
            to_msgpack({"x": {"__ndarray__": "float32", "shape": [3, 4], "data": b"\0" * 8}})
        )
    with pytest.raises(RequestError, match="dtype 'object'"):
        from_msgpack(to_msgpack({"x": {"__ndarray__": "object", "shape": [1], "data": b"\0" * 8}}))
    P, G, N, L = 2, 3, 4, 5
    rows = LossRows(
        prompt_ids=np.ones((P, L), np.int32),
        prompt_mask=np.ones((P, L), np.int32),
        tokens=np.ones((P, G, N), np.int32),
        mask=np.ones((P, G, N), np.int32),
        loss_mask=np.ones((P, G, N), np.int32),
        old_logprobs=np.zeros((P, G, N), np.float32),
        advantages=np.zeros((P, G), np.float32),
    )
    back = decode_batch(from_msgpack(to_msgpack(encode_batch(rows))), "batch")
    assert type(back) is LossRows and back.advantages.shape == (P, G) and back.ref_logprobs is None

    def refused(field: str, value, match: str) -> None:
        wire = from_msgpack(to_msgpack(encode_batch(rows)))
        wire["fields"][field] = value
        with pytest.raises(RequestError, match=match) as e:
            decode_batch(wire, "batch")
        assert e.value.field == f"batch.{field}"

    refused(
        "mask", np.ones((P, G, N + 1), np.int32), r"dimension 'n' is 5 here but 4 in batch.tokens"
    )
    refused("tokens", np.ones((P, G), np.int32), r"needs 3 dimensions")
    refused("tokens", np.ones((P, G, N), np.float32), r"integer values")
    nan = np.zeros((P, G), np.float32)
    nan[1, 2] = np.nan
    refused("advantages", nan, r"1 non-finite value\(s\), first at index \[1, 2\]")
    refused("rope", np.ones(3, np.float32), "computed by the service")
    pairs = PairBatch(
        prompt_ids=np.ones((P, L), np.int32),
        prompt_mask=np.ones((P, L), np.int32),
        tokens=np.ones((P, 2, N), np.int32),
        mask=np.ones((P, 2, N), np.int32),
        ref_logps=np.zeros((P, 2), np.float32),
    )
    assert decode_batch(from_msgpack(to_msgpack(encode_batch(pairs))), "batch").ref_logps.shape == (
        P,
        2,
    )
    wire = from_msgpack(to_msgpack(encode_batch(pairs)))
    wire["fields"]["tokens"] = np.ones((P, 3, N), np.int32)
    with pytest.raises(RequestError, match="a dimension of size 2 is 3 here"):
        decode_batch(wire, "batch")
    wire = from_msgpack(to_msgpack(encode_batch(rows)))
    del wire["fields"]["tokens"]
    with pytest.raises(RequestError, match="needs this field"):
        decode_batch(wire, "batch")
    with pytest.raises(RequestError, match="unknown batch type 'Pickle'"):
        decode_batch({"type": "Pickle", "fields": {}}, "batch")


# ---------------------------------------------------------------------------- losses


@pytest.mark.slow
def test_datum_losses_equal_numpy(tmp_path):
    client = LocalServiceClient(service(tmp_path))
    trainer = client.create_lora_training_client(rank=4, seed=3)
    policy = client._service.session(trainer.session).state.policy
    data = datums(0)
    ref = [reference_logp(policy, d) for d in data]
    out = trainer.forward(data, "cross_entropy").result()
    for o, r in zip(out.loss_fn_outputs, ref):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), r, rtol=1e-4, atol=1e-5)
    want = -sum((d.loss_fn_inputs["weights"] * r).sum() for d, r in zip(data, ref))
    np.testing.assert_allclose(out.metrics["loss"], want, rtol=1e-4)
    # importance sampling: -sum (p / q) A
    want = -sum(
        (np.exp(r - d.loss_fn_inputs["logprobs"]) * d.loss_fn_inputs["advantages"]).sum()
        for d, r in zip(data, ref)
    )
    np.testing.assert_allclose(
        trainer.forward(data, "importance_sampling").result().metrics["loss"], want, rtol=1e-4
    )
    # PPO with Tinker's ratio bounds: -sum min(r A, clip(r, 0.9, 1.1) A)
    want = 0.0
    for d, r in zip(data, ref):
        ratio, a = np.exp(r - d.loss_fn_inputs["logprobs"]), d.loss_fn_inputs["advantages"]
        want -= np.minimum(ratio * a, np.clip(ratio, 0.9, 1.1) * a).sum()
    got = trainer.forward(
        data, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    ).result()
    np.testing.assert_allclose(got.metrics["loss"], want, rtol=1e-4)


@pytest.mark.slow
def test_gradients_sum_over_calls(tmp_path):
    """Datum losses are sums: the batch in two calls accumulates the gradient of the batch in one."""
    svc = service(tmp_path)
    client = LocalServiceClient(svc)
    one, two = (client.create_lora_training_client(rank=4, seed=1) for _ in range(2))
    data = datums(1, 4)
    one.forward_backward(data, "importance_sampling").result()
    two.forward_backward(data[:1], "importance_sampling").result()
    two.forward_backward(data[1:], "importance_sampling").result()
    a, b = (jax.tree.leaves(svc.session(t.session).pending) for t in (one, two))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    assert np.abs(np.asarray(a[-1])).max() > 0


@pytest.mark.slow
def test_named_objective_equals_in_process(tmp_path):
    svc = service(tmp_path)
    client = LocalServiceClient(svc)
    trainer = client.create_lora_training_client(rank=4, seed=2)
    rng = np.random.default_rng(0)
    P, G, N, L = 2, 4, 5, 6
    mask = (np.arange(N) < rng.integers(2, N + 1, (P, G, 1))).astype(np.int32)
    rows = LossRows(
        prompt_ids=rng.integers(4, 16, (P, L)).astype(np.int32),
        prompt_mask=np.ones((P, L), np.int32),
        tokens=rng.integers(4, 16, (P, G, N)).astype(np.int32) * mask,
        mask=mask,
        loss_mask=mask,
        old_logprobs=(-rng.uniform(0.5, 3, (P, G, N)) * mask).astype(np.float32),
        advantages=rng.normal(size=(P, G)).astype(np.float32),
    )
    got = trainer.forward_backward(rows, "grpo", {"loss_type": "token-mean"}).result().metrics
    state = svc.session(trainer.session).state
    grads, want = objectives.objective_forward_backward(
        state, jax.tree.map(jnp.asarray, rows), "grpo", loss_type="token-mean"
    )
    assert set(want) <= set(got)
    for k in want:
        np.testing.assert_allclose(got[k], float(want[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    for x, y in zip(jax.tree.leaves(svc.session(trainer.session).pending), jax.tree.leaves(grads)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    pmask = (np.arange(N) < rng.integers(2, N + 1, (P, 2, 1))).astype(np.int32)
    pairs = PairBatch(
        prompt_ids=rows.prompt_ids,
        prompt_mask=rows.prompt_mask,
        tokens=rng.integers(4, 16, (P, 2, N)).astype(np.int32) * pmask,
        mask=pmask,
        ref_logps=-rng.uniform(2, 6, (P, 2)).astype(np.float32),
    )
    got = trainer.forward(pairs, "dpo", {"beta": 0.1}).result().metrics
    _, want = objectives.objective_forward_backward(
        state, jax.tree.map(jnp.asarray, pairs), "dpo", beta=0.1
    )
    for k in want:
        np.testing.assert_allclose(got[k], float(want[k]), rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.slow
def test_grouped_rows_read_what_datums_read(tmp_path):
    """A sampled group as prefix-shared LossRows: the trainer's log-probs of each completion equal the
    datum layout's (each sequence whole) and the sampler's; the objective runs on it over the wire."""
    from relax.serve.client import grouped_rows
    from relax.train.primitives import logprobs

    svc = service(tmp_path)
    client = LocalServiceClient(svc)
    trainer = client.create_lora_training_client(rank=4, seed=5)
    sampler = trainer.save_weights_and_get_sampling_client("s")
    prompts = [[5, 6, 7], [8, 4, 9, 10, 11]]
    responses = sampler.sample_many(
        [ModelInput.from_ints(p) for p in prompts], 3, SamplingParams(max_tokens=5, seed=2)
    ).result()
    rows = grouped_rows(prompts, responses, np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5)
    assert rows.tokens.shape == (2, 3, 16) and rows.prompt_ids.shape == (2, 16)
    state = svc.session(trainer.session).state
    trained = np.asarray(
        logprobs(
            state,
            {
                k: jnp.asarray(getattr(rows, k))
                for k in ("prompt_ids", "prompt_mask", "tokens", "mask")
            },
        )
    )
    data = [
        Datum(
            ModelInput.from_ints(p + s.tokens[:-1]),
            {
                "target_tokens": np.asarray(p[1:] + s.tokens),
                "weights": np.ones(len(p) + len(s.tokens) - 1, np.float32),
            },
        )
        for p, r in zip(prompts, responses)
        for s in r.sequences
    ]
    outputs = trainer.forward(data, "cross_entropy").result().loss_fn_outputs
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for j, seq in enumerate(r.sequences):
            k = len(seq.tokens)
            whole = outputs[3 * i + j]["logprobs"].to_numpy()[len(p) - 1 :]
            np.testing.assert_allclose(trained[i, j, :k], whole, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(trained[i, j, :k], seq.logprobs, rtol=1e-4, atol=1e-4)
    got = trainer.forward_backward(rows, "importance_sampling").result().metrics
    _, want = objectives.objective_forward_backward(
        state, jax.tree.map(jnp.asarray, rows), "importance_sampling"
    )
    np.testing.assert_allclose(got["loss"], float(want["loss"]), rtol=1e-5)


@pytest.mark.slow
def test_ppo_with_a_value_head_over_the_service(tmp_path):
    """A session with a value head: PPO's joint loss by name (GAE inside from rewards) equals the
    in-process call; optim_step moves the head; save and restore bring it back."""
    svc = service(tmp_path)
    client = LocalServiceClient(svc)
    trainer = client.create_lora_training_client(rank=4, seed=6, value_head=True)
    rng = np.random.default_rng(1)
    P, G, N, L = 2, 3, 5, 4
    mask = (np.arange(N) < rng.integers(2, N + 1, (P, G, 1))).astype(np.int32)
    rows = objectives.ValueRows(
        prompt_ids=rng.integers(4, 16, (P, L)).astype(np.int32),
        prompt_mask=np.ones((P, L), np.int32),
        tokens=(rng.integers(4, 16, (P, G, N)) * mask).astype(np.int32),
        mask=mask,
        old_logprobs=(-rng.uniform(0.5, 3, (P, G, N)) * mask).astype(np.float32),
        rewards=rng.normal(size=(P, G)).astype(np.float32),
    )
    state = svc.session(trainer.session).state
    got = trainer.forward_backward(rows, "ppo", {"kl_coef": 0.0}).result().metrics
    _, want = objectives.objective_forward_backward(
        state, jax.tree.map(jnp.asarray, rows), "ppo", kl_coef=0.0
    )
    assert "explained_variance" in want and set(want) <= set(got)
    for k in want:
        np.testing.assert_allclose(got[k], float(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    head = np.asarray(state.critic.head)
    trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
    moved = svc.session(trainer.session).state.critic
    assert not np.array_equal(head, np.asarray(moved.head))
    resumed = client.create_training_client_from_state(trainer.save_state("vh").result().path)
    np.testing.assert_array_equal(
        np.asarray(svc.session(resumed.session).state.critic.head), np.asarray(moved.head)
    )


# ---------------------------------------------------------------------------- refusals


@pytest.mark.slow
def test_bad_requests_name_the_field_and_change_nothing(tmp_path):
    svc = service(tmp_path)
    client = LocalServiceClient(svc)
    trainer = client.create_lora_training_client(rank=4)
    data = datums(2)
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
    session = svc.session(trainer.session)
    before, step, loss = (
        adapters(session),
        int(session.state.step),
        trainer.forward(data, "cross_entropy").result(),
    )

    def refused(future_of, field: str, status: int = 400) -> None:
        with pytest.raises(ServiceError) as e:
            future_of().result()
        assert e.value.status == status and e.value.field == field, str(e.value)

    short = Datum(
        data[0].model_input, {**data[0].loss_fn_inputs, "advantages": np.zeros(2, np.float32)}
    )
    nan = Datum(
        data[0].model_input,
        {
            **data[0].loss_fn_inputs,
            "advantages": np.full(data[0].model_input.length, np.nan, np.float32),
        },
    )
    big = Datum(
        ModelInput.from_ints([1, 99]), {k: v[:2] for k, v in data[0].loss_fn_inputs.items()}
    )
    refused(lambda: trainer.forward_backward(data, "nope"), "loss_fn")
    pairs = PairBatch(
        prompt_ids=np.full((1, 3), 4, np.int32),
        prompt_mask=np.ones((1, 3), np.int32),
        tokens=np.full((1, 2, 2), 5, np.int32),
        mask=np.ones((1, 2, 2), np.int32),
    )
    refused(lambda: trainer.forward_backward(pairs, "reward_modeling"), "loss_fn")
    refused(
        lambda: trainer.forward_backward([short], "importance_sampling"),
        "data[0].loss_fn_inputs.advantages",
    )
    refused(
        lambda: trainer.forward_backward([data[1], nan], "importance_sampling"),
        "data[1].loss_fn_inputs.advantages",
    )
    refused(lambda: trainer.forward_backward([big], "cross_entropy"), "data[0].model_input")
    refused(lambda: trainer.forward_backward(data, "ppo", {"epsilon": 0.2}), "loss_fn_config")
    huge = [
        Datum(
            d.model_input,
            {**d.loss_fn_inputs, "advantages": np.full(d.model_input.length, 3e38, np.float32)},
        )
        for d in data
    ]
    refused(
        lambda: trainer.forward_backward(huge, "importance_sampling"), "data"
    )  # an infinite loss
    refused(
        lambda: (
            trainer.forward_backward(data, "cross_entropy")
            and trainer.optim_step(AdamParams(learning_rate=float("nan")))
        ),
        "adam_params.learning_rate",
    )
    # the accepted forward_backward above is pending; drop it with a fresh session view
    session.pending = None
    refused(lambda: trainer.optim_step(AdamParams()), "optim_step")
    refused(
        lambda: trainer.forward_backward(data, "ppo", {"epsilon_low": {"a": 1}}),
        "loss_fn_config.epsilon_low",
    )
    sampler = trainer.save_weights_and_get_sampling_client("snap")
    refused(
        lambda: sampler.sample_many([ModelInput.from_ints([4]), ModelInput.from_ints([])]),
        "prompts",
    )
    refused(
        lambda: sampler.sample(ModelInput.from_ints([4]), 1, SamplingParams(stop=("x",))),
        "sampling_params.stop[0]",
    )
    assert next(session.draws) == 0  # the refused samples drew nothing of the session's randomness
    refused(lambda: trainer.save_state("../escape"), "name")
    refused(lambda: trainer.load_state("/etc"), "path")
    refused(
        lambda: client.create_sampling_client(f"session:{trainer.session}/sampler/none").sample(
            ModelInput.from_ints([4])
        ),
        "model_path",
    )
    with pytest.raises(ServiceError) as e:
        client.call("POST", "/v1/sessions/s99/optim_step", {})
    assert e.value.status == 404
    assert int(session.state.step) == step and session.pending is None
    for x, y in zip(before, adapters(session)):
        np.testing.assert_array_equal(x, y)
    assert trainer.forward(data, "cross_entropy").result().metrics == loss.metrics


# ---------------------------------------------------------------------------- sessions


def train(trainer, seed: int, steps: int = 2) -> list[float]:
    losses = []
    for i in range(steps):
        fb = trainer.forward_backward(datums(seed + i), "importance_sampling")
        trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss"])
    return losses


@pytest.mark.slow
def test_sessions_are_independent_and_deterministic(tmp_path):
    alone = LocalServiceClient(service(tmp_path / "a"))
    solo = train(alone.create_lora_training_client(rank=4, seed=5), seed=10)
    svc = service(tmp_path / "b")
    client = LocalServiceClient(svc)
    a, b = (
        client.create_lora_training_client(rank=4, seed=5),
        client.create_lora_training_client(rank=2, seed=6),
    )
    b_before = adapters(svc.session(b.session))
    results = {}
    threads = [
        threading.Thread(target=lambda t=t, k=k, s=s: results.__setitem__(k, train(t, s)))
        for t, k, s in ((a, "a", 10), (b, "b", 20))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["a"] == solo  # bit for bit, whatever the other session did meanwhile
    assert svc.session(b.session).lora.rank == 2 and svc.session(a.session).lora.rank == 4
    assert any(not np.array_equal(x, y) for x, y in zip(b_before, adapters(svc.session(b.session))))
    base = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(BASE, eqx.is_array))]
    shared = svc.session(a.session).state.policy
    assert all(
        np.array_equal(x, y)
        for x, y in zip(
            base,
            jax.tree.leaves(
                eqx.filter(eqx.tree_at(lambda m: m.layers.lora, shared, None), eqx.is_array)
            ),
        )
    )


@pytest.mark.slow
def test_sampling(tmp_path):
    client = LocalServiceClient(service(tmp_path))
    trainer = client.create_lora_training_client(rank=4)
    sampler = trainer.save_weights_and_get_sampling_client("s0")
    params = SamplingParams(max_tokens=6, seed=7)
    r1 = sampler.sample(ModelInput.from_ints([5, 6, 7]), 4, params).result()
    assert len(r1.sequences) == 4
    for s in r1.sequences:
        assert len(s.tokens) == len(s.logprobs) <= 6 and all(lp <= 0 for lp in s.logprobs)
        assert s.stop_reason == ("stop" if 3 in s.tokens else "length")
        assert 3 not in s.tokens[:-1]
    train(trainer, seed=0, steps=1)
    # the snapshot samples as it was; the same seed draws the same tokens
    assert sampler.sample(ModelInput.from_ints([5, 6, 7]), 4, params).result() == r1
    many = sampler.sample_many(
        [ModelInput.from_ints([5, 6, 7]), ModelInput.from_ints([8])],
        2,
        SamplingParams(max_tokens=4, temperature=0.0),
    ).result()
    assert len(many) == 2 and all(len(r.sequences) == 2 for r in many)
    assert many[0].sequences[0] == many[0].sequences[1]  # greedy


# ---------------------------------------------------------------------------- files


@pytest.mark.slow
def test_save_state_survives_restart(tmp_path):
    client = LocalServiceClient(service(tmp_path))
    trainer = client.create_lora_training_client(rank=4, seed=4)
    train(trainer, seed=30)
    path = trainer.save_state("after2").result().path
    with pytest.raises(ServiceError, match="never overwritten") as e:
        trainer.save_state("after2").result()
    assert e.value.field == "name"
    data = datums(40)
    loss = trainer.forward(data, "importance_sampling").result().metrics
    next_steps = train(trainer, seed=50)

    restarted = LocalServiceClient(
        service(tmp_path)
    )  # a new process's service over the same directory
    resumed = restarted.create_training_client_from_state(path)
    with pytest.raises(
        ServiceError
    ) as e:  # an id from before the restart names no session, not another's
        restarted.call("POST", f"/v1/sessions/{trainer.session}/optim_step", {})
    assert e.value.status == 404 and resumed.session != trainer.session
    assert resumed.forward(data, "importance_sampling").result().metrics == loss
    assert train(resumed, seed=50) == next_steps  # the optimizer state came back too
    other = restarted.create_lora_training_client(rank=2)
    with pytest.raises(ServiceError) as e:
        other.load_state(path).result()
    assert e.value.field == "path"


def test_save_weights_peft_and_hf(tmp_path):
    svc = service(tmp_path)
    client = LocalServiceClient(svc)
    trainer = client.create_lora_training_client(rank=4)
    train(trainer, seed=60)
    policy = svc.session(trainer.session).state.policy
    loaded = load_adapter(BASE, trainer.save_weights("peft").result().path)
    for x, y in zip(jax.tree.leaves(policy.layers.lora), jax.tree.leaves(loaded.layers.lora)):
        np.testing.assert_array_equal(x, y)
    merged = load_pretrained(trainer.save_weights("hf", format="hf").result().path)
    for x, y in zip(jax.tree.leaves(merge_lora(policy)), jax.tree.leaves(merged)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    svc = service(tmp_path_factory.mktemp("http"))
    server = uvicorn.Server(
        uvicorn.Config(
            make_app(svc, token="sesame"), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", svc
    server.should_exit = True
    thread.join(timeout=10)


def test_http_token_routes_and_errors(http_server):
    url, _ = http_server
    with pytest.raises(ServiceError) as e:
        ServiceClient(url, token="wrong").get_server_capabilities()
    assert e.value.status == 401
    client = ServiceClient(url, token="sesame")
    assert client.get_server_capabilities()["vocab_size"] == CFG.vocab_size
    with pytest.raises(ServiceError) as e:
        client.call("POST", "/v1/nowhere", {})
    assert e.value.status == 404
    bad = httpx.post(
        f"{url}/v1/sessions",
        content=b"\xc1",
        headers={"authorization": "Bearer sesame", "content-type": "application/msgpack"},
    )
    assert bad.status_code == 400 and from_msgpack(bad.content)["field"] == "body"
    trainer = client.create_lora_training_client(rank=4)
    out = trainer.forward_backward(datums(70), "cross_entropy").result()
    assert np.isfinite(out.metrics["loss"]) and len(out.loss_fn_outputs) == 3


@pytest.mark.slow
def test_http_client_that_leaves_harms_no_one(http_server):
    url, svc = http_server
    client = ServiceClient(url, token="sesame")
    trainer = client.create_lora_training_client(rank=4, seed=8)
    data = datums(80)
    loss = trainer.forward(data, "cross_entropy").result().metrics
    body = to_msgpack(
        {
            "model_path": "base",
            "num_samples": 8,
            "prompts": [np.arange(4, 12, dtype=np.int32)],
            "sampling_params": {"max_tokens": 48},
        }
    )
    with pytest.raises(httpx.TimeoutException):  # gone before its sample is done
        httpx.post(
            f"{url}/v1/sample",
            content=body,
            headers={"authorization": "Bearer sesame", "content-type": "application/msgpack"},
            timeout=0.05,
        )
    assert trainer.forward(data, "cross_entropy").result().metrics == loss
    train(trainer, seed=90, steps=1)
    assert int(svc.session(trainer.session).state.step) == 1


def test_body_limit_and_sampler_snapshots(tmp_path):
    from starlette.testclient import TestClient

    svc = service(tmp_path)
    response = TestClient(make_app(svc, max_body_mb=0), base_url="http://127.0.0.1").post(
        "/v1/sessions",
        content=to_msgpack({"rank": 4}),
        headers={"content-type": "application/msgpack"},
    )
    assert response.status_code == 413 and not svc.sessions
    svc = Service(
        BASE, None, ServiceConfig(model="tiny", state_dir=str(tmp_path / "k"), samplers_kept=2)
    )
    trainer = LocalServiceClient(svc).create_lora_training_client(rank=4)
    paths = [trainer.save_weights_for_sampler(f"s{i}").result().path for i in range(3)]
    assert list(svc.session(trainer.session).samplers) == ["s1", "s2"]
    with pytest.raises(ServiceError, match="1 dropped so far") as e:
        LocalServiceClient(svc).create_sampling_client(paths[0]).sample(
            ModelInput.from_ints([4])
        ).result()
    assert e.value.field == "model_path"


def test_binding_rules(tmp_path):
    check_binding(ServeConfig(), None)
    with pytest.raises(ValueError, match="--allow-remote"):
        check_binding(ServeConfig(host="0.0.0.0"), "t")
    with pytest.raises(ValueError, match="needs a token"):
        check_binding(ServeConfig(host="0.0.0.0", allow_remote=True), None)
    check_binding(ServeConfig(host="0.0.0.0", allow_remote=True), "t")
    from relax.parallel.step import ParallelConfig

    check_parallel(ServeConfig(parallel=ParallelConfig(mesh="fsdp=-1")))
    with pytest.raises(ValueError, match="--parallel.sampler-devices"):
        check_parallel(ServeConfig(parallel=ParallelConfig(sampler_devices=2)))


MESH_SCRIPT = """
import numpy as np, jax
from tests.test_serve import BASE, datums, train
from relax.models.layers.lora import LoRAConfig
from relax.serve.client import LocalServiceClient
from relax.serve.service import Service, ServiceConfig
from relax.serve.types import ModelInput, SamplingParams
import relax.serve.session as session_module
assert jax.device_count() == 8
placed, place = [], session_module.place_rows
def spy(batch, mesh, what):
    out = place(batch, mesh, what)
    if mesh is not None:
        placed.append((what, jax.tree.leaves(out)[0].sharding.is_fully_replicated))
    return out
session_module.place_rows = spy
from relax.algorithms.online.batch import LossRows
rng = np.random.default_rng(0)
P, G, N, L = 8, 2, 5, 6
m = (np.arange(N) < rng.integers(2, N + 1, (P, G, 1))).astype(np.int32)
rows = LossRows(prompt_ids=rng.integers(4, 16, (P, L)).astype(np.int32), prompt_mask=np.ones((P, L), np.int32),
                tokens=rng.integers(4, 16, (P, G, N)).astype(np.int32) * m, mask=m, loss_mask=m,
                old_logprobs=(-rng.uniform(0.5, 3, (P, G, N)) * m).astype(np.float32),
                advantages=rng.normal(size=(P, G)).astype(np.float32))
out = []
for mesh in (None, "fsdp=4,data=2"):
    svc = Service(BASE, None, ServiceConfig(model="tiny", state_dir="{tmp}/" + str(mesh), lora=LoRAConfig(rank=4),
                                            mesh=mesh))
    trainer = LocalServiceClient(svc).create_lora_training_client(rank=4, seed=1)
    losses = train(trainer, seed=5, steps=2)
    after = trainer.forward(datums(9), "importance_sampling").result().metrics["loss"]
    after = [after, trainer.forward(rows, "grpo", {"loss_type": "token-mean"}).result().metrics["loss"]]
    sample = trainer.save_weights_and_get_sampling_client("s").sample(
        ModelInput.from_ints([5, 6]), 2, SamplingParams(max_tokens=4, temperature=0.0)).result()
    leaf = jax.tree.leaves(svc.session(trainer.session).state.policy.layers.lora)[0]
    out.append((losses, after, [s.tokens for s in sample.sequences], len(leaf.sharding.device_set)))
(l0, a0, s0, d0), (l1, a1, s1, d1) = out
np.testing.assert_allclose(l0, l1, rtol=1e-4); np.testing.assert_allclose(a0, a1, rtol=1e-4)
assert s0 == s1 and d0 == 1 and d1 == 8, (s0, s1, d0, d1)
# datum rows split over data x fsdp (padded to the 8 shards); one prompt replicated
assert ("data", False) in placed and ("data", True) not in placed and (None, True) in placed, placed
assert ("batch", False) in placed, placed  # 8 prompts' rows over the 8 shards
print("OK")
"""


@pytest.mark.slow
def test_sessions_on_a_mesh_equal_one_device(tmp_path):
    """--parallel.mesh: the base and each session's state on 8 (host) devices train and sample as on one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": str(root),
    }
    proc = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT.replace("{tmp}", str(tmp_path))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
