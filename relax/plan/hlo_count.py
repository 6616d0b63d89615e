"""Counts read from a compiled program's optimized HLO (``relax.parallel.hlo``): how many times a
while loop runs (``trip_count``) and how many FLOPs a dot or a convolution does (``dot_flops``).

A dot contracts its operands' contracting dimensions::

    flops = 2 * prod(result dims) * prod(lhs contracting dims)

The TPU compiler writes most matmuls as convolutions, some with windows that only stand for
batch dimensions or broadcasts: a window over a padded or dilated input whose taps mostly land
on padding or on the holes between dilated elements. Only the taps on real input elements
multiply anything, so per spatial dimension ``d`` of the window (input size ``n``, output size
``m``, window size ``k``, stride ``s``, padding ``lo``, input dilation ``a``, window dilation
``r``)::

    taps_d = #{(o, w) : o < m, w < k, p = o * s + w * r - lo, 0 <= p <= (n - 1) * a, a | p}
    flops  = 2 * prod(result dims) / prod(result spatial dims) * prod_d taps_d
               * lhs features / feature_group_count
"""

from __future__ import annotations

import math
import re

import numpy as np

from relax.parallel.hlo import Instr, arrays

_TRIP = re.compile(r"known_trip_count[^0-9]*(\d+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_LABELS = re.compile(r"dim_labels=(\w+)_\w+->(\w+)")  # a TPU matmul is a convolution: "bf_io->bf"
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_FIELD = re.compile(r"(size|pad|stride|lhs_dilate|rhs_dilate)=([\d_x]+)")
_GROUPS = re.compile(r"feature_group_count=(\d+)")


def dot_flops(ins: Instr, local: dict[str, Instr]) -> float:
    """The FLOPs of ``ins`` if it is a dot or a convolution (module docstring), else 0;
    ``local``: its computation's instructions by name."""
    if ins.op not in ("dot", "convolution") or not ins.operands or ins.operands[0] not in local:
        return 0.0
    out = arrays(ins.shape)
    lhs = arrays(local[ins.operands[0]].shape)
    if not out or not lhs:
        return 0.0
    dims, out_dims = lhs[0][1], out[0][1]
    if ins.op == "dot":
        m = _CONTRACT.search(ins.attrs)
        contracted = math.prod(dims[int(d)] for d in m.group(1).split(",") if d) if m else 0
        return 2.0 * math.prod(out_dims) * contracted
    labels = _LABELS.search(ins.attrs)
    if not labels or "f" not in labels.group(1) or len(labels.group(1)) != len(dims):
        return 0.0
    lhs_labels, out_labels = labels.groups()
    if len(out_labels) != len(out_dims):
        return 0.0
    groups = _GROUPS.search(ins.attrs)
    features = dims[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
    spatial = sorted(c for c in lhs_labels if c.isdigit())
    window = _WINDOW.search(ins.attrs)
    fields = dict(_FIELD.findall(window.group(1))) if window else {}
    per_dim = lambda name, default: (  # noqa: E731
        fields[name].split("x") if name in fields else [default] * len(spatial)
    )
    size, stride = per_dim("size", "1"), per_dim("stride", "1")
    lhs_dilate, rhs_dilate, pad = (
        per_dim("lhs_dilate", "1"),
        per_dim("rhs_dilate", "1"),
        per_dim("pad", "0_0"),
    )
    taps, outer = 1, math.prod(out_dims)
    for d, c in enumerate(spatial):
        n, m = dims[lhs_labels.index(c)], out_dims[out_labels.index(c)]
        taps *= _taps(
            n,
            m,
            int(size[d]),
            int(stride[d]),
            int(pad[d].split("_")[0]),
            int(lhs_dilate[d]),
            int(rhs_dilate[d]),
        )
        outer //= m
    return 2.0 * outer * taps * features


def _taps(n: int, m: int, k: int, s: int, lo: int, a: int, r: int) -> int:
    """Window taps on real input elements over a spatial dimension's ``m`` outputs (module
    docstring)."""
    o = np.arange(m, dtype=np.int64)
    total = 0
    for w in range(k):
        p = o * s + w * r - lo
        total += int(np.count_nonzero((p >= 0) & (p <= (n - 1) * a) & (p % a == 0)))
    return total


def _through(name: str, local: dict[str, Instr]) -> Instr | None:
    """The instruction behind ``name`` past copies, bitcasts and converts (None: not in ``local``)."""
    ins = local.get(name)
    while ins is not None and ins.op in ("copy", "bitcast", "convert") and len(ins.operands) == 1:
        ins = local.get(ins.operands[0])
    return ins


def _int(ins: Instr | None) -> int | None:
    """A scalar integer constant's value (None: ``ins`` is not one)."""
    if ins is None or ins.op != "constant":
        return None
    try:
        return int(ins.literal)
    except ValueError:
        return None


def _counter(ins: Instr | None, local: dict[str, Instr]) -> int | None:
    """The tuple index ``ins`` reads of its computation's parameter (None: not such a read)."""
    m = re.search(r"index=(\d+)", ins.attrs) if ins is not None else None
    if ins is None or ins.op != "get-tuple-element" or not m or not ins.operands:
        return None
    source = _through(ins.operands[0], local)
    return int(m.group(1)) if source is not None and source.op == "parameter" else None


def trip_count(ins: Instr, comps: dict[str, list[Instr]], local: dict[str, Instr]) -> int | None:
    """How many times the while loop ``ins`` runs: XLA's ``known_trip_count`` where the compiler
    writes it (CPU, GPU), else read from the form a ``lax.scan`` / ``fori_loop`` compiles to (the
    TPU compiler writes none)::

        i = k;  while (i < c) { ...; i = i + s }      ->      ceil((c - k) / s)  times

    (``k``, ``c``, ``s`` constants; the counter a slot of the loop's tuple). None for any other
    loop, e.g. a decode loop, whose condition also asks whether every row has stopped.
    ``local``: the instructions of the computation holding ``ins``, by name."""
    known = _TRIP.search(ins.attrs)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%([\w.\-]+)", ins.attrs)
    body = re.search(r"body=%([\w.\-]+)", ins.attrs)
    if not cond or not body or not ins.operands:
        return None
    c_local = {i.name: i for i in comps.get(cond.group(1), [])}
    b_local = {i.name: i for i in comps.get(body.group(1), [])}
    test = next((i for i in c_local.values() if i.root), None)
    if test is None or test.op != "compare" or "direction=LT" not in test.attrs:
        return None
    slot = _counter(_through(test.operands[0], c_local), c_local)
    end = _int(_through(test.operands[1], c_local))
    init = _through(ins.operands[0], local)
    out = next((i for i in b_local.values() if i.root), None)
    if slot is None or end is None or init is None or out is None:
        return None
    if (
        init.op != "tuple"
        or out.op != "tuple"
        or slot >= min(len(init.operands), len(out.operands))
    ):
        return None
    start, step = _int(_through(init.operands[slot], local)), _through(out.operands[slot], b_local)
    if start is None or step is None or step.op != "add" or len(step.operands) != 2:
        return None
    a, b = (_through(o, b_local) for o in step.operands)
    stride = (
        _int(b)
        if _counter(a, b_local) == slot
        else _int(a)
        if _counter(b, b_local) == slot
        else None
    )
    if not stride or stride < 0:
        return None
    return max(0, -(-(end - start) // stride))
