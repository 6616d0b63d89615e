"""KTO: the loss and reference point against numpy, unpaired data, the step, the reference cache."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dpo import CFG, _batch, _copy, _models, _state, full_sequence_logps
from text_fixtures import make_model_dir

from relax.algorithms.kto import KTOConfig, evaluate, make_kto_eval, make_kto_step, make_state
from relax.algorithms.kto.step import collate, encode
from relax.algorithms.preference import reference_cache as rc
from relax.data.files import MissingFieldError, read_records
from relax.data.pairs import (
    Unpaired,
    UnpairedBatch,
    collate_unpaired,
    encode_unpaired,
    with_reference,
)
from relax.models import ModelConfig, init
from relax.objectives.preference import kto_loss, kto_reference_point
from relax.text import load_tokenizer
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state

LABELS = np.array([1, 0, 1, 0], np.int32)


def sig(x):
    return 1 / (1 + np.exp(-x))


def np_kto(pol, ref, desirable, z0, beta, wd=1.0, wu=1.0):
    rho = pol - ref
    return np.where(desirable, wd * (1 - sig(beta * (rho - z0))), wu * (1 - sig(beta * (z0 - rho))))


# ----------------------------------------------------------------------------- loss


def test_kto_loss_hand_values_and_numpy():
    # rho = (-2) - (-3) = 1, z0 = 0.5, beta = 2: desirable 1 - s(1), undesirable (weight 1.5) 1.5 (1 - s(-1))
    pol, ref = np.array([-2.0, -2.0], np.float32), np.array([-3.0, -3.0], np.float32)
    losses, m = kto_loss(pol, ref, np.array([True, False]), 0.5, beta=2.0, undesirable_weight=1.5)
    np.testing.assert_allclose(losses, [1 - sig(1.0), 1.5 * (1 - sig(-1.0))], rtol=1e-6)
    np.testing.assert_allclose(m["rewards"], [2.0, 2.0])
    rng = np.random.default_rng(0)
    pol, ref = (rng.normal(-20, 3, 8).astype(np.float32) for _ in range(2))
    d = rng.random(8) < 0.5
    losses, _ = jax.jit(
        lambda *a: kto_loss(*a, beta=0.1, desirable_weight=1.3, undesirable_weight=0.7)
    )(pol, ref, d, 0.25)
    np.testing.assert_allclose(
        losses, np_kto(pol.astype(np.float64), ref, d, 0.25, 0.1, 1.3, 0.7), rtol=1e-5
    )
    # the reference point gets no gradient; the loss's gradient is -+ w beta s(1 - s) per example
    g = jax.grad(lambda p, z: jnp.sum(kto_loss(p, ref, d, z, beta=0.1)[0]), argnums=(0, 1))(
        pol, jnp.float32(0.25)
    )
    s = sig(0.1 * np.where(d, (pol - ref) - 0.25, 0.25 - (pol - ref)))
    np.testing.assert_allclose(g[0], np.where(d, -1, 1) * 0.1 * s * (1 - s), rtol=1e-4, atol=1e-7)
    assert float(g[1]) == 0.0
    with pytest.raises(ValueError, match="beta"):
        kto_loss(pol, ref, d, 0.0, beta=0.0)


def test_kto_reference_point_is_a_clamped_detached_mean():
    p, r = np.array([-1.0, -2.0, -4.0], np.float32), np.array([-2.0, -2.5, -1.0], np.float32)
    # mean(1, 0.5, -3) < 0 -> 0; the first two only -> 0.75
    assert float(kto_reference_point(p, r)) == 0.0
    assert float(kto_reference_point(p, r, np.array([True, True, False]))) == pytest.approx(0.75)
    g = jax.grad(lambda p: kto_reference_point(p, r, np.array([True, True, False])))(p)
    np.testing.assert_array_equal(g, 0.0)


def test_config_checks():
    assert KTOConfig().needs_reference and not KTOConfig(precompute_reference=True).needs_reference
    with pytest.raises(ValueError, match="desirable_weight"):
        KTOConfig(undesirable_weight=-1.0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        KTOConfig(beta=0.0)


# ----------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_tokenizer(make_model_dir(tmp_path_factory.mktemp("hf"), "qwen25"))


def test_unpaired_rows_and_their_kl_completions(qwen):
    rows = [
        {"prompt": "a?", "completion": " one", "label": True},
        {"prompt": [{"role": "user", "content": "b?"}], "completion": "two", "label": False},
        {"prompt": "c?", "completion": " three", "label": True},
    ]
    ex = encode_unpaired(rows, qwen, max_prompt_tokens=64, max_completion_tokens=8)
    assert [e.desirable for e in ex] == [True, False, True]
    assert ex[0].completion == qwen.encode(" one", add_special_tokens=False) + [qwen.eos_token_id]
    assert qwen.decode(ex[1].completion) == "two<|im_end|>"  # chat: the assistant turn
    assert ex[1].prompt == qwen.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True)
    # row i's KL completion is row i - 1's (the first takes the last's)
    assert [e.kl_completion for e in ex] == [ex[2].completion, ex[0].completion, ex[1].completion]
    b = collate_unpaired(
        with_reference(ex, [[-1, -2], [-3, -4], [-5, -6]]),
        pad_id=0,
        prompt_length=64,
        completion_length=8,
    )
    assert isinstance(b, UnpairedBatch)
    np.testing.assert_array_equal(b.label, [1, 0, 1])
    np.testing.assert_array_equal(b.tokens[1, 1, : len(ex[0].completion)], ex[0].completion)
    np.testing.assert_array_equal(b.ref_logps[:, 0], [-1, -3, -5])  # the rows' completions
    np.testing.assert_array_equal(b.ref_logps[:, 1], [-2, -4, -6])  # their KL completions


def test_bad_unpaired_rows_name_file_row_and_field(tmp_path, qwen):
    good = {"prompt": "Hello", "completion": " world", "label": True}

    def check(row, match, error=ValueError):
        f = tmp_path / "kto.jsonl"
        f.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(error, match=rf"{f}: (line|row) 2: .*{match}"):
            encode_unpaired(read_records(f), qwen, max_prompt_tokens=8, max_completion_tokens=4)

    check({"prompt": "x", "completion": " y"}, "missing field 'label'", MissingFieldError)
    check({"prompt": "x", "label": True}, "missing field 'completion'", MissingFieldError)
    check(
        {**good, "label": "yes"},
        r"field 'label': must be a bool \(true: desirable\), got str 'yes'",
    )
    check({**good, "label": 1}, r"field 'label': must be a bool")
    check({**good, "completion": ""}, "field 'completion': is empty")
    check(
        {**good, "completion": " world" * 9},
        r"field 'completion': has \d+ tokens with its EOS > "
        r"max_completion_tokens=4",
    )
    check(
        {**good, "prompt": "Hello " * 20}, r"field 'prompt': has \d+ tokens > max_prompt_tokens=8"
    )


# ----------------------------------------------------------------------------- step


def _kto_batch():
    b = _batch()
    return UnpairedBatch(
        prompt_ids=b.prompt_ids,
        prompt_mask=b.prompt_mask,
        tokens=b.tokens,
        mask=b.mask,
        label=LABELS,
        loss_mask=b.loss_mask,
    )


def np_step_loss(policy, ref, cfg):
    b = _batch()
    pol, ref_lp = full_sequence_logps(policy, b), full_sequence_logps(ref, b)
    z0 = max(np.mean(pol[:, 1] - ref_lp[:, 1]), 0.0)
    losses = np_kto(
        pol[:, 0],
        ref_lp[:, 0],
        LABELS > 0,
        z0,
        cfg.beta,
        cfg.desirable_weight,
        cfg.undesirable_weight,
    )
    return losses.mean(), z0, pol, ref_lp


@pytest.mark.slow
def test_step_against_numpy_on_full_sequence_logps():
    policy, ref = _models()
    # a reference far enough from the policy that z0 > 0 (not clamped)
    ref = jax.tree.map(lambda x: x * 1.3 if jnp.issubdtype(x.dtype, jnp.floating) else x, ref)
    cfg = KTOConfig(beta=0.5, desirable_weight=1.2, undesirable_weight=0.8)
    loss, z0, pol, ref_lp = np_step_loss(policy, ref, cfg)
    assert z0 > 0
    state, out = make_kto_step(cfg)(_state(cfg, policy, ref), _kto_batch())
    m = out.metrics
    np.testing.assert_allclose(m["loss"], loss, rtol=2e-5)
    np.testing.assert_allclose(m["kl"], z0, rtol=1e-4)
    np.testing.assert_allclose(out.batch.ref_logps[:, 0], ref_lp[:, 0], rtol=1e-5)
    np.testing.assert_allclose(out.batch.ref_logps[:, 1], ref_lp[:, 1], rtol=1e-5)
    d = LABELS > 0
    np.testing.assert_allclose(
        m["rewards/chosen"], cfg.beta * (pol - ref_lp)[d, 0].mean(), rtol=1e-4
    )
    np.testing.assert_allclose(
        m["rewards/rejected"], cfg.beta * (pol - ref_lp)[~d, 0].mean(), rtol=1e-4
    )
    np.testing.assert_allclose(m["logps/rejected"], pol[~d, 0].mean(), rtol=1e-5)
    assert int(out.health["first_nonfinite"]) == -1 and int(state.step) == 1


@pytest.mark.slow
def test_policy_equal_to_reference():
    policy, _ = _models()
    cfg = KTOConfig()
    state = init_state(
        _copy(policy), cfg.optimizer.make(), key=jax.random.key(1), with_reference=True
    )
    _, out = make_kto_step(cfg)(state, _kto_batch())
    m = out.metrics
    assert bool(out.batch.ref_is_policy)
    assert float(m["kl"]) == 0.0 and float(m["loss"]) == 0.5  # 1 - s(0) for every example
    assert float(m["rewards/chosen"]) == 0.0 and float(m["rewards/margins"]) == 0.0


@pytest.mark.slow
def test_grad_accumulation_changes_nothing():
    policy, ref = _models()
    res = []
    for a in (1, 2):
        cfg = KTOConfig(grad_accum=a, optimizer=OptimizerConfig(learning_rate=1e-3))
        res.append(make_kto_step(cfg)(_state(cfg, policy, ref), _kto_batch()))
    chex.assert_trees_all_close(res[0][0].policy, res[1][0].policy, atol=1e-6)
    for k in res[0][1].metrics:
        np.testing.assert_allclose(
            res[0][1].metrics[k], res[1][1].metrics[k], rtol=1e-5, atol=1e-6, err_msg=k
        )


@pytest.mark.slow
def test_reference_cache_equals_recomputed(tmp_path, qwen):
    cfg_m = ModelConfig(**{**CFG.__dict__, "vocab_size": qwen.vocab_size})
    policy = init(cfg_m, jax.random.key(0), std=0.3)
    ref = jax.tree.map(lambda x: x * 1.1 if jnp.issubdtype(x.dtype, jnp.floating) else x, policy)
    data = tmp_path / "kto.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"q{i}?", "completion": f" {i}", "label": i % 2 == 0}) + "\n"
            for i in range(3)
        )
    )
    cfg = KTOConfig(max_prompt_tokens=8, max_completion_tokens=4, precompute_reference=True)
    ex = encode(cfg, read_records(data), qwen)
    logps, status = rc.cached_reference_logps(
        ref, ex, data, batch_size=2, pad_id=qwen.pad_token_id, prompt_length=8, completion_length=4
    )
    assert status == "computed" and rc.default_cache_path(data, "unpaired").exists()
    online = KTOConfig(max_prompt_tokens=8, max_completion_tokens=4)
    _, out = make_kto_step(online)(
        _state(online, policy, ref), collate(online, ex, qwen.pad_token_id)
    )
    np.testing.assert_allclose(logps, out.batch.ref_logps, rtol=1e-5, atol=1e-5)
    _, cached = make_kto_step(cfg)(
        _state(cfg, policy), collate(cfg, with_reference(ex, logps), qwen.pad_token_id)
    )
    for k in ("loss", "kl", "grad_norm"):
        np.testing.assert_allclose(cached.metrics[k], out.metrics[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(KeyError, match="precompute_reference=True but the batch has no ref_logps"):
        make_kto_step(cfg)(_state(cfg, policy), collate(cfg, ex, qwen.pad_token_id))


def test_eval_stage():
    policy, ref = _models()
    cfg = KTOConfig(beta=0.5)
    _, out = make_kto_eval(cfg)(_state(cfg, policy, ref), _kto_batch())
    loss, z0, _, _ = np_step_loss(policy, ref, cfg)
    np.testing.assert_allclose(out.metrics["loss"], loss, rtol=2e-5)
    np.testing.assert_allclose(out.metrics["kl"], z0, atol=1e-6)


@pytest.mark.slow
def test_evaluate_in_padded_batches_equals_one_batch():
    from test_dpo import _pairs_of

    policy, ref = _models()
    cfg = KTOConfig(beta=0.5, max_prompt_tokens=8, max_completion_tokens=8)
    state = _state(cfg, policy, ref)
    pairs = _pairs_of(_batch())
    ex = [
        Unpaired(p.prompt, p.chosen, pairs[i - 1].chosen, bool(LABELS[i]), p.file, p.row)
        for i, p in enumerate(pairs)
    ]
    whole = collate(cfg, ex, 0)
    _, out = make_kto_eval(cfg)(state, whole)
    got = evaluate(
        cfg, state, ex, pad_id=0, batch_size=len(ex) + 2
    )  # one batch with 2 padding rows
    for k, v in out.metrics.items():
        assert got[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
    assert (
        make_state(KTOConfig(precompute_reference=True), _copy(policy), jax.random.key(0)).ref
        is None
    )
