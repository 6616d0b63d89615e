"""SIGTERM as a request to stop at the next step boundary (a preempted TPU VM or a cloud spot
instance gets SIGTERM, then some seconds, then SIGKILL).

    with PreemptionGuard() as guard:
        for step in ...:
            state = train_step(state)
            if guard.requested:
                save(step, state); raise Preempted(...)

Inside the guard SIGTERM only sets ``requested``: the step in flight finishes (its buffers are
consistent again), the loop saves a final checkpoint and stops. The previous handler comes back
on exit. A no-op off the main thread, where Python cannot install signal handlers, and on
several processes, where jax's preemption service (started by ``jax.distributed.initialize``)
takes SIGTERM on every host: orbax's ``PreemptionCheckpointingPolicy`` (``relax.train.checkpoint``)
then saves a checkpoint at the next step all hosts reach, and the loop goes on (to the end of the
run or the platform's SIGKILL): ``requested`` stays False, nothing raises ``Preempted``, and the
process does not exit with status 143.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

import jax


class Preempted(Exception):
    """The run stopped on SIGTERM after saving a checkpoint."""


class PreemptionGuard:
    """While active, SIGTERM sets ``requested`` instead of ending the process."""

    def __init__(self):
        self.requested = False
        self._previous = None
        self.active = (
            threading.current_thread() is threading.main_thread() and jax.process_count() == 1
        )

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __enter__(self) -> PreemptionGuard:
        if self.active:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            signal.signal(signal.SIGTERM, self._previous)


def exit_as_terminated(main: Callable[[], object]) -> None:
    """Run a command-line ``main``; on ``Preempted`` (a checkpoint was saved) print why and exit
    with status 128 + SIGTERM, as a terminated process would."""
    try:
        main()
    except Preempted as e:
        print(e, file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
