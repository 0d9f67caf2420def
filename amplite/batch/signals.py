"""SIGTERM during a batch: what SLURM, Kubernetes and CI runners send on preemption or timeout.

:func:`sigterm_stops_batch` turns the signal into :class:`BatchTerminated`, raised in the main thread, so
the runner stops exactly as on Ctrl-C: workers killed, unfinished models ``cancelled``, the summary written
and the staging removed. The caller (``amplite batch``) then exits ``128 + signal``, 143.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class BatchTerminated(BaseException):
    """The batch was stopped by a termination signal (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        """``SIGTERM``."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by the signal: 128 + its number (143 for SIGTERM)."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"the batch received {self.signal_name}"


def _raise(signum: int, frame: FrameType | None) -> None:
    # One is enough: a second SIGTERM while the summary is being written must not cut it short.
    signal.signal(signum, signal.SIG_IGN)
    raise BatchTerminated(signum)


@contextlib.contextmanager
def sigterm_stops_batch() -> Iterator[None]:
    """While active (main thread only; elsewhere a no-op), SIGTERM raises :class:`BatchTerminated`."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
