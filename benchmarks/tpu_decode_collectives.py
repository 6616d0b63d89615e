"""The sampler's decode loops compiled for a TPU slice (libtpu's compile-only client, no TPU), read
like ``tests/test_decode_sharding.py`` reads them on 8 simulated CPU devices: collectives in the
loops' bodies and conditions, and copies of a completion-cache block (HBM to HBM; the compiler's
prefetches into VMEM apart), summed over the 3 decode loops, for the same tiny model, batch and
meshes. Prints one JSON object per mesh with the CPU expectation beside it.

    JAX_PLATFORMS=cpu python benchmarks/tpu_decode_collectives.py            # v5e:2x4 (8 chips)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_decode_sharding import CHUNK, LP, MESHES, MODEL, G, N, P, expected  # noqa: E402

from relax.models import ModelConfig, init  # noqa: E402
from relax.parallel import make_mesh, param_shardings  # noqa: E402
from relax.parallel.hlo import COLLECTIVES, loop_ops  # noqa: E402
from relax.passes import target_backend  # noqa: E402
from relax.plan import Target  # noqa: E402
from relax.plan.targets import devices  # noqa: E402
from relax.rollout.sampler import RolloutConfig, compiled_generate  # noqa: E402


def case(spec: str, chips) -> dict:
    model = jax.eval_shape(lambda k: init(ModelConfig(**MODEL), k), jax.random.key(0))
    mesh = make_mesh(spec, chips)
    typed = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    model = jax.tree.map(typed, model, param_shardings(model, mesh))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    ids = jax.ShapeDtypeStruct((P, LP), jnp.int32, sharding=rows)
    key = jax.ShapeDtypeStruct(
        (), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PartitionSpec())
    )
    gen = compiled_generate(RolloutConfig(num_generations=G, max_new_tokens=N, cache_chunk=CHUNK))
    with target_backend("tpu"), jax.set_mesh(mesh):
        text = gen.lower(model, ids, ids, key).compile().as_text()
    name = lambda c: {f"{op} {shape}": n for (op, shape), n in sorted(c.items())}
    hk = MODEL["num_kv_heads"]
    dims = {
        (r, h, a, b)
        for r in range(1, P * G + 1)
        for h in range(1, hk + 1)
        for a, b in ((8, CHUNK), (CHUNK, 8), (8, N - 2 * CHUNK), (N - 2 * CHUNK, 8))
    }
    block = lambda s: any(f"[{','.join(map(str, d))}]" in s for d in dims)
    # a copy-start's shape is (destination, source, context): its destination in HBM is a duplicate,
    # in VMEM (memory space 1) the compiler's prefetch, which is how the step reads the block
    copies = {
        f"copy {s}": n
        for (op, s), n in loop_ops(text, ("copy",), hbm_only=True).items()
        if block(s)
    }
    prefetches = {
        f"copy {s}": n - copies.get(f"copy {s}", 0)
        for (op, s), n in loop_ops(text, ("copy",)).items()
        if block(s)
    }
    body, condition = expected(spec)
    return {
        "mesh": spec,
        "body": name(loop_ops(text, COLLECTIVES)),
        "condition": name(loop_ops(text, COLLECTIVES, part="condition")),
        "cache_copies": copies,
        "cache_prefetches": {k: n for k, n in prefetches.items() if n},
        "cpu_expected_body": body,
        "cpu_expected_condition": condition,
    }


def main(target: str = "v5e:2x4") -> None:
    chips = devices(Target.parse(target))
    for spec in MESHES:
        print(json.dumps({"target": target, **case(spec, chips)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
