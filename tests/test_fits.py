"""A compiled program's memory need against its devices' free memory (``relax.train.fits``): the
need read off XLA's buffer assignment checked against arrays of known size, the refusal checked
on devices that report their memory as accelerators do and on CPU devices that share the host."""

import jax
import jax.numpy as jnp
import pytest

from relax.train import fits

N = 512
F32 = 4


def test_need_is_the_program_s_new_arrays_not_its_donated_ones():
    x = jnp.ones(N, jnp.float32)
    outer = fits.program_need("outer", jax.jit(jnp.outer).lower(x, x).compile())
    assert outer.bytes >= N * N * F32  # its [N, N] float32 output
    assert outer.bytes < N * N * F32 + 64 * N  # and little else
    assert outer.devices == (jax.devices()[0],)
    big = jnp.ones((N, N), jnp.float32)
    doubled = jax.jit(lambda a: a * 2, donate_argnums=0).lower(big).compile()
    assert fits.program_need("doubled", doubled).bytes < N * F32  # written into its argument


class Accelerator:
    """A device that reports its memory as GPUs and TPUs do (``memory_stats``)."""

    def __init__(self, i: int, free: int):
        self.id, self.free = i, free

    def memory_stats(self) -> dict:
        return {"bytes_limit": 16 << 30, "bytes_in_use": (16 << 30) - self.free}

    def __repr__(self):
        return f"accelerator {self.id}"


def test_a_program_over_the_least_free_device_is_refused_by_name():
    devices = (Accelerator(0, 6 << 30), Accelerator(1, 3 << 30))
    fits_ = fits.ProgramNeed("sampler", 2 << 30, devices)
    over = fits.ProgramNeed("update", 4 << 30, devices)
    assert fits.shortfall(fits_) is None
    assert fits.shortfall(over) == (
        "update needs 4.00 GiB per device beyond the resident state and 3.00 GiB are free "
        "(device accelerator 1)"
    )
    with pytest.raises(fits.DoesNotFit, match="(?s)update needs 4.00 GiB.*use --smaller") as e:
        fits.check_fit([fits_, over], "use --smaller")
    assert "sampler" not in str(e.value)
    fits.check_fit([fits_], "use --smaller")  # nothing over: no error


def test_cpu_devices_add_their_needs_against_the_host():
    devices = tuple(f"cpu {i}" for i in range(8))
    host = lambda d: (6 << 30, "the host's available memory", 1)  # noqa: E731 (free_bytes on CPU)
    assert fits.shortfall(fits.ProgramNeed("update", 512 << 20, devices), host) is None  # 4 GiB
    assert fits.shortfall(fits.ProgramNeed("update", 1 << 30, devices), host) == (
        "update needs 8.00 GiB (1.00 GiB per device x 8) beyond the resident state and 6.00 GiB "
        "are free (the host's available memory)"
    )
