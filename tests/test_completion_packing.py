"""The padding-free update (relax.models.forward.completion_packing): the layout against a hand-worked
first-fit-decreasing packing; packed log-probs, entropies and gradients against the full-sequence
forward (``token_logprobs``, the independent reference); the GRPO update packed == padded for
every loss aggregation mode with gradient accumulation; the composed GRPO step with packing on ==
off. (The mesh case: tests/test_parallel.py.)"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import CFG, _prompts

from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.loss import make_grpo_update
from relax.algorithms.online.batch import HostRecord, LossRows, Scored, step_input
from relax.algorithms.online.step import StepParts
from relax.compose import WithHost
from relax.data.completion_layout import PackingConfig, pack_completions, rows_needed
from relax.models import ModelConfig, init
from relax.models.decoder.logprobs import token_logprobs
from relax.models.forward.completion_packing import unpack
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.objectives.aggregation import AGGREGATION_MODES
from relax.passes import choose_passes
from relax.train.optimizer import OptimizerConfig


def _ragged(p, g, n, seed):
    """Random tokens ``[P, G, N]`` and a prefix mask with lengths 1..N (one of length N per batch)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, n + 1, (p, g))
    lengths[0, 0] = n
    tokens = rng.integers(0, CFG.vocab_size, (p, g, n)).astype(np.int32)
    return tokens, (np.arange(n) < lengths[..., None]).astype(np.int32)


def test_layout_is_first_fit_decreasing_worked_by_hand():
    # lengths 6 1 2 5 3 into rows of 12, longest first: 6 -> row 0 (room 6), 5 -> row 0 (room 1),
    # 3 -> row 1 (room 9), 2 -> row 1 (room 7), 1 -> row 0 (room 0)
    tokens = np.arange(30).reshape(1, 5, 6)
    mask = (np.arange(6) < np.array([[6, 1, 2, 5, 3]])[..., None]).astype(np.int32)
    pk = pack_completions(tokens, mask, row_tokens=12)
    np.testing.assert_array_equal(
        pk.tokens[0],
        [[0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 6], [24, 25, 26, 12, 13, 0, 0, 0, 0, 0, 0, 0]],
    )
    np.testing.assert_array_equal(
        pk.segments[0], [[1] * 6 + [2] * 5 + [3], [1, 1, 1, 2, 2] + [0] * 7]
    )
    np.testing.assert_array_equal(
        pk.offsets[0], [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1] + [0] * 7]
    )
    # completion g's token t lies at flat slot source[g, t] of the rows (row * 12 + column)
    for g in range(5):
        for t in range(int(mask[0, g].sum())):
            assert pk.tokens.reshape(-1)[pk.source[0, g, t]] == tokens[0, g, t]
    values = jnp.asarray(pk.tokens, jnp.float32)
    np.testing.assert_array_equal(
        np.where(mask, unpack(values, jnp.asarray(pk.source)), 0), np.where(mask, tokens, 0)
    )


def test_rows_per_group_are_the_most_any_group_needs_rounded_up():
    mask = np.zeros((2, 8, 4), np.int32)
    mask[0, :, :1] = 1  # eight 1-token completions: one row of 4 holds four -> 2 rows
    mask[1, :3, :] = 1  # three full ones -> 3 rows
    assert rows_needed(mask, row_tokens=4) == 3
    assert rows_needed(mask, row_tokens=4, row_multiple=2) == 4
    assert rows_needed(mask, row_tokens=4, row_multiple=5) == 5
    assert rows_needed(mask, row_tokens=4, row_multiple=9) == 8  # never more than G
    assert PackingConfig().pack(np.zeros_like(mask), mask).tokens.shape == (
        2,
        4,
        4,
    )  # default multiple ceil(8/4)


def test_row_length_is_the_budget_quarter_with_the_fewest_slots():
    # budget 64: widths 16 | 32 | 48 | 64; the longest completion (20) rules out 16. Rows of 32:
    # 20+10, 10+5 -> 2 rows, 64 slots; rows of 48: 20+10+10+5 -> 1 row, 48 slots; rows of 64: 64 slots
    mask = (np.arange(64) < np.array([[20, 10, 10, 5]])[..., None]).astype(np.int32)
    cfg = PackingConfig()
    assert cfg.widths(64) == (16, 32, 48, 64) and cfg.widths(100) == (32, 56, 80, 100)
    assert cfg.choose(mask) == (1, 48) and cfg.choose(mask, row_tokens=32) == (2, 32)
    assert cfg.pack(np.zeros_like(mask), mask).tokens.shape == (1, 1, 48)
    assert PackingConfig(row_tokens=64).choose(mask) == (1, 64)
    assert "rows of 16 | 32 | 48 | 64 tokens" in cfg.describe("group", 4, 64)
    assert cfg.saves((1, 48), mask.shape) and not cfg.saves(
        (4, 64), mask.shape
    )  # auto: fewer slots only
    assert PackingConfig(mode="on").saves((4, 64), mask.shape)


def test_a_mask_that_is_not_a_prefix_and_short_rows_are_refused_by_name():
    mask = np.ones((2, 3, 4), np.int32)
    mask[1, 2, 1] = 0
    with pytest.raises(ValueError, match="completion 2 of prompt 1 is not a prefix"):
        pack_completions(np.zeros_like(mask), mask, row_tokens=4)
    with pytest.raises(ValueError, match="a completion of 4 tokens does not fit rows of 3"):
        pack_completions(np.zeros_like(mask), np.ones_like(mask), row_tokens=3)
    with pytest.raises(ValueError, match="row_tokens=3 is shorter than the completion budget 4"):
        PackingConfig(row_tokens=3).pack(np.zeros_like(mask), np.ones_like(mask))
    with pytest.raises(ValueError, match="needs the 'group' train attention"):
        PackingConfig(mode="on").applies("dense")
    assert not PackingConfig().applies("dense") and PackingConfig().applies("group")


@pytest.mark.parametrize(
    "window,row_tokens,groups_per_pass",
    [
        (None, 13, 1),
        pytest.param(None, 6, None, marks=pytest.mark.slow),
        pytest.param(3, 9, None, marks=pytest.mark.slow),
    ],
)
def test_packed_logprobs_and_gradients_equal_the_full_sequence_forward(
    window, row_tokens, groups_per_pass
):
    cfg = ModelConfig(**{**CFG.__dict__, "sliding_window": window})
    model = init(cfg, jax.random.key(0), std=0.3)
    p, g, n, lp = 3, 5, 6, 8
    ids, pm = _prompts(p, lp, [8, 3, 5])
    tokens, mask = _ragged(p, g, n, seed=1)
    pk = jax.tree.map(jnp.asarray, pack_completions(tokens, mask, row_tokens=row_tokens))
    assert pk.tokens.shape[1] < g  # several completions share a row
    comp, cm = jnp.asarray(tokens), jnp.asarray(mask)
    full = jnp.concatenate([jnp.repeat(ids, g, 0), comp.reshape(p * g, n)], 1)
    fmask = jnp.concatenate([jnp.repeat(pm, g, 0), cm.reshape(p * g, n)], 1)

    def direct(m):
        return token_logprobs(m, full, fmask, temperature=0.7)[:, lp - 1 :].reshape(p, g, n)

    def packed(m, how: ForwardPass):
        how = dataclasses.replace(how, groups_per_pass=groups_per_pass)
        return completion_logprobs(m, ids, pm, comp, cm, how, temperature=0.7, packed=pk)

    lp_packed, ent_packed = packed(model, ForwardPass(with_entropy=True))
    chex.assert_shape([lp_packed, ent_packed], (p, g, n))
    np.testing.assert_allclose(
        np.where(mask, lp_packed, 0), np.where(mask, direct(model), 0), atol=1e-5
    )
    _, ent_padded = completion_logprobs(
        model, ids, pm, comp, cm, ForwardPass(with_entropy=True), temperature=0.7
    )
    np.testing.assert_allclose(
        np.where(mask, ent_packed, 0), np.where(mask, ent_padded, 0), atol=1e-5
    )
    w = jax.random.normal(jax.random.key(2), (p, g, n)) * cm
    want = jax.grad(lambda m: jnp.sum(w * direct(m)))(model)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want))
    # the CPU update's options too
    for how in (ForwardPass(), ForwardPass(unroll=True, save_attention=True)):
        got = jax.grad(lambda m: jnp.sum(w * packed(m, how)))(model)
        chex.assert_trees_all_close(got, want, atol=1e-5 * scale, rtol=1e-4)


def _update_data(p=4, g=4, n=6, seed=0):
    key = jax.random.key(seed)
    ids, pm = _prompts(p, 6, [6, 2, 4, 5][:p], seed)
    tokens, mask = _ragged(p, g, n, seed)
    k1, k2 = jax.random.split(key)
    return LossRows(
        prompt_ids=ids,
        prompt_mask=pm,
        tokens=jnp.asarray(tokens),
        mask=jnp.asarray(mask),
        loss_mask=jnp.asarray(mask),
        old_logprobs=-2.0 + 0.1 * jax.random.normal(k1, (p, g, n)),
        ref_logprobs=-2.0 + 0.1 * jax.random.normal(k2, (p, g, n)),
        advantages=jax.random.normal(jax.random.fold_in(key, 7), (p, g)),
    )


@pytest.mark.parametrize(
    "loss_type",
    [
        m
        if m in ("token-mean", "seq-mean-token-sum-norm")
        else pytest.param(m, marks=pytest.mark.slow)
        for m in AGGREGATION_MODES
    ],
)
def test_packed_update_equals_padded_for_every_aggregation_with_gradient_accumulation(loss_type):
    """Parameters and every metric after one update: packed with one prompt group per
    micro-batch (4 accumulated) == padded in one micro-batch; KL and entropy terms on."""
    model = init(CFG, jax.random.key(3), std=0.2)
    data = _update_data()
    packed = jax.tree.map(
        jnp.asarray,
        PackingConfig(row_tokens=12).pack(np.asarray(data.tokens), np.asarray(data.mask)),
    )
    assert packed.tokens.shape[1] < 4
    results = []
    for accum, extra in ((1, {}), (4, {"packed": packed})):
        cfg = configure(
            GRPOConfig,
            num_generations=4,
            max_new_tokens=6,
            loss_type=loss_type,
            grad_accum=accum,
            beta=0.04,
            entropy_coef=0.01,
            optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-2, max_grad_norm=None),
        )
        opt = cfg.optimizer.make()
        update = jax.jit(make_grpo_update(cfg, opt, choose_passes()))
        results.append(update(model, opt.init(model), data.replace(**extra), jax.random.key(0)))
    (want, _, want_metrics), (got, _, got_metrics) = results
    chex.assert_trees_all_close(got, want, atol=1e-6)
    assert got_metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        np.testing.assert_allclose(got_metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_grpo_step_with_packing_equals_it_without():
    """Two iterations of the composed step (rollout, pack, reference, update) on completions
    that stop early: the same samples, metrics and weights with packing on and off."""
    from test_parallel import _decode, fives

    from relax.algorithms.grpo.step import make_grpo_step
    from relax.train.state import init_state

    ids, pm = _prompts(4, 6, [6, 2, 4, 5])
    batch = step_input(ids, pm, ["a", "b", "c", "d"], {"weight": [1.0] * 4})
    runs = {}
    for mode in ("on", "off"):
        cfg = configure(
            GRPOConfig,
            num_generations=4,
            max_new_tokens=8,
            beta=0.04,
            packing=PackingConfig(mode=mode, row_tokens=16),
            optimizer=OptimizerConfig(learning_rate=1e-2),
        )
        opt = cfg.optimizer.make()
        state = init_state(
            init(CFG, jax.random.key(0), std=0.3), opt, key=jax.random.key(1), with_reference=True
        )
        step = make_grpo_step(
            cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(3,), pad_id=0)
        )  # token 3 ends a completion
        out = []
        for _ in range(2):
            state, b = step(state, batch)
            out.append(
                (
                    np.asarray(b.device.batch.tokens),
                    {k: float(v) for k, v in b.device.metrics.items()},
                )
            )
        runs[mode] = (out, state.policy)
    (on, policy_on), (off, policy_off) = runs["on"], runs["off"]
    assert (
        on[0][1]["pack_rows"] < 4 and "pack_rows" not in off[0][1]
    )  # packed, and several to a row
    for (tok_on, m_on), (tok_off, m_off) in zip(on, off):
        np.testing.assert_array_equal(tok_on, tok_off)
        for name, value in m_off.items():
            if not name.startswith("time") and name not in ("tokens_per_s", "compiles"):
                # float32 sums in another order (the KL and the gradient norm 2.5e-5 and 4e-5 apart on an
                # AMD EPYC host); a packing error is of the order of the values
                np.testing.assert_allclose(m_on[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # Adam's round-off on gradient components within float noise of 0 (tests/test_parallel.py's WEIGHT_ATOL)
    chex.assert_trees_all_close(policy_on, policy_off, atol=5e-3 * 1e-2)


def test_auto_packs_a_batch_only_when_that_saves_slots():
    """The pack stage with the default config: completions that fill the budget stay padded (as
    many rows would cost more), short ones are packed; 'off' never packs."""
    from relax.algorithms.online.stages import make_packing
    from relax.models.forward.config import ForwardConfig
    from relax.train.state import init_state

    state = init_state(
        init(CFG, jax.random.key(0)), OptimizerConfig().make(), key=jax.random.key(1)
    )
    tokens = np.ones((2, 4, 8), np.int32)
    full, short = np.ones_like(tokens), (np.arange(8) < 2).astype(np.int32) * np.ones_like(tokens)

    def scored(mask):  # a scored batch of these completions, and its host record
        ids = jnp.ones((2, 3), jnp.int32)
        batch = Scored(
            prompt_ids=ids,
            prompt_mask=ids,
            tokens=jnp.asarray(tokens),
            mask=jnp.asarray(mask),
            old_logprobs=jnp.zeros(tokens.shape),
            lengths=jnp.asarray(mask.sum(-1)),
            finished=jnp.ones((2, 4), bool),
            policy_version=jnp.zeros((2, 4), jnp.int32),
        )
        return WithHost(batch, HostRecord(prompts=["a", "b"]))

    pack = make_packing(PackingConfig(), ForwardConfig(train_attention="auto"))
    assert pack(state, scored(full))[1].device.packed is None
    out = pack(state, scored(short))[1]
    packed = out.device.packed
    assert packed.tokens.shape == (2, 1, 8)  # four 2-token completions in one row of 8
    assert out.host.prompts == ["a", "b"] and np.array_equal(
        out.device.mask, short
    )  # the rest as it was
    assert (
        make_packing(PackingConfig(mode="off"), ForwardConfig(train_attention="auto"))(
            state, scored(short)
        )[1].device.packed
        is None
    )
