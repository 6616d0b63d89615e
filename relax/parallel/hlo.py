"""What a compiled program does, read from its optimized HLO text.

``jax.jit(f).lower(*args).compile().as_text()`` is the program XLA runs. ``parse_hlo`` splits it
into computations of instructions (name, result shape, op, operands, attributes). A ``while``
whose trip count XLA knows is a ``lax.scan`` (a layer stack, say); one whose count it does not
know is a ``lax.while_loop`` (the sampler's decode segments). ``loop_ops`` counts instructions of
given kinds (collectives, copies) run by the loops' bodies or conditions, so a test can say "the
decode step talks to no other device beyond what its layout implies and copies no cache"::

    text = compiled.as_text()
    loop_ops(text, COLLECTIVES)                     # {(op, shape): count} over decode-loop bodies
    loop_ops(text, COLLECTIVES, part="condition")   # the loops' stop checks

``collectives(text, mesh.shape)`` counts every collective of a program by the mesh axes its
device groups span (``replica_groups``), e.g. ``("all-gather", "f32[16,32]", ("expert",))``.

``kernel_bytes`` is what one kernel moves in HBM (``benchmarks/gpu_profile.py`` and
``relax.plan.hlo_summary`` read it).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Literal

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}
_ARRAY = re.compile(
    r"\b(pred|bf16|c64|c128|f8e\w+?|[suf]\d+)\[([\d,]*)\](\{[^}]*\})?"
)  # dtype, dims, layout
_SPACE = re.compile(r"S\([1-9]\d*\)")  # a memory space other than the default (0)
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
FREE = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "opt-barrier",
    "add-dependency",
    "domain",
    "partition-id",
    "replica-id",
}  # no kernel
CONTROL = {"while", "call", "conditional"}  # run the kernels of the computations they call
SLICES = {"dynamic-slice", "slice", "gather"}  # read only the part they return


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of each array in an HLO shape (a tuple shape gives several)."""
    return [(t, tuple(int(x) for x in d.split(",") if x)) for t, d, _ in _ARRAY.findall(shape)]


def nbytes(shape: str, first_only: bool = False) -> int:
    """Size of an HLO shape, e.g. ``bf16[64,2048]{1,0}`` = 64 * 2048 * 2; tuples summed."""
    arrs = arrays(shape)[:1] if first_only else arrays(shape)
    return int(sum(_itemsize(t) * math.prod(d) for t, d in arrs))


def _itemsize(dtype: str) -> float:
    return _BYTES.get(
        dtype, 1 if dtype.startswith("f8") else int(re.sub(r"\D", "", dtype) or 8) / 8
    )


def device_bytes(shape: str, first_only: bool = False) -> int:
    """Like ``nbytes``, of the arrays in the device's main memory (HBM) only: an array whose
    layout names another memory space (``{1,0:T(8,128)S(1)}``: a TPU core's VMEM; host memory
    on GPU) is not counted."""
    arrs = _ARRAY.findall(shape)[:1] if first_only else _ARRAY.findall(shape)
    return int(
        sum(
            _itemsize(t) * math.prod(int(x) for x in d.split(",") if x)
            for t, d, layout in arrs
            if not _SPACE.search(layout)
        )
    )


def hbm_to_hbm(ins: Instr, local: dict[str, Instr]) -> bool:
    """Whether ``ins`` (a copy, say) reads HBM and writes HBM: not a prefetch into, or an eviction
    from, on-chip memory (an async copy's result is (destination, source alias, context))."""
    reads = sum(device_bytes(local[o].shape) for o in ins.operands if o in local)
    return bool(reads and device_bytes(ins.shape, first_only=True))


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    root: bool
    pos: int  # order in the text (the entry computation is scheduled: execution order)
    literal: str = ""  # a constant's value as written (``constant(2)``: "2")

    def called(self) -> list[str]:
        names = _CALLED.findall(self.attrs)
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        return names + (re.findall(r"%([\w.\-]+)", m.group(1)) if m else [])


def _close(s: str, i: int) -> int:
    """Index of the parenthesis closing the one at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j
    return len(s)


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """Computations (name -> instructions) of an HLO module's text, and the entry's name."""
    comps, entry, cur, pos = {}, None, None, 0
    for line in text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$", line)
        if head:
            cur = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
            continue
        m = re.match(r"^\s+(ROOT\s+)?%([\w.\-]+)\s*=\s*", line)
        if cur is None or not m:
            cur = None if line.startswith("}") else cur
            continue
        rest = line[m.end() :]
        k = _close(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
        shape, rest = rest[:k], rest[k:].lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        close, pos = _close(rest, op.end() - 1), pos + 1
        cur.append(
            Instr(
                m.group(2),
                shape,
                op.group(1),
                re.findall(r"%([\w.\-]+)", rest[op.end() : close]),
                rest[close + 1 :],
                bool(m.group(1)),
                pos,
                rest[op.end() : close] if op.group(1) == "constant" else "",
            )
        )
    return comps, entry


def launching(comps, name: str) -> list[str]:
    """``name`` and every computation whose kernels it runs (while bodies and conditions, called
    computations such as command buffers, conditional branches), not the fused ones."""
    out = [name]
    for ins in comps.get(name, []):
        if ins.op in CONTROL:
            for c in ins.called():
                out += [x for x in launching(comps, c) if x not in out]
    return out


def loops(comps: dict[str, list[Instr]], entry: str, *, scans: bool = False) -> list[Instr]:
    """The ``while`` instructions the entry runs, in program order: those of unknown trip count
    (``lax.while_loop``), or with ``scans`` those of known count (``lax.scan``)."""
    found = [
        i
        for c in launching(comps, entry)
        for i in comps[c]
        if i.op == "while" and ("known_trip_count" in i.attrs) == scans
    ]
    return sorted(found, key=lambda i: i.pos)


def loop_ops(
    text: str,
    ops: Iterable[str],
    *,
    part: Literal["body", "condition"] = "body",
    scans: bool = False,
    hbm_only: bool = False,
) -> collections.Counter:
    """``{(op, result shape without layout): count}`` of the instructions named ``ops`` (an async
    ``-start`` half counts as its op) that the loops' ``part`` runs, summed over the loops.
    ``hbm_only``: only those from HBM to HBM (``hbm_to_hbm``), e.g. not the TPU compiler's
    prefetches of a buffer into VMEM."""
    comps, entry = parse_hlo(text)
    names = {o: o for o in ops} | {f"{o}-start": o for o in ops}
    found: collections.Counter = collections.Counter()
    for loop in loops(comps, entry, scans=scans):
        root = re.search(part + r"=%([\w.\-]+)", loop.attrs).group(1)
        for c in launching(comps, root):
            local = {i.name: i for i in comps[c]}
            for ins in comps[c]:
                if ins.op in names and (not hbm_only or hbm_to_hbm(ins, local)):
                    found[(names[ins.op], re.sub(r"\{[^}]*\}", "", ins.shape))] += 1
    return found


def _fusion_bytes(body: list[Instr]) -> tuple[int, bool]:
    """Bytes a fusion moves: its parameters read + its outputs written, except that a parameter
    read only through slices/gathers counts their results, and an output that is a
    dynamic-update-slice of a parameter used nowhere else is in place: it writes only the update
    and does not read the buffer (returned flag). An approximation of what XLA emits."""
    by = {i.name: i for i in body}
    users = collections.defaultdict(list)
    for i in body:
        for o in i.operands:
            users[o].append(i)

    def base(n):  # through bitcasts, backwards
        while n in by and by[n].op == "bitcast":
            n = by[n].operands[0]
        return n

    def uses(n):  # users, through bitcasts, forwards
        return [v for u in users[n] for v in (uses(u.name) if u.op == "bitcast" else [u])]

    root = next(i for i in reversed(body) if i.root)
    outs = [by[o] for o in root.operands] if root.op == "tuple" else [root]
    written, inplace = 0, set()
    for o in outs:
        x = by[base(o.name)]
        buf = base(x.operands[0]) if x.op == "dynamic-update-slice" else None
        if buf in by and by[buf].op == "parameter" and uses(buf) == [x]:
            inplace.add(buf)
            written += device_bytes(by[x.operands[1]].shape)
        else:
            written += device_bytes(o.shape)
    read = 0
    for prm in (i for i in body if i.op == "parameter" and i.name not in inplace):
        us = uses(prm.name)
        sliced = us and all(u.op in SLICES and base(u.operands[0]) == prm.name for u in us)
        whole = device_bytes(prm.shape)
        read += min(sum(device_bytes(u.shape) for u in us), whole) if sliced else whole
    return read + written, bool(inplace)


def kernel_bytes(ins: Instr, comps, local: dict[str, Instr]) -> tuple[int, bool]:
    """HBM bytes one execution of a kernel moves (operands read + result written, ``_fusion_bytes``
    for a fusion; a dynamic-update-slice reads and writes only its update) and whether in place."""
    operand = lambda i: (
        device_bytes(local[ins.operands[i]].shape) if ins.operands[i] in local else 0
    )
    if ins.op == "fusion" and ins.called() and ins.called()[0] in comps:
        return _fusion_bytes(comps[ins.called()[0]])
    if ins.op == "dynamic-update-slice":
        return 2 * operand(1), True
    if ins.op in SLICES:
        return 2 * device_bytes(ins.shape), False
    if ins.op == "slice-start":  # ((source alias), slice, context): reads and writes the slice
        (dtype, dims, layout), src = _ARRAY.findall(ins.shape)[-2], ins.operands[0]
        size = _itemsize(dtype) * math.prod(int(x) for x in dims.split(",") if x)
        in_hbm = src in local and device_bytes(local[src].shape) > 0
        return int(size * in_hbm + (0 if _SPACE.search(layout) else size)), False
    # a GEMM custom-call's result is (output, workspace): the workspace is not traffic; an async
    # copy's is (destination, source alias, context): it writes the destination
    result = device_bytes(ins.shape, first_only=ins.op in ("custom-call", "copy-start"))
    return sum(operand(i) for i in range(len(ins.operands))) + result, False


# ------------------------------------------------------------------------------ collectives by mesh axis

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def replica_groups(attrs: str, num_devices: int) -> frozenset[tuple[int, ...]]:
    """The device groups of a collective's ``replica_groups`` (partition ids: positions in the
    mesh's row-major device order), in any of XLA's three spellings::

        {{0,1},{2,3}}                          explicit ({} : one group of every device)
        [2,4]<=[4,2]T(1,0)                     iota(4 x 2), transposed, reshaped to 2 groups of 4
        mesh['axis_0'=2,'axis_1'=4] {'axis_0'}  the groups along the named axes of iota(2 x 4)
    """
    if m := _IOTA.search(attrs):
        shape, dims = (
            [int(x) for x in m.group(1).split(",")],
            [int(x) for x in m.group(2).split(",")],
        )
        ids = np.arange(math.prod(dims)).reshape(dims)
        ids = ids.transpose([int(x) for x in m.group(3).split(",")]) if m.group(3) else ids
        return frozenset(tuple(sorted(int(x) for x in g)) for g in ids.reshape(shape))
    if m := _MESH.search(attrs):
        axes = dict(
            (k.strip("' "), int(v)) for k, v in (a.split("=") for a in m.group(1).split(","))
        )
        return mesh_axis_groups(axes, [a.strip("' ") for a in m.group(2).split(",") if a.strip()])
    m = _EXPLICIT.search(attrs)
    groups = (
        []
        if m is None
        else [
            tuple(sorted(int(x) for x in g.split(",") if x.strip()))
            for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
        ]
    )
    return frozenset(g for g in groups if g) or frozenset({tuple(range(num_devices))})


def mesh_axis_groups(shape: dict[str, int], axes: Iterable[str]) -> frozenset[tuple[int, ...]]:
    """The groups of devices of a mesh of ``shape`` (axis -> size, in order) that differ only
    along ``axes``: those a collective over ``axes`` runs in."""
    names, axes = list(shape), list(axes)
    ids = np.moveaxis(
        np.arange(math.prod(shape.values())).reshape(list(shape.values())),
        [names.index(a) for a in axes],
        list(range(len(names) - len(axes), len(names))),
    )
    return frozenset(
        tuple(sorted(int(x) for x in g)) for g in ids.reshape(-1, math.prod(shape[a] for a in axes))
    )


def collectives(text: str, mesh_shape: dict[str, int]) -> collections.Counter:
    """``{(op, result shape without layout, mesh axes): count}`` of every collective in the
    program (an async ``-start`` counts as its op), its device groups named by the mesh axes they
    span (e.g. ``("expert",)``; the axes of size > 1 only; ``("?",)`` when no set of axes gives
    them)."""
    comps, _ = parse_hlo(text)
    n = math.prod(mesh_shape.values())
    live = [a for a, s in mesh_shape.items() if s > 1]
    subsets = [tuple(a for i, a in enumerate(live) if k >> i & 1) for k in range(1, 1 << len(live))]
    by_groups = {mesh_axis_groups(mesh_shape, s): s for s in subsets}
    names = {o: o for o in COLLECTIVES} | {f"{o}-start": o for o in COLLECTIVES}
    found: collections.Counter = collections.Counter()
    for ins in (i for body in comps.values() for i in body if i.op in names):
        axes = by_groups.get(replica_groups(ins.attrs, n), ("?",))
        found[(names[ins.op], re.sub(r"\{[^}]*\}", "", ins.shape), axes)] += 1
    return found
