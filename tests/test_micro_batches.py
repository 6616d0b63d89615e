"""The default micro-batching on accelerators and meshes (``relax.passes.Passes.micro_batches``):
the fewest micro-batches that keep each device within a token budget, checked against counts
worked out by hand, then in ``make_update``: the micro-batches it runs, the memory the compiled
update allocates, and the same step as one micro-batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_docs import tiny_config

from relax import metrics as M
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.run import GRPORunConfig, algorithm
from relax.data.completion_layout import PackingConfig
from relax.models import init
from relax.passes import MICRO_BATCH_TOKENS, Passes, choose_passes
from relax.train.fits import allocated_bytes
from relax.train.update import make_update, micro_batch_text, row_positions


@pytest.mark.parametrize(
    "rows, row_tokens, shards, budget, want",
    [
        (8, 8192, 2, 16384, 2),  # 4 groups of 8 x 1024 per chip: 2 micro-batches of 2
        (4, 8192, 2, 16384, 1),  # 2 per chip: within the budget as one
        (12, 3000, 2, 16384, 2),  # 6 per chip = 18,000 > budget; 3 per chip = 9,000
        (12, 3000, 1, 16384, 3),  # one device: 12 x 3000 over, 6 over, 4 x 3000 = 12,000 within
        (8, 40000, 2, 16384, 4),  # one row per chip is over already: the smallest even split
        (6, 8192, 4, 16384, 1),  # 6 rows do not split over 4 shards: one micro-batch
        (16, 100, 8, 16384, 1),  # a small batch: one
        (8, 8192, 2, None, 1),  # no budget: one
    ],
)
def test_the_fewest_even_micro_batches_within_the_budget(rows, row_tokens, shards, budget, want):
    passes = Passes(batch_shards=shards, micro_batch_tokens=budget)
    assert passes.micro_batches(rows, row_tokens) == want


def test_a_cpu_device_goes_row_by_row_and_everything_else_has_the_budget():
    assert Passes(cache_sized=True, micro_batch_tokens=1).micro_batches(6, 10**6) == 6
    assert choose_passes("cpu").micro_batch_tokens is None
    assert choose_passes("cpu").micro_batches(6, 10**6) == 6
    for passes in (
        choose_passes("gpu"),
        choose_passes("tpu"),
        choose_passes("cpu", batch_shards=8),
    ):
        assert passes.micro_batch_tokens == MICRO_BATCH_TOKENS == 16384


ROWS, T, D, H = 8, 16, 8, 1024


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(ROWS, T, D)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(ROWS, T)), jnp.float32),
        "loss_mask": jnp.asarray(rng.integers(0, 2, (ROWS, T)), jnp.float32),
    }


def _params():
    rng = np.random.default_rng(1)
    return {
        "w1": jnp.asarray(rng.normal(size=(D, H)) / 3, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(H,)) / 16, jnp.float32),
    }


def _loss(params, mb, ctx):
    """A two-layer regression whose ``[rows, T, H]`` hidden layer is kept for the backward; the
    metric ``rows`` is the micro-batch's row count."""
    hidden = jnp.tanh(mb["x"] @ params["w1"])
    err = hidden @ params["w2"] - mb["y"]
    rows = M.Metric(jnp.float32(mb["y"].shape[0]), "max")
    return jnp.sum(mb["loss_mask"] * err**2) / ctx.norms["tokens"], {"rows": rows}


def _update(passes: Passes, grad_accum: int | None = None):
    opt = optax.sgd(0.1)
    update = jax.jit(make_update(_loss, opt, grad_accum=grad_accum, passes=passes))
    params = _params()
    args = (params, opt.init(params), _batch(), jax.random.key(0))
    return update, args


def test_the_update_runs_the_budget_s_micro_batches_in_less_memory_and_takes_the_same_step():
    # a row is T = 16 positions; 32 per micro-batch -> 2 rows -> 4 micro-batches on one device
    budgeted, args = _update(Passes(micro_batch_tokens=2 * T))
    whole, _ = _update(Passes(micro_batch_tokens=None))
    got, _, metrics = budgeted(*args)
    want, _, whole_metrics = whole(*args)
    assert float(metrics["rows"]) == 2 and float(whole_metrics["rows"]) == ROWS
    for g, w, p in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(args[0])):
        assert not np.allclose(w, p)
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], whole_metrics["loss"], rtol=1e-5)
    hidden = ROWS * T * H * 4  # the whole batch's kept hidden layer, float32
    small = allocated_bytes(budgeted.lower(*args).compile())
    large = allocated_bytes(whole.lower(*args).compile())
    assert large >= hidden  # the whole batch's hidden layer at once (twice, as measured)
    assert 2.5 * small < large  # a quarter of it per micro-batch (3.2x less, as measured)


def test_an_explicit_grad_accum_overrides_the_budget():
    update, args = _update(Passes(micro_batch_tokens=2 * T), grad_accum=2)
    assert float(update(*args)[2]["rows"]) == ROWS // 2


def test_the_start_up_report_says_how_the_padded_update_is_micro_batched():
    def text(passes, grad_accum=None, minibatches=1):
        return micro_batch_text(8, minibatches, grad_accum, passes, 8192, "--grpo.grad-accum")

    chips = Passes(batch_shards=2, micro_batch_tokens=16384)
    assert text(chips) == (
        "2 micro-batch(es) of 4 row(s) per optimizer step, 16,384 positions per device: "
        "at most 16,384 per device (--grpo.grad-accum sets them)"
    )
    assert text(chips, grad_accum=4) == (
        "4 micro-batch(es) of 2 row(s) per optimizer step, 8,192 positions per device: "
        "--grpo.grad-accum 4"
    )
    assert text(Passes(cache_sized=True), minibatches=2) == (
        "4 micro-batch(es) of 1 row(s) per optimizer step, 8,192 positions per device: "
        "one row each on a CPU device"
    )


def test_grpo_s_report_line_for_a_padded_update_on_chips():
    config = tiny_config(97)
    cfg = GRPORunConfig(batch_size=8, grpo=GRPOConfig(packing=PackingConfig(mode="off")))
    g = cfg.grpo.generation
    group = g.num_generations * g.max_new_tokens  # a prompt group's completion slots
    chips = Passes(batch_shards=2, micro_batch_tokens=2 * group)  # 2 groups per chip
    line = algorithm(cfg).describe_update(init(config, jax.random.key(0)), chips)
    assert line == (
        f"completions padded to {g.max_new_tokens} tokens in the update (packing off, group train "
        f"attention); 2 micro-batch(es) of 4 row(s) per optimizer step, {2 * group:,} positions per "
        f"device: at most {2 * group:,} per device (--grpo.grad-accum sets them)"
    )


def test_a_row_s_positions_are_its_completion_slots_or_its_loss_mask_s():
    pairs = {
        "prompt_ids": jnp.zeros((8, 300), jnp.int32),
        "tokens": jnp.zeros((8, 2, 512), jnp.int32),  # chosen and rejected
        "loss_mask": jnp.ones((8,), jnp.int32),  # one per pair
    }
    assert row_positions(pairs) == 2 * 512
    examples = {"x": jnp.zeros((8, 64, 3)), "loss_mask": jnp.ones((8, 64), jnp.int32)}
    assert row_positions(examples) == 64
    # 8 pairs of 2 x 512 on 2 shards within 1,024 per device: one pair per device, 4 micro-batches
    assert (
        Passes(batch_shards=2, micro_batch_tokens=1024).micro_batches(8, row_positions(pairs)) == 4
    )


@pytest.mark.parametrize(
    "passes, rows, row_tokens, want",
    [
        (Passes(cache_sized=True), 8, 10**6, 1),  # one CPU device: a group per pass
        (Passes(batch_shards=2, micro_batch_tokens=1024), 8, 512, 4),  # 2 passes of 2 per chip
        (Passes(batch_shards=2, micro_batch_tokens=4096), 8, 512, None),  # within it: one pass
        (Passes(batch_shards=1, micro_batch_tokens=1000), 6, 300, 3),  # 6 x 300 over, 3 within
        (Passes(micro_batch_tokens=None), 8, 10**6, None),  # no budget: one pass
        (Passes(batch_shards=2, micro_batch_tokens=1024), None, 512, None),  # rows not given
    ],
)
def test_forward_only_passes_take_a_default_micro_batch_s_groups(passes, rows, row_tokens, want):
    assert passes.groups_per_pass(rows, row_tokens) == want


def test_a_pass_takes_every_shard_s_share_of_the_groups():
    """``over_groups``: pass ``j`` of ``a`` takes the groups ``j, j + a, ...`` (with ``[P]`` split
    over shards in contiguous blocks, each pass has every shard's share), and the outputs come
    back in the groups' order."""
    from relax.models.forward.prefix_shared import over_groups

    x = jnp.arange(12.0)[:, None] * jnp.ones((1, 3))
    first = over_groups(lambda v: jnp.broadcast_to(v[:1], v.shape), (x,), groups_per_pass=3)
    np.testing.assert_array_equal(first[:, 0], np.arange(12) % 4)  # a = 4 passes
    same = over_groups(lambda v: v * 2, (x,), groups_per_pass=3)
    np.testing.assert_array_equal(same, x * 2)


def test_a_reference_pass_in_the_budget_s_groups_gives_the_same_logprobs_in_less_memory():
    """The forward-only log-probs (a reference's, ``relax.algorithms.online.stages``), a default
    micro-batch's groups per pass: those of one pass over the batch (float32), and XLA allocates
    less for them (4 passes of 2 groups)."""
    from relax.models.forward.config import ForwardConfig
    from relax.models.forward.prefix_shared import completion_logprobs

    p, g, n, lp = 8, 4, 32, 8
    model = init(tiny_config(64), jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 64, (p, lp)), jnp.int32)
    pm = jnp.ones((p, lp), jnp.int32)
    tokens = jnp.asarray(rng.integers(1, 64, (p, g, n)), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, (p, g, n)), jnp.int32)
    budget = Passes(micro_batch_tokens=2 * g * n)  # 2 groups per pass: 4 passes
    groups = budget.groups_per_pass(p, g * n)
    assert groups == 2

    def logprobs(groups):
        how = ForwardConfig().pass_(differentiated=False, groups_per_pass=groups)
        return jax.jit(lambda m, *xs: completion_logprobs(m, *xs, how))

    args = (model, ids, pm, tokens, mask)
    tiled, whole = logprobs(groups), logprobs(None)
    np.testing.assert_allclose(tiled(*args), whole(*args), rtol=1e-5, atol=1e-6)
    small = allocated_bytes(tiled.lower(*args).compile())
    large = allocated_bytes(whole.lower(*args).compile())
    assert 2 * small < large  # 2.35x less, as measured
