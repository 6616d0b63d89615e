"""The training forwards on an ``fsdp`` mesh run FSDP: each layer's weights, and the output head,
are gathered whole for their use and their gradients reduced back; no device computes another
device's rows. Read from the optimized HLO (``relax.parallel.hlo.collectives``): the only
all-reduces left carry gradients (parameter-shaped) or scalars. Before, the partitioner kept the
weights split over the model width and all-reduced activation-sized partial products (the
logits of every chunk on every device: benchmarks/RESULTS.md, forty-second session).

Four simulated devices need ``--xla_force_host_platform_device_count`` before jax starts: one
subprocess (this file as a script) computes everything and writes JSON for the tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
MODEL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
P, LP, G, N, CHUNK = 4, 8, 2, 12, 16  # 8 completion rows of 12: 96 rows, 6 chunks on one device


def _losses():
    import jax
    import jax.numpy as jnp

    from relax.models.decoder.logprobs import token_logprobs
    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs

    ids = jax.random.randint(jax.random.key(1), (P * G, LP + N), 1, MODEL["vocab_size"])
    prompts, completions = ids[::G, :LP], ids[:, LP:].reshape(P, G, N)
    cmask = jnp.ones_like(completions).at[1, 0, 7:].set(0)
    how = ForwardPass(remat=True, with_entropy=True, chunk_size=CHUNK)

    def plain(model, ids):  # hidden_states' layer scan, no remat
        return jnp.sum(token_logprobs(model, ids, chunk_size=CHUNK))

    def shared(model, prompts, completions, cmask):  # prefix-shared, remat, entropy
        lp, ent = completion_logprobs(
            model, prompts, jnp.ones_like(prompts), completions, cmask, how
        )
        return jnp.sum(lp * cmask) + 0.1 * jnp.sum(ent * cmask)

    return {"plain": (plain, (ids,)), "shared": (shared, (prompts, completions, cmask))}


def worker(out_path: str) -> None:
    import jax

    from relax import parallel
    from relax.models import ModelConfig, init
    from relax.parallel.hlo import collectives

    model = init(ModelConfig(**MODEL), jax.random.key(0), std=0.1)
    mesh = parallel.make_mesh("fsdp=4", jax.devices()[:4])
    shapes = {tuple(x.shape) for x in jax.tree.leaves(model)}
    shapes |= {s[1:] for s in shapes}  # one layer's slice of a stacked weight
    results = {}
    for name, (loss, args) in _losses().items():
        step = jax.jit(jax.value_and_grad(loss))
        value, grads = step(model, *args)
        with jax.set_mesh(mesh):
            m = parallel.shard_model(model, mesh)
            placed = [jax.device_put(a, parallel.batch_sharding(mesh)) for a in args]
            step = jax.jit(jax.value_and_grad(loss))
            mvalue, mgrads = step(m, *placed)
            text = step.lower(m, *placed).compile().as_text()
        found = collectives(text, dict(mesh.shape))
        results[name] = {
            "value": [float(value), float(mvalue)],
            "grad_diff": max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(mgrads))
            ),
            "grad_scale": max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(grads)),
            "all_reduces": [shape for (op, shape, _), _n in found.items() if op == "all-reduce"],
            "param_shapes": [list(s) for s in shapes],
        }
    Path(out_path).write_text(json.dumps(results))


def _arrays(shape: str) -> list[tuple[int, ...]]:
    from relax.parallel.hlo import arrays

    return [dims for _, dims in arrays(shape)]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    worker(sys.argv[1])
else:
    import pytest
    from test_parallel import run_worker

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        out = tmp_path_factory.mktemp("fsdp_forward") / "results.json"
        run_worker(HERE, [str(out)], devices=4)
        return json.loads(out.read_text())

    @pytest.mark.parametrize("forward", ("plain", "shared"))
    @pytest.mark.slow
    def test_fsdp_forward_and_gradients_equal_one_device(results, forward):
        got = results[forward]
        np.testing.assert_allclose(got["value"][1], got["value"][0], rtol=1e-5)
        assert got["grad_diff"] <= 1e-5 * got["grad_scale"], got

    @pytest.mark.parametrize("forward", ("plain", "shared"))
    def test_fsdp_forward_all_reduces_only_gradients(results, forward):
        """Every all-reduce's arrays are parameter-shaped (a gradient) or scalars: no logits,
        activations or partial products."""
        got = results[forward]
        params = {tuple(s) for s in got["param_shapes"]}
        assert got["all_reduces"], "no gradient all-reduce found: the parse is broken"
        for shape in got["all_reduces"]:
            for dims in _arrays(shape):
                assert dims in params or np.prod(dims) <= 1, (shape, dims)
