"""Machines to compile for without having them: TPU slices and GPU hosts as compile-only devices.

A target is written ``v5p:2x2x2`` (a TPU generation and its slice topology, as Cloud TPU names
them: v5e / v6e slices are 2-D, v5p 3-D) or ``h100x8`` / ``h200x8`` (that many GPUs of one host).
``devices(target)`` gives its devices: for TPU, ``libtpu``'s compile-only client (the optional
``tpu`` extra, ``pip install -e '.[tpu]'``; ``JAX_PLATFORMS=cpu`` is enough, nothing is allocated
on any chip); for GPU,
the CUDA plugin's (``relax.plan.gpu_target``: ``jax-cuda12-plugin``, no GPU needed). A GPU
compile never fails for memory: the plan compares the bytes with the GPU's HBM itself. Programs
lowered with ``ShapeDtypeStruct`` s sharded
over a mesh of these devices compile with the target's real compiler, and
``compiled.memory_analysis()`` is per chip.

``Chip`` holds the published figures a plan divides by: HBM per chip, peak dense bfloat16 FLOP/s
and HBM bandwidth. On TPU the compiler's own limit (``available HBM`` in its out-of-memory
message) is a little below the published size (15.75 GiB of v5e's 16); a plan reports against
the compiler's figure where it has seen one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax

from relax.plan.gpu_target import GPU_SPECS, gpu_devices

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: ``hbm_bytes`` of memory, ``flops`` (dense bf16 FLOP/s), ``hbm_bandwidth`` (bytes/s)."""

    name: str
    platform: str  # "tpu" | "gpu"
    hbm_bytes: int
    flops: float
    hbm_bandwidth: float
    device_kind: str  # what jax's devices call it (checked against the compiler's devices)


# Published per-chip figures (Cloud TPU system architecture pages; the GPUs': relax.plan.gpu_target).
CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", "tpu", 16 * GiB, 197e12, 819e9, "TPU v5 lite"),
    "v5p": Chip("v5p", "tpu", 95 * GiB, 459e12, 2765e9, "TPU v5"),
    "v6e": Chip("v6e", "tpu", 32 * GiB, 918e12, 1640e9, "TPU v6 lite"),
    **{
        name: Chip(name, "gpu", g.hbm_bytes, g.peak_bf16_flops, g.hbm_bytes_per_s, g.name)
        for name, g in GPU_SPECS.items()
    },
}
_TPU = re.compile(r"^(v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")
_GPU = re.compile(r"^(h100|h200)x(\d+)$")


@dataclasses.dataclass(frozen=True)
class Target:
    """``chips`` chips of ``chip`` in ``topology`` (TPU: ``"2x2x2"``; GPU: ``"1x1xN"``, one host)."""

    name: str
    chip: Chip
    topology: str
    chips: int

    @classmethod
    def parse(cls, text: str) -> Target:
        """``"v5e:2x4"``, ``"v5p:2x2x2"``, ``"v6e:4x4"``, ``"h100x8"``; a clear error otherwise."""
        text = text.strip().lower()
        m = _TPU.match(text)
        if m:
            dims = tuple(int(d) for d in m.group(2).split("x"))
            want = 3 if m.group(1) == "v5p" else 2
            if len(dims) != want or min(dims) < 1:
                raise ValueError(
                    f"target {text!r}: a {m.group(1)} slice has {want} dimensions, e.g. "
                    f"{'v5p:2x2x2' if want == 3 else m.group(1) + ':2x4'}"
                )
            return cls(text, CHIPS[m.group(1)], m.group(2), math.prod(dims))
        m = _GPU.match(text)
        if m:
            return cls(text, CHIPS[m.group(1)], f"1x1x{m.group(2)}", int(m.group(2)))
        raise ValueError(
            f"unknown target {text!r}: use <v5e|v5p|v6e>:<topology> (v5e:2x4, v5p:2x2x2, v6e:4x4) "
            "or <h100|h200>x<count> (h100x8)"
        )

    @property
    def platform(self) -> str:
        return self.chip.platform

    def __str__(self) -> str:
        return self.name


def devices(target: Target) -> list[jax.Device]:
    """The target's compile-only devices (none of them is allocated or even present)."""
    if target.platform == "gpu":
        return list(gpu_devices(target.chip.name, target.chips))
    return tpu_devices(target)


def tpu_devices(target: Target) -> list[jax.Device]:
    """Compile-only TPU devices of ``target`` from libtpu (``pip install -e '.[tpu]'`` in a checkout)."""
    from jax.experimental import topologies

    os.environ.setdefault(
        "TPU_WORKER_HOSTNAMES", "localhost"
    )  # no TPU host to find: silence libtpu's search
    os.environ.setdefault(
        "ALLOW_MULTIPLE_LIBTPU_LOAD", "1"
    )  # compile-only: several processes may plan at once
    try:
        topo = topologies.get_topology_desc(
            topology_name=f"{target.chip.name}:{target.topology}", platform="tpu"
        )
    except Exception as e:  # libtpu missing (no "tpu" plugin) or a topology it does not know
        raise RuntimeError(
            f"cannot describe TPU target {target}: {e}. Compiling for TPU needs libtpu: "
            "pip install -e '.[tpu]' in the relax checkout (jax[tpu], ~700 MB; no TPU needed)"
        ) from e
    found = list(topo.devices)
    if len(found) != target.chips or found[0].device_kind != target.chip.device_kind:
        raise RuntimeError(
            f"target {target}: libtpu describes {len(found)} x {found[0].device_kind!r}, "
            f"expected {target.chips} x {target.chip.device_kind!r}"
        )
    return found


def tpu_available() -> bool:
    """Whether libtpu (the compiler of TPU targets) is installed."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True
