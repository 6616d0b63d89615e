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

``benchmarks/gpu_profile.py`` reads the bytes each kernel moves from the same parse.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterable, Literal

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|bf16|c64|c128|f8e\w+?|[suf]\d+)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "opt-barrier",
        "add-dependency", "domain", "partition-id", "replica-id"}  # no kernel
CONTROL = {"while", "call", "conditional"}  # run the kernels of the computations they call
SLICES = {"dynamic-slice", "slice", "gather"}  # read only the part they return


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of each array in an HLO shape (a tuple shape gives several)."""
    return [(t, tuple(int(x) for x in d.split(",") if x)) for t, d in _ARRAY.findall(shape)]


def nbytes(shape: str, first_only: bool = False) -> int:
    """Size of an HLO shape, e.g. ``bf16[64,2048]{1,0}`` = 64 * 2048 * 2; tuples summed."""
    arrs = arrays(shape)[:1] if first_only else arrays(shape)
    size = lambda t: _BYTES.get(t, 1 if t.startswith("f8") else int(re.sub(r"\D", "", t) or 8) / 8)
    return int(sum(size(t) * math.prod(d) for t, d in arrs))


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    root: bool
    pos: int  # order in the text (the entry computation is scheduled: execution order)

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
        rest = line[m.end():]
        k = _close(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
        shape, rest = rest[:k], rest[k:].lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        close, pos = _close(rest, op.end() - 1), pos + 1
        cur.append(Instr(m.group(2), shape, op.group(1), re.findall(r"%([\w.\-]+)", rest[op.end():close]),
                         rest[close + 1:], bool(m.group(1)), pos))
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
    found = [i for c in launching(comps, entry) for i in comps[c]
             if i.op == "while" and ("known_trip_count" in i.attrs) == scans]
    return sorted(found, key=lambda i: i.pos)


def loop_ops(text: str, ops: Iterable[str], *, part: Literal["body", "condition"] = "body",
             scans: bool = False) -> collections.Counter:
    """``{(op, result shape without layout): count}`` of the instructions named ``ops`` (an async
    ``-start`` half counts as its op) that the loops' ``part`` runs, summed over the loops."""
    comps, entry = parse_hlo(text)
    names = {o: o for o in ops} | {f"{o}-start": o for o in ops}
    found: collections.Counter = collections.Counter()
    for loop in loops(comps, entry, scans=scans):
        root = re.search(part + r"=%([\w.\-]+)", loop.attrs).group(1)
        for c in launching(comps, root):
            for ins in comps[c]:
                if ins.op in names:
                    found[(names[ins.op], re.sub(r"\{[^}]*\}", "", ins.shape))] += 1
    return found
