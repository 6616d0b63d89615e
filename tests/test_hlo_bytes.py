"""relax.parallel.hlo's HBM accounting on hand-written HLO: arrays in another memory space (a TPU
core's VMEM, ``S(1)``) are not HBM traffic, a prefetch into VMEM is not a copy of the cache, a
slice streamed into VMEM reads only the slice. The byte counts are worked out by hand."""

from __future__ import annotations

from relax.parallel.hlo import device_bytes, kernel_bytes, loop_ops, nbytes, parse_hlo
from relax.plan import targets
from relax.plan.hlo_summary import traffic

# f32[4,8] = 128 bytes, f32[64,8] = 2048, f32[16,8] = 512, f32[8] = 32
HLO = """HloModule m

%fused (param_0: f32[4,8], param_1: f32[8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0:T(8,128)S(1)} parameter(0)
  %param_1 = f32[8]{0} parameter(1)
  %b = f32[4,8]{1,0} broadcast(%param_1), dimensions={1}
  ROOT %add = f32[4,8]{1,0} add(%param_0, %b)
}

%body (s: (s32[], f32[4,8], f32[64,8], f32[8])) -> (s32[], f32[4,8], f32[64,8], f32[8]) {
  %s = (s32[], f32[4,8]{1,0}, f32[64,8]{1,0}, f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%s), index=1
  %w = f32[64,8]{1,0} get-tuple-element(%s), index=2
  %v = f32[8]{0} get-tuple-element(%s), index=3
  %pf = (f32[4,8]{1,0:T(8,128)S(1)}, f32[4,8]{1,0}, u32[]{:S(2)}) copy-start(%x)
  %pd = f32[4,8]{1,0:T(8,128)S(1)} copy-done(%pf)
  %ss = ((f32[64,8]{1,0}), f32[16,8]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:16], [0:8]}
  %sd = f32[16,8]{1,0:T(8,128)S(1)} slice-done(%ss)
  %f = f32[4,8]{1,0} fusion(%pd, %v), kind=kLoop, calls=%fused
  %dup = f32[4,8]{1,0} copy(%f)
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[64,8]{1,0}, f32[8]{0}) tuple(%i, %dup, %w, %v)
}

%cond (s: (s32[], f32[4,8], f32[64,8], f32[8])) -> pred[] {
  %s = (s32[], f32[4,8]{1,0}, f32[64,8]{1,0}, f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4,8], w: f32[64,8], v: f32[8]) -> (s32[], f32[4,8], f32[64,8], f32[8]) {
  %a = f32[4,8]{1,0} parameter(0)
  %w = f32[64,8]{1,0} parameter(1)
  %v = f32[8]{0} parameter(2)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[4,8]{1,0}, f32[64,8]{1,0}, f32[8]{0}) tuple(%z, %a, %w, %v)
  ROOT %loop = (s32[], f32[4,8]{1,0}, f32[64,8]{1,0}, f32[8]{0}) while(%t0), condition=%cond, body=%body
}
"""


def body():
    comps, _ = parse_hlo(HLO)
    return comps, {i.name: i for i in comps["body"]}


def test_device_bytes_count_hbm_arrays_only():
    prefetch = "(f32[4,8]{1,0:T(8,128)S(1)}, f32[4,8]{1,0}, u32[]{:S(2)})"
    assert nbytes(prefetch) == 128 + 128 + 4
    assert (
        device_bytes(prefetch) == 128
    )  # the source; the VMEM destination and the context are on chip
    assert device_bytes(prefetch, first_only=True) == 0
    assert device_bytes("f32[4,8]{1,0}") == device_bytes("f32[4,8]") == 128


def test_kernel_bytes_by_hand():
    comps, local = body()
    assert kernel_bytes(local["pf"], comps, local) == (128, False)  # reads x from HBM, writes VMEM
    assert kernel_bytes(local["ss"], comps, local) == (512, False)  # reads 16 of 64 rows, into VMEM
    assert kernel_bytes(local["f"], comps, local) == (
        32 + 128,
        False,
    )  # v read, the sum written; pd is in VMEM
    assert kernel_bytes(local["dup"], comps, local) == (256, False)  # HBM to HBM: read and written


class Compiled:
    def as_text(self):
        return HLO


def test_cache_copies_are_hbm_duplicates_not_prefetches():
    copies = loop_ops(HLO, ("copy",))
    assert sum(copies.values()) == 2  # the prefetch and the duplicate
    assert loop_ops(HLO, ("copy",), hbm_only=True) == {("copy", "f32[4,8]"): 1}
    chip = targets.Target.parse("v5e:2x2").chip
    t = traffic("rollout", Compiled(), chip, decode_trip=10, cache_dims=frozenset({(4, 8)}))
    assert t.cache_copies == 1
    assert t.bytes == 10 * (128 + 512 + 160 + 256)  # ten decode steps of the four kernels above
