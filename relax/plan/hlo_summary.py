"""What a compiled program does per chip, read from its optimized HLO (``relax.parallel.hlo``).

Every kernel the program launches (a fusion, a dot, a collective, a copy, ...) is counted as
many times as it runs: a ``lax.scan`` body (a layer scan, micro-batches, passes) times its trip
count (``relax.plan.hlo_count.trip_count``), a decode loop (``lax.while_loop`` that also stops
when every row has) per decode step. For each kernel:

    flops  = the FLOPs of each dot and convolution inside it   (``relax.plan.hlo_count.dot_flops``:
                                                                a convolution's window counts its
                                                                taps on real input elements)
    bytes  = its operands' bytes + its result's bytes          (what it reads and writes in HBM;
                                                                arrays in on-chip memory, e.g. the
                                                                TPU's VMEM, are not counted)
    time  >= max(flops / peak FLOP/s, bytes / HBM bandwidth)   (the roofline of that kernel)

and the program's estimated time is the sum of its kernels' (a lower bound: no overlap of
kernels, no launch or collective latency; ICI/NVLink time is not modelled). A fusion's operand
that it only slices or gathers from is charged what it takes (``relax.parallel.hlo.kernel_bytes``).
Collectives are listed by kind with their bytes (the result's), per run and per decode step;
``cache_copies`` counts copies inside decode loops of arrays shaped like a KV cache block from
HBM to HBM (duplicates); the TPU compiler's prefetches of blocks into VMEM (``copy-start`` to
memory space 1) are how the step reads them and are not counted.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

from relax.parallel.hlo import (
    COLLECTIVES,
    CONTROL,
    FREE,
    Instr,
    arrays,
    hbm_to_hbm,
    kernel_bytes,
    nbytes,
    parse_hlo,
)
from relax.plan.hlo_count import dot_flops, trip_count


@dataclasses.dataclass(frozen=True)
class ProgramTraffic:
    """Per chip: ``flops``, HBM ``bytes`` and the roofline ``seconds`` of one run; collectives
    ``{kind: (count, bytes)}`` outside decode loops per run, inside them per decode step; per
    decode step too: ``decode_step_seconds``, ``cache_copies`` and ``decode_step_bytes`` (the HBM
    bytes its kernels read and write: the weights a step reads, 1 byte each for an 8-bit sampler)."""

    name: str
    flops: float
    bytes: float
    seconds: float
    collectives: dict[str, tuple[int, int]]
    decode_collectives: dict[str, tuple[int, int]]
    decode_step_seconds: float
    cache_copies: int
    decode_step_bytes: float = 0.0


def _kernel(
    ins: Instr, comps: dict[str, list[Instr]], local: dict[str, Instr]
) -> tuple[float, float]:
    """``(flops, bytes)`` of one launched instruction (a fusion: the dots inside it, fusions
    nested in it included)."""
    return _flops(ins, comps, local), float(kernel_bytes(ins, comps, local)[0])


def _flops(ins: Instr, comps: dict[str, list[Instr]], local: dict[str, Instr]) -> float:
    """The FLOPs of ``ins``'s dots: its own, or a fusion's, through the fusions it calls."""
    if ins.op != "fusion":
        return dot_flops(ins, local)
    total = 0.0
    for c in ins.called():
        inner = {i.name: i for i in comps.get(c, [])}
        total += sum(_flops(i, comps, inner) for i in comps.get(c, []))
    return total


def _walk(
    comps,
    name: str,
    times: float,
    decode: bool,
    out: dict,
    decode_trip: int | None,
    cache_dims: frozenset,
) -> None:
    local = {i.name: i for i in comps.get(name, [])}
    for ins in comps.get(name, []):
        if ins.op == "while":
            trip = trip_count(ins, comps, local)
            body = re.search(r"body=%([\w.\-]+)", ins.attrs).group(1)
            cond = re.search(r"condition=%([\w.\-]+)", ins.attrs).group(1)
            if trip is not None:
                inner_times, inner_decode = times * trip, decode
            elif decode_trip is None:  # a loop of unknown length outside a sampler: counted once
                inner_times, inner_decode = times, decode
            else:  # a decode loop: decode_trip steps (one cache block)
                inner_times, inner_decode = times * decode_trip, True
                out["decode_steps"] += decode_trip
            for c in (body, cond):
                _walk(comps, c, inner_times, inner_decode, out, decode_trip, cache_dims)
            continue
        if ins.op in CONTROL:
            for c in ins.called():
                _walk(comps, c, times, decode, out, decode_trip, cache_dims)
            continue
        if ins.op in FREE or ins.op.endswith("-done"):
            continue
        kind = ins.op[:-6] if ins.op.endswith("-start") else ins.op
        key = "decode" if decode else "run"
        flops, moved = _kernel(ins, comps, local)
        out[key + "_kernels"].append((flops * times, moved * times))
        if kind in COLLECTIVES:
            size = max((nbytes(s) for s in re.findall(r"\w+\[[\d,]*\]", ins.shape)), default=0)
            n, b = out[key + "_coll"][kind]
            out[key + "_coll"][kind] = (n + int(times), b + int(size * times))
        if (
            decode
            and kind == "copy"
            and any(dims in cache_dims for _, dims in arrays(ins.shape))
            and hbm_to_hbm(ins, local)
        ):
            out["cache_copies"] += int(times)


def traffic(
    name: str,
    compiled: Any,
    chip: Any,
    decode_trip: int | None = None,
    cache_dims: frozenset = frozenset(),
) -> ProgramTraffic:
    """The traffic of ``compiled`` on ``chip`` (``relax.plan.targets.Chip``). A sampler's decode
    loops (``lax.while_loop`` s) run ``decode_trip`` steps each (one cache block); ``cache_dims``:
    the per-chip shapes of its cache blocks, whose copies in the loops are counted. Elsewhere
    (``decode_trip`` None) a loop of unknown length is counted once."""
    comps, entry = parse_hlo(compiled.as_text())
    out: dict = {
        "run_kernels": [],
        "decode_kernels": [],
        "cache_copies": 0,
        "decode_steps": 0,
        "run_coll": collections.defaultdict(lambda: (0, 0)),
        "decode_coll": collections.defaultdict(lambda: (0, 0)),
    }
    _walk(comps, entry, 1.0, False, out, decode_trip, cache_dims)
    roof = lambda ks: sum(max(f / chip.flops, b / chip.hbm_bandwidth) for f, b in ks)
    steps = max(out["decode_steps"], 1)
    kernels = out["run_kernels"] + out["decode_kernels"]
    per_step = {k: (round(n / steps), int(b / steps)) for k, (n, b) in out["decode_coll"].items()}
    return ProgramTraffic(
        name=name,
        flops=sum(f for f, _ in kernels),
        bytes=sum(b for _, b in kernels),
        seconds=roof(kernels),
        collectives=dict(out["run_coll"]),
        decode_collectives=per_step,
        decode_step_seconds=roof(out["decode_kernels"]) / steps if out["decode_steps"] else 0.0,
        cache_copies=round(out["cache_copies"] / steps),
        decode_step_bytes=sum(b for _, b in out["decode_kernels"]) / steps,
    )
