"""Compile-only H100 / H200 devices (``relax.plan.gpu_target``): XLA:GPU compiles without a GPU.

Needs the CUDA PJRT plugin (``pip install jax-cuda12-plugin``); skipped where it is missing, except
the check that ``gpu_devices`` then says what to install.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from relax.plan.gpu_target import GPU_SPECS, cuda_plugin_available, gpu_devices

needs_plugin = pytest.mark.skipif(
    not cuda_plugin_available(), reason="CUDA PJRT plugin not installed"
)
GiB = 2**30


def _mesh(kind: str) -> Mesh:
    return Mesh(np.array(gpu_devices(kind, 8)).reshape(2, 4), ("data", "tensor"))


@needs_plugin
@pytest.mark.parametrize("kind", ["h100", "h200"])
def test_sharded_matmul_memory_is_per_gpu(kind):
    mesh = _mesh(kind)
    assert [d.device_kind for d in mesh.devices.flat] == [GPU_SPECS[kind].name] * 8
    x = jax.ShapeDtypeStruct(
        (4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", "tensor"))
    )
    memory = jax.jit(lambda a: (a @ a.T).sum()).lower(x).compile().memory_analysis()
    assert (
        memory.argument_size_in_bytes == 4096 * 4096 * 2 // 8
    )  # 4 MiB: one [2048, 1024] block per GPU
    assert memory.output_size_in_bytes == 2  # a bf16 scalar
    assert memory.temp_size_in_bytes > 0


@needs_plugin
def test_program_over_hbm_still_compiles():
    # XLA:GPU does not refuse a program larger than the GPU: the bytes show it, the caller compares.
    mesh = _mesh("h100")
    big = jax.ShapeDtypeStruct(
        (100 * GiB // (2 * 8192), 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P())
    )
    memory = jax.jit(lambda a: a.sum()).lower(big).compile().memory_analysis()
    assert memory.argument_size_in_bytes == 100 * GiB > GPU_SPECS["h100"].hbm_bytes


@needs_plugin
def test_hosts_of_eight():
    devices = gpu_devices("h100", 16)
    assert len(devices) == 16 and sorted({d.process_index for d in devices}) == [0, 1]
    for kind, count in [("h100", 0), ("h100", 12), ("a100", 8)]:
        with pytest.raises(ValueError):
            gpu_devices(kind, count)


@pytest.mark.skipif(cuda_plugin_available(), reason="the CUDA PJRT plugin is installed")
def test_missing_plugin_says_what_to_install():
    with pytest.raises(RuntimeError, match="jax-cuda12-plugin"):
        gpu_devices("h100", 8)
