"""The padding-free update (relax.models.forward.completion_packing): the bins against a
hand-worked packing and the bound on their number; packed log-probs, entropies and gradients
against the full-sequence forward (``token_logprobs``, the independent reference); the GRPO
update packed == padded for every loss aggregation mode; the composed GRPO step with packing on
== off. (PPO: tests/test_ppo_packing.py; the mesh case: tests/test_parallel.py.)"""

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
from relax.data.completion_layout import BinSizes, PackingConfig, bin_fill, pack_bins
from relax.models import ModelConfig, init
from relax.models.decoder.logprobs import token_logprobs
from relax.models.forward.completion_packing import to_padded
from relax.models.forward.config import ForwardConfig
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.objectives.aggregation import AGGREGATION_MODES
from relax.passes import choose_passes
from relax.train.optimizer import OptimizerConfig
from relax.train.update import micro_batch_split


def _ragged(p, g, n, seed):
    """Random tokens ``[P, G, N]`` and a prefix mask with lengths 1..N (one of length N per batch)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, n + 1, (p, g))
    lengths[0, 0] = n
    tokens = rng.integers(0, CFG.vocab_size, (p, g, n)).astype(np.int32)
    return tokens, (np.arange(n) < lengths[..., None]).astype(np.int32)


def _pack(ids, pm, tokens, mask, cfg: PackingConfig | None = None, block=4, multiple=1):
    cfg = PackingConfig() if cfg is None else cfg
    p, lp = np.shape(ids)
    _, g, n = np.shape(tokens)
    sizes = cfg.sizes(p, g, lp, n, block=block, multiple=multiple)
    return jax.tree.map(jnp.asarray, pack_bins(ids, pm, tokens, mask, sizes))


def test_bins_worked_by_hand():
    # prompts of 2 and 1 tokens (left-padded to 3), completions 3 1 1 | 2 2 2, bins of 6 slots:
    # bin 0: prompt 0, its completions longest first (3, 1): full; bin 1: a copy of prompt 0 and
    # its last completion, prompt 1 and a first 2 (full); bin 2: a copy of prompt 1, then 2, 2.
    ids = np.array([[0, 5, 6], [0, 0, 7]])
    pm = (ids > 0).astype(np.int32)
    tokens = np.array(
        [[[10, 11, 12], [13, 0, 0], [14, 0, 0]], [[20, 21, 0], [22, 23, 0], [24, 25, 0]]]
    )
    mask = (tokens > 0).astype(np.int32)
    bins = pack_bins(ids, pm, tokens, mask, BinSizes(tokens=6, completions=4, bins=4, block=2))
    np.testing.assert_array_equal(
        bins.ids, [[5, 6, 10, 11, 12, 13], [5, 6, 14, 7, 20, 21], [7, 22, 23, 24, 25, 0], [0] * 6]
    )
    np.testing.assert_array_equal(
        bins.positions[:3], [[0, 1, 2, 3, 4, 2], [0, 1, 2, 0, 1, 2], [0, 1, 2, 1, 2, 0]]
    )
    np.testing.assert_array_equal(
        bins.docs[:3], [[1, 1, 2, 2, 2, 3], [1, 1, 2, 3, 4, 4], [1, 2, 2, 3, 3, 0]]
    )
    np.testing.assert_array_equal(bins.prefix_of[:2], [[1] * 6, [1, 1, 1, 2, 2, 2]])
    np.testing.assert_array_equal(bins.prefix[:2], [[1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0]])
    # a completion's first token is predicted by its prompt's last slot, the others by the slot before
    np.testing.assert_array_equal(bins.predictor[0, 2:], [1, 2, 3, 1])
    np.testing.assert_array_equal(bins.predictor[1, 2:], [1, 3, 3, 4])
    # sources: token i of left-padded prompt p at 3p + i; token t of completion (p, g) at 6 + 9p + 3g + t
    np.testing.assert_array_equal(bins.source[:2], [[1, 2, 6, 7, 8, 9], [1, 2, 12, 5, 15, 16]])
    np.testing.assert_array_equal(bins.members[:3, :2], [[0, 1], [2, 3], [4, 5]])
    np.testing.assert_array_equal(bins.member_start[:3, :2], [[2, 5], [2, 4], [1, 3]])
    np.testing.assert_array_equal(bins.bin_of, [[0, 0, 1], [1, 2, 2]])
    np.testing.assert_array_equal(bins.start, [[2, 5, 2], [4, 1, 3]])
    assert list(bins.num_pairs > 0) == [True, True, True, False]
    back = to_padded(jnp.asarray(bins.ids), jax.tree.map(jnp.asarray, bins), 3)
    np.testing.assert_array_equal(np.where(mask, back, 0), tokens)
    assert bin_fill(bins) == 17 / 18
    assert PackingConfig(mode="on").applies("dense")  # each bin one fused kernel over its mask
    assert not PackingConfig().applies("dense") and PackingConfig().applies("group")
    # on accelerators "auto" stays padded (Passes.auto_packs), "on" packs
    assert not PackingConfig().applies("group", auto_packs=False)
    assert PackingConfig(mode="on").applies("group", auto_packs=False)
    assert not choose_passes("tpu").auto_packs and choose_passes("cpu", batch_shards=4).auto_packs
    # a packed update's micro-batch: one bin on one CPU device, the token budget's worth elsewhere
    assert choose_passes("cpu").bins_per_micro_batch(2176) == 1
    assert choose_passes("gpu").bins_per_micro_batch(2176) == 16_384 // 2176
    assert choose_passes("tpu").bins_per_micro_batch(32_768) == 1


@pytest.mark.parametrize("seed", range(6))
def test_the_bins_a_batch_needs_never_exceed_the_layout(seed):
    """The bound of ``PackingConfig.sizes`` against batches of every kind: at the budget, one
    token, long-tailed; and the completion cap."""
    rng = np.random.default_rng(seed)
    p, g, n, lp = 5, 6, 16, 7
    kind = seed % 3
    lengths = (
        np.full((p, g), n)
        if kind == 0
        else np.ones((p, g), int)
        if kind == 1
        else np.clip(rng.lognormal(1.5, 1.0, (p, g)).astype(int), 1, n)
    )
    mask = (np.arange(n) < lengths[..., None]).astype(np.int32)
    ids, pm = (
        np.ones((p, lp), np.int32),
        (np.arange(lp) >= rng.integers(0, lp, (p, 1))).astype(np.int32),
    )
    for cfg in (
        PackingConfig(),
        PackingConfig(bin_tokens=lp + n),
        PackingConfig(completions_per_bin=2),
    ):
        sizes = cfg.sizes(p, g, lp, n, block=4)
        bins = pack_bins(ids, pm, np.ones((p, g, n), np.int32), mask, sizes)
        assert bins.ids.shape == (sizes.bins, sizes.tokens)
        assert (bins.members >= 0).sum() == p * g  # every completion placed once
        assert sorted(bins.members[bins.members >= 0]) == list(range(p * g))


def test_bad_batches_are_refused_by_name():
    ids, pm = np.ones((1, 2), np.int32), np.ones((1, 2), np.int32)
    mask = np.array([[[1, 0, 1]]])
    sizes = BinSizes(tokens=8, completions=4, bins=2, block=4)
    with pytest.raises(ValueError, match="completion 0 of prompt 0 is not a prefix"):
        pack_bins(ids, pm, np.ones((1, 1, 3)), mask, sizes)
    with pytest.raises(ValueError, match="prompt 0 is not left-padded"):
        pack_bins(ids, np.array([[1, 0]]), np.ones((1, 1, 3)), np.ones((1, 1, 3)), sizes)
    with pytest.raises(ValueError, match="does not fit a bin of 4 slots"):
        pack_bins(
            ids, pm, np.ones((1, 1, 3)), np.ones((1, 1, 3)), dataclasses.replace(sizes, tokens=4)
        )
    with pytest.raises(ValueError, match="shorter than a prompt"):
        PackingConfig(bin_tokens=5).sizes(1, 1, 2, 4, block=1)


@pytest.mark.parametrize(
    "window,bin_tokens,block,attention",
    [
        (None, None, 4, "group"),
        (None, 28, 2, "group"),
        (3, 20, 4, "group"),
        (None, 28, 4, "dense"),  # each bin one fused kernel over its mask (GPU: cuDNN's)
    ],
)
@pytest.mark.slow
def test_packed_logprobs_and_gradients_equal_the_full_sequence_forward(
    window, bin_tokens, block, attention
):
    cfg = ModelConfig(**{**CFG.__dict__, "sliding_window": window})
    model = init(cfg, jax.random.key(0), std=0.3)
    p, g, n, lp = 3, 5, 6, 8
    ids, pm = _prompts(p, lp, [8, 3, 5])
    tokens, mask = _ragged(p, g, n, seed=1)
    pk = _pack(ids, pm, tokens, mask, PackingConfig(bin_tokens=bin_tokens), block)
    assert int(jnp.sum(pk.num_pairs > 0)) < p * g / 2  # several completions and groups share a bin
    comp, cm = jnp.asarray(tokens), jnp.asarray(mask)
    full = jnp.concatenate([jnp.repeat(ids, g, 0), comp.reshape(p * g, n)], 1)
    fmask = jnp.concatenate([jnp.repeat(pm, g, 0), cm.reshape(p * g, n)], 1)

    def direct(m):
        return token_logprobs(m, full, fmask, temperature=0.7)[:, lp - 1 :].reshape(p, g, n)

    def packed(m, how: ForwardPass):
        return completion_logprobs(m, ids, pm, comp, cm, how, temperature=0.7, packed=pk)

    lp_packed, ent_packed = packed(model, ForwardPass(attention, with_entropy=True))
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
    for how in (ForwardPass(attention), ForwardPass(attention, unroll=True, save_attention=True)):
        got = jax.grad(lambda m: jnp.sum(w * packed(m, how)))(model)
        chex.assert_trees_all_close(got, want, atol=1e-5 * scale, rtol=1e-4)


def test_forwards_over_bins_take_the_bins_per_pass():
    """``over_bins`` runs ``per_device`` bins a step where they divide the bins (else one), the
    skipped steps' outputs zeros; a packed forward gives the same log-probs either way."""
    from relax.models.forward.binned import over_bins

    def steps(u, per, active=None):
        active = jnp.ones(u, bool) if active is None else jnp.asarray(active)
        run = lambda x: jnp.full(x.shape, x.shape[0], jnp.int32)  # noqa: E731 - the step's bins
        return np.asarray(over_bins(run, jnp.arange(u), active, per_device=per))

    np.testing.assert_array_equal(steps(6, 2), [2] * 6)
    np.testing.assert_array_equal(steps(6, 4), [1] * 6)  # 4 does not divide 6: one at a time
    np.testing.assert_array_equal(steps(6, 3, [1, 0, 0, 0, 0, 0]), [3, 3, 3, 0, 0, 0])
    model = init(CFG, jax.random.key(0), std=0.3)
    ids, pm = _prompts(3, 8, [8, 3, 5])
    tokens, mask = _ragged(3, 5, 6, seed=1)
    pk = _pack(ids, pm, tokens, mask, PackingConfig(bin_tokens=28), multiple=2)
    args = (model, ids, pm, jnp.asarray(tokens), jnp.asarray(mask))
    one, two = (completion_logprobs(*args, ForwardPass(bins_per_pass=k), packed=pk) for k in (1, 2))
    np.testing.assert_allclose(np.where(mask, two, 0), np.where(mask, one, 0), atol=1e-5)


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
    "loss_type,attention,budget",
    [(m, "group", None) for m in AGGREGATION_MODES]
    + [("token-mean", "dense", None), ("token-mean", "group", 32)],
)
@pytest.mark.slow
def test_packed_update_equals_padded_for_every_aggregation_with_gradient_accumulation(
    loss_type, attention, budget
):
    """Parameters and every metric after one update: packed, one bin per micro-batch (the empty
    ones skipped) == padded in one micro-batch; KL and entropy terms on. ``"dense"``: the padded
    update's fused attention per completion against one fused kernel per bin over its mask.
    ``budget``: the accelerators' passes, a token budget of two 16-slot bins per micro-batch."""
    model = init(CFG, jax.random.key(3), std=0.2)
    data = _update_data()
    passes = choose_passes()
    if budget is not None:
        passes = dataclasses.replace(passes, cache_sized=False, micro_batch_tokens=budget)
    per = passes.bins_per_micro_batch(16)
    packed = _pack(
        data.prompt_ids,
        data.prompt_mask,
        data.tokens,
        data.mask,
        PackingConfig(bin_tokens=16),
        multiple=per,
    )
    u = packed.num_pairs.shape[0]
    assert 1 < int(jnp.sum(packed.num_pairs > 0)) < u
    assert micro_batch_split(u, 1, None, passes, 16) == u // per  # two bins in each with a budget
    results = []
    for accum, extra in ((1, {}), (1, {"packed": packed})):
        cfg = configure(
            GRPOConfig,
            num_generations=4,
            max_new_tokens=6,
            loss_type=loss_type,
            grad_accum=accum,
            beta=0.04,
            entropy_coef=0.01,
            optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-2, max_grad_norm=None),
            forward=ForwardConfig(train_attention=attention),
        )
        opt = cfg.optimizer.make()
        update = jax.jit(make_grpo_update(cfg, opt, passes))
        results.append(update(model, opt.init(model), data.replace(**extra), jax.random.key(0)))
    (want, _, want_metrics), (got, _, got_metrics) = results
    chex.assert_trees_all_close(got, want, atol=1e-6)
    assert got_metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        np.testing.assert_allclose(got_metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def assert_same_steps(on, off):
    """Packed (``on``) and padded (``off``) steps, each ``(tokens, metrics)``: the same tokens, and
    every metric but the timings the same within float32 round-off."""
    for (tok_on, m_on), (tok_off, m_off) in zip(on, off, strict=True):
        np.testing.assert_array_equal(tok_on, tok_off)
        for name, value in m_off.items():
            if name.startswith("mismatch/"):
                # sampler vs trainer: round-off packed or not (the log-probs agree to 1e-5, above),
                # so bounded rather than compared (1.4e-5 against 2.1e-6 on one host for PPO's
                # abs_max); a packing error would put the trainer's log-probs far from the sampler's
                assert max(abs(m_on[name]), abs(value)) < 1e-4, (name, m_on[name], value)
            elif not name.startswith("time") and name not in ("tokens_per_s", "compiles"):
                # float32 sums in another order (the KL and the gradient norm 2.5e-5 and 4e-5 apart on an
                # AMD EPYC host); a packing error is of the order of the values
                np.testing.assert_allclose(m_on[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
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
            packing=PackingConfig(mode=mode, bin_tokens=24),
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
        on[0][1]["pack_bins"] < 4 and "pack_bins" not in off[0][1]
    )  # packed, several groups to a bin
    assert_same_steps(on, off)
    # Adam's round-off on gradient components within float noise of 0 (tests/test_parallel.py's WEIGHT_ATOL)
    chex.assert_trees_all_close(policy_on, policy_off, atol=5e-3 * 1e-2)


def test_auto_packs_where_the_train_attention_is_the_group_kernel():
    """The pack stage with the default config packs on CPU (every batch, one layout whatever the
    lengths); 'off' never packs."""
    from relax.algorithms.online.stages import make_packing
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

    pack = make_packing(PackingConfig(), ForwardConfig(train_attention="auto"), choose_passes())
    layouts = {pack(state, scored(m))[1].device.packed.ids.shape for m in (full, short)}
    assert layouts == {(2, 64)}  # 2 x (3 + 8) slots rounded up to the block of 64; 8 // 5 + 1 bins
    out = pack(state, scored(short))[1]
    assert int(jnp.sum(out.device.packed.num_pairs > 0)) == 1  # 2 prompts + 8 x 2 tokens: one bin
    assert out.host.prompts == ["a", "b"] and np.array_equal(out.device.mask, short)
    off = make_packing(
        PackingConfig(mode="off"), ForwardConfig(train_attention="auto"), choose_passes()
    )
    assert off(state, scored(short))[1].device.packed is None
