"""relax.plan.hlo_count: the FLOPs of the TPU compiler's convolutions (windows over padding and
dilated inputs count only their taps on real elements) and the trip counts of loops the TPU
compiler leaves unannotated, against hand counts. The compiled cases need libtpu (the ``tpu``
extra); the instruction cases need nothing."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from relax.parallel.hlo import Instr, parse_hlo
from relax.plan import targets
from relax.plan.hlo_count import dot_flops, trip_count

needs_tpu = pytest.mark.skipif(
    not targets.tpu_available(), reason="libtpu (the tpu extra) is not installed"
)


def _conv(out: str, lhs: str, attrs: str) -> float:
    ins = Instr("conv", out, "convolution", ["lhs", "rhs"], attrs, True, 0)
    return dot_flops(ins, {"lhs": Instr("lhs", lhs, "parameter", [], "", False, 0)})


@pytest.mark.parametrize(
    "out, lhs, attrs, flops",
    [
        # a projection of 32 x 32 tokens (64 model features on this chip) onto 4 heads of 64: the
        # window of 4 over an input of 1 padded by 3 each side gives each head one real tap
        (
            "f32[32,32,4,64]",
            "bf16[32,32,64,1]",
            ", window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f",
            2 * (32 * 32) * (4 * 64) * 64,
        ),
        # attention scores as a batched product: the batch axes [8, 2] are spatial, dilated by
        # the window's size and strided so that each output meets one real element; 2 queries,
        # 32 keys, 64 features
        (
            "f32[8,2,2,32]",
            "bf16[8,2,2,64]",
            ", window={size=8x2 stride=7x1 lhs_dilate=8x2}, dim_labels=01bf_01io->01bf",
            2 * (8 * 2) * 2 * 32 * 64,
        ),
        # a plain matmul, 128 rows (the spatial axis, under a batch of 1) x 256 -> 512
        (
            "f32[128,1,512]",
            "bf16[128,1,256]",
            ", window={size=1}, dim_labels=0bf_io0->0bf",
            2 * 128 * 512 * 256,
        ),
        # a contraction over a spatial axis the window spans whole (a weight's gradient: 8
        # positions x 16 features, batch 4, into 32 features)
        (
            "f32[4,32,1]",
            "bf16[8,16,4]",
            ", window={size=8}, dim_labels=0fb_0io->bf0",
            2 * (4 * 32) * 8 * 16,
        ),
    ],
)
def test_convolution_flops_count_taps_on_real_elements(out, lhs, attrs, flops):
    assert _conv(out, lhs, attrs) == flops


def _compiled(fn, *args):
    """``fn`` compiled for one v5e chip (libtpu's compile-only client), ``args`` abstract."""
    mesh = jax.make_mesh((1,), ("x",), devices=targets.devices(targets.Target.parse("v5e:2x2"))[:1])
    on_chip = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_chip) for a in args]
    return jax.jit(fn).lower(*placed).compile()


def _whiles(compiled) -> list[int | None]:
    comps, _ = parse_hlo(compiled.as_text())
    out = []
    for instrs in comps.values():
        local = {i.name: i for i in instrs}
        out += [trip_count(i, comps, local) for i in instrs if i.op == "while"]
    return out


@needs_tpu
def test_scans_and_fori_loops_run_their_trip_count_on_tpu():
    """A scan of 8 matmuls and a ``fori_loop`` from 3 to 11 run 8 times: the roofline counts 8
    matmuls' FLOPs; a loop that stops on a value it computes is not counted (None)."""
    from relax.plan.hlo_summary import traffic

    chip = targets.Target.parse("v5e:2x2").chip
    m, k = 256, 512
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    ws = jax.ShapeDtypeStruct((8, k, k), jnp.bfloat16)
    scan = lambda x, ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]  # noqa: E731
    fori = lambda x, ws: jax.lax.fori_loop(3, 11, lambda i, h: jnp.tanh(h @ ws[i - 3]), x)  # noqa: E731

    def until(x, ws):  # runs while the sum is below a bound: its trip count depends on data
        step = lambda c: (c[0] + 1, jnp.tanh(c[1] @ ws[c[0] % 8]))  # noqa: E731
        return jax.lax.while_loop(lambda c: jnp.sum(c[1]) < 1e9, step, (0, x))[1]

    for fn in (scan, fori):
        compiled = _compiled(fn, x, ws)
        assert 8 in _whiles(compiled), compiled.as_text()[:2000]
        assert traffic("loop", compiled, chip).flops == 8 * 2 * m * k * k
    compiled = _compiled(until, x, ws)
    assert _whiles(compiled) == [None]
    assert traffic("loop", compiled, chip).flops == 2 * m * k * k  # counted once


@needs_tpu
def test_batched_attention_flops_on_tpu():
    """Attention's two batched products as the TPU compiler writes them (convolutions whose
    windows stand for the batch axes): 2 x batch x queries x keys x features each."""
    from relax.plan.hlo_summary import traffic

    chip = targets.Target.parse("v5e:2x2").chip
    h, g, m, s, d = 4, 2, 48, 64, 64
    q = jax.ShapeDtypeStruct((h, g, m, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((h, g, s, d), jnp.bfloat16)

    def attend(q, k, v):
        p = jax.nn.softmax(jnp.einsum("hgmd,hgsd->hgms", q, k).astype(jnp.float32), axis=-1)
        return jnp.einsum("hgms,hgsd->hgmd", p.astype(v.dtype), v)

    compiled = _compiled(attend, q, kv, kv)
    assert re.search(r"convolution|dot\(", compiled.as_text())
    assert traffic("attention", compiled, chip).flops == 2 * (2 * h * g * m * s * d)
