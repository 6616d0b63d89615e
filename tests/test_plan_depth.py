"""relax.plan.depth: which depths a deep sampler is compiled at, and the line through them,
against hand-computed values (the compiled comparison with a whole compile is in test_plan.py)."""

from __future__ import annotations

import pytest

from relax.models.config.model import small_config
from relax.plan import depth
from relax.plan.hlo_summary import ProgramTraffic
from relax.plan.memory import ProgramMemory

GEMMA = ("sliding",) * 5 + ("full",)


@pytest.mark.parametrize(
    "layers,kinds,period,depths",
    [
        (24, None, 1, (4, 8)),  # one kind: the smallest depths
        (12, None, 1, None),  # 4 + 8 layers compiled for 12: nothing to save
        (13, None, 1, (4, 8)),
        (
            26,
            (GEMMA * 5)[:26],
            6,
            (6, 12),
        ),  # Gemma 3: five sliding to one full, from the first layer
        (18, (GEMMA * 3), 6, None),
        (
            24,
            ("sliding",) * 20 + ("full",) * 4,
            None,
            None,
        ),  # kinds that do not repeat: compiled whole
        (48, ("sliding", "full") * 24, 2, (4, 8)),
    ],
)
def test_depths_follow_the_period_of_the_layer_kinds(layers, kinds, period, depths):
    config = small_config(
        num_layers=layers, layer_types=kinds, sliding_window=None if kinds is None else 64
    )
    assert depth.kinds_period(config) == period
    assert depth.depths(config) == depths


def test_shallow_keeps_the_first_layers_and_their_kinds():
    config = small_config(num_layers=26, layer_types=(GEMMA * 5)[:26], sliding_window=64)
    low = depth.shallow(config, 12)
    assert low.num_layers == 12 and low.layer_types == GEMMA * 2
    assert (low.hidden_size, low.vocab_size) == (config.hidden_size, config.vocab_size)


def memory(
    temp: int, kv: int, outputs: int, *, error=None, limit=100, compile_s=1.0
) -> ProgramMemory:
    return ProgramMemory(
        "rollout", 0, 0, 0, 0, 0, kv, temp - kv, outputs, 0, limit, error, compile_s
    )


class Leaf:
    """A ShapeDtypeStruct stand-in without a sharding: its bytes are the whole array's."""

    def __init__(self, n: int):
        import numpy as np

        self.shape, self.dtype, self.sharding = (n,), np.dtype("float32"), None


def test_memory_on_the_line_through_two_depths():
    import types

    # temporaries 30 at 2 layers and 50 at 4: 10 per layer, so 10 + 10 L = 250 at 24; outputs constant
    state = types.SimpleNamespace(
        policy=[Leaf(6)], opt_state=[Leaf(12)], ref=None, critic=None, critic_opt_state=None
    )
    args = (state, {"prompt_ids": Leaf(2)})
    m = depth.extend_memory("rollout", args, 200, memory(30, 10, 7), memory(50, 20, 7), 2, 4, 24)
    assert (m.weights, m.optimizer, m.batch) == (
        24,
        48,
        8,
    )  # 4 bytes each, exact from the arguments
    assert (m.kv_cache, m.activations, m.outputs) == (200, 50, 7)
    assert m.total == 24 + 48 + 8 + 7 + 250 and m.depths == (2, 4) and m.compile_s == 2.0
    assert m.error is None and m.limit == 100
    # a shallow compile refused for memory: its message and the compiler's limit are passed on
    refused = depth.extend_memory(
        "rollout", args, 200, memory(30, 0, 0), memory(50, 0, 0, error="OOM", limit=90), 2, 4, 24
    )
    assert refused.error == "OOM" and refused.limit == 90 and not refused.fits
    # the caches never exceed the temporaries they live in
    small = depth.extend_memory(
        "rollout", args, 10**6, memory(30, 0, 0), memory(50, 0, 0), 2, 4, 24
    )
    assert small.kv_cache == 250 and small.activations == 0


def test_traffic_on_the_line_through_two_depths():
    ta = ProgramTraffic(
        "rollout", 10.0, 100.0, 1.0, {"all-gather": (11, 300)}, {"all-reduce": (3, 90)}, 0.5, 4
    )
    tb = ProgramTraffic(
        "rollout",
        14.0,
        160.0,
        1.5,
        {"all-gather": (19, 500), "all-to-all": (2, 8)},
        {"all-reduce": (3, 90)},
        0.7,
        8,
    )
    t = depth.extend_traffic(ta, tb, 2, 4, 12)  # five times the step from 2 to 4 beyond 2
    assert (t.flops, t.bytes, t.seconds) == (30.0, 400.0, 3.5)
    assert t.collectives == {"all-gather": (51, 1300), "all-to-all": (10, 40)}
    assert t.decode_collectives == {
        "all-reduce": (3, 90)
    }  # the same at every depth: per step, not per layer
    assert t.decode_step_seconds == pytest.approx(1.5) and t.cache_copies == 24


def test_deepened_sampler_outputs_record_every_sparse_layer():
    """A shallow sampler records the experts of its own sparse layers; the full-depth programs
    that read its outputs (reference, update) get them for all of the model's."""
    import jax
    import jax.numpy as jnp

    from relax.models.forward.routes import Routes
    from relax.rollout.sampler import Rollout

    config = small_config(
        family="mixtral",
        num_layers=24,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    )
    s = lambda *shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    shallow = Rollout(
        tokens=s(2, 3, 5),
        mask=s(2, 3, 5),
        logprobs=s(2, 3, 5, dt=jnp.float32),
        lengths=s(2, 3),
        finished=s(2, 3, dt=bool),
        routes=Routes(prompt=s(2, 7, 4, 2, dt=jnp.int8), completion=s(2, 3, 5, 4, 2, dt=jnp.int8)),
    )
    deep = depth.deepen_outputs(shallow, config)
    assert deep.routes.prompt.shape == (2, 7, 24, 2) and deep.routes.completion.shape == (
        2,
        3,
        5,
        24,
        2,
    )
    assert deep.routes.prompt.dtype == jnp.int8 and deep.tokens.shape == (2, 3, 5)
