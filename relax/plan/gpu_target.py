"""Compile-only NVIDIA H100 / H200 devices: XLA's real GPU compiler on a machine without a GPU.

``gpu_devices("h100", 8)`` gives 8 compile-only CUDA devices of one host, described to XLA by a
``GpuTargetConfigProto`` built from ``GPU_SPECS`` (NVIDIA's published figures). Programs lowered
with ``ShapeDtypeStruct`` s sharded over a mesh of them compile with XLA:GPU ("deviceless
compilation") and ``compiled.memory_analysis()`` is per GPU. Nothing runs; no CUDA driver,
runtime, cuDNN or ``ptxas`` is needed.

Needs the CUDA PJRT plugin (``pip install jax-cuda12-plugin==<jax version>``, which pulls
``jax-cuda12-pjrt``; ~180 MB of wheels, no ``nvidia-*`` packages). Observed with jax 0.10.2:

* No XLA flags are needed: without a GPU, XLA skips autotuning by itself, and PTX is
  generated in-process (compiles also work with no ``ptxas`` on ``PATH``).
* The plugin's CUDA version check fails without a CUDA runtime (then jax logs "Jax plugin
  configuration error" and drops the plugin) unless ``JAX_PLATFORMS`` excludes cuda (e.g.
  ``cpu``, as the test suite sets) or ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``, read when jax first
  discovers plugins (its first backend or topology call). ``gpu_devices`` sets the latter while
  it runs, and registers the plugin again, check skipped, if jax had already dropped it.
* Compiling never fails for lack of memory: a program over the GPU's HBM compiles, and
  ``memory_analysis()`` shows the bytes (XLA only logs "The byte size of input/output arguments
  (...) exceeds the base limit (...)", the limit being 0.8 x ``hbm_bytes``). Compare yourself.
* Matmuls become Triton GEMM fusions with a default tiling (no autotuning), where a GPU might
  choose cuBLAS (which has a workspace) instead; sorts use XLA's fallback sort (XLA has no CUB
  scratch-size data for a deviceless compile), so their temp bytes can differ from a GPU's.
* ``jax.nn.dot_product_attention(implementation="cudnn")`` fails ("cuDNN not found");
  ``implementation=None`` compiles (XLA's attention, the [T, S] scores materialized).
* More than 8 GPUs: ``"1xHx8"`` topologies (H hosts of 8); devices of host h have
  ``process_index`` h, as in a multi-process run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from unittest import mock

import jax
from jax.experimental import topologies

GPUS_PER_HOST = 8
_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")  # the CUDA 12 / 13 PJRT plugins
_INSTALL = "pip install 'jax-cuda12-plugin==%s' (~180 MB with jax-cuda12-pjrt; no GPU needed)"


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU as NVIDIA publishes it. ``hbm_bytes`` is the total the driver reports (nvidia-smi's
    81559 MiB for "80 GB", 143771 MiB for "141 GB"); ``peak_bf16_flops`` is dense (no sparsity)."""

    name: str  # the CUDA device name, which jax reports as ``device_kind``
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    compute_capability: tuple[int, int] = (9, 0)
    sm_count: int = 132
    clock_ghz: float = 1.98  # boost clock
    l2_bytes: int = 50 * 2**20
    fp32_cores_per_sm: int = 128
    shared_memory_per_sm: int = 228 * 2**10
    shared_memory_per_block: int = 48 * 2**10  # without opting in
    shared_memory_per_block_optin: int = 227 * 2**10
    registers_per_sm: int = 65536
    registers_per_block: int = 65536
    threads_per_sm: int = 2048
    threads_per_block: int = 1024
    warp_size: int = 32
    cudnn_version: tuple[int, int, int] = (9, 8, 0)  # what jax-cuda12-plugin 0.10.2 is built with

    @property
    def target_config(self) -> str:
        return target_config(self)


GPU_SPECS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", 81559 * 2**20, 989e12, 3.35e12),  # H100 SXM5
    "h200": GpuSpec("NVIDIA H200", 143771 * 2**20, 989e12, 4.8e12),  # H200 SXM
}


def target_config(spec: GpuSpec) -> str:
    """``spec`` as a ``GpuTargetConfigProto`` in text format (XLA's
    ``xla/stream_executor/device_description.proto``)."""
    major, minor = spec.compute_capability
    dnn = dict(zip(("major", "minor", "patch"), spec.cudnn_version))
    info = {
        "threads_per_block_limit": spec.threads_per_block,
        "threads_per_warp": spec.warp_size,
        "shared_memory_per_block": spec.shared_memory_per_block,
        "shared_memory_per_core": spec.shared_memory_per_sm,
        "shared_memory_per_block_optin": spec.shared_memory_per_block_optin,
        "threads_per_core_limit": spec.threads_per_sm,
        "core_count": spec.sm_count,
        "fpus_per_core": spec.fp32_cores_per_sm,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "thread_dim_limit_x": 1024,
        "thread_dim_limit_y": 1024,
        "thread_dim_limit_z": 64,
        "memory_bandwidth": int(spec.hbm_bytes_per_s),
        "l2_cache_size": spec.l2_bytes,
        "clock_rate_ghz": spec.clock_ghz,
        "device_memory_size": spec.hbm_bytes,
        "registers_per_core_limit": spec.registers_per_sm,
        "registers_per_block_limit": spec.registers_per_block,
    }
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (
        f"gpu_device_info {{\n{fields}\n"
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
        f'  name: "{spec.name}"\n  device_vendor: "NVIDIA Corporation"\n}}\n'
        f'platform_name: "CUDA"\n'
        f"dnn_version_info {{ {' '.join(f'{k}: {v}' for k, v in dnn.items())} }}\n"
        f'device_description_str: "{spec.name}"\n'
    )


def cuda_plugin_available() -> bool:
    """Whether a CUDA PJRT plugin (the XLA:GPU compiler for jax) is installed."""
    try:
        return any(importlib.util.find_spec(module) is not None for module in _PLUGINS)
    except ImportError:  # no ``jax_plugins`` namespace package at all
        return False


def _register_plugin() -> None:
    """Register the CUDA plugin that jax's plugin discovery dropped (its version check failed)."""
    if not cuda_plugin_available():
        raise RuntimeError(
            "compiling for NVIDIA GPUs needs the CUDA PJRT plugin: " + _INSTALL % jax.__version__
        )
    importlib.import_module(next(m for m in _PLUGINS if importlib.util.find_spec(m))).initialize()


@functools.cache
def _devices(kind: str, topology: str) -> tuple[jax.Device, ...]:
    kwargs = dict(
        topology_name=f"{kind}:{topology}",
        platform="cuda",
        target_config=GPU_SPECS[kind].target_config,
        topology=topology,
    )
    # The plugin's CUDA version check needs a CUDA runtime, which compiling does not. If jax has
    # not discovered its plugins yet, it does so here.
    with mock.patch.dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1"):
        try:
            topo = topologies.get_topology_desc(**kwargs)
        except NotImplementedError:  # "topology not implemented for cuda": no plugin registered
            _register_plugin()
            topo = topologies.get_topology_desc(**kwargs)
    return tuple(topo.devices)


def gpu_devices(kind: str, count: int) -> list[jax.Device]:
    """``count`` compile-only GPUs of ``kind`` (a key of ``GPU_SPECS``): one host of ``count`` if
    ``count <= 8``, else ``count / 8`` hosts of 8."""
    if kind not in GPU_SPECS:
        raise ValueError(f"unknown GPU {kind!r}: one of {sorted(GPU_SPECS)}")
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise ValueError(
            f"{count} GPUs: use 1..{GPUS_PER_HOST} (one host) or a multiple of "
            f"{GPUS_PER_HOST} (hosts of {GPUS_PER_HOST})"
        )
    hosts, per_host = (
        (1, count) if count <= GPUS_PER_HOST else (count // GPUS_PER_HOST, GPUS_PER_HOST)
    )
    return list(_devices(kind, f"1x{hosts}x{per_host}"))
