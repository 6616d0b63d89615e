"""Named taps on a forward's intermediate values, for finding where two forwards part.

The layer body calls ``tap(name, x)`` at each step of its equation (``relax.models.decoder.layer``).
Outside ``recording`` a tap is the identity at trace time (nothing enters the program); inside,
each value traced is handed to the recorder, which may return it changed (e.g. after a
``jax.debug.callback`` that copies it out). ``benchmarks/precision.py`` records the sampler's
decode and the trainer's forward of the same tokens and compares them op by op::

    with taps.recording(recorder):   # recorder(name, x) -> x, called while tracing
        jax.clear_caches(); run_the_forward()

A program traced outside ``recording`` (and cached) has no taps: clear the caches first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from jaxtyping import Array

Recorder = Callable[[str, Array], Array]

_recorder: list[Recorder] = []


def tap(name: str, x: Array) -> Array:
    """``x``, handed to the active recorder first when one is recording."""
    return _recorder[-1](name, x) if _recorder else x


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """Hand every tapped value traced inside the block to ``recorder``."""
    _recorder.append(recorder)
    try:
        yield
    finally:
        _recorder.pop()
