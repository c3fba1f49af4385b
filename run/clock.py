"""The training clock that chaos schedules are read against (seconds since a run's stage started).

A run uses :class:`WallClock` (``time.monotonic`` and real sleeps), or :class:`EpochClock` where
several processes read one clock (the DP job's hosts). Tests and dry runs use
:class:`SimulatedClock`, which never waits: each reading advances it by a fixed tick and each sleep
by its length, so a schedule's events land at the same steps however loaded the machine is.
"""

from __future__ import annotations

import time
from typing import Protocol


class TrainingClock(Protocol):
    """Seconds (float) since the clock's origin, and a sleep on that clock."""

    def __call__(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """Wall seconds since ``origin`` (a ``time.monotonic()`` reading; default: construction)."""

    def __init__(self, origin: float | None = None):
        self.origin = time.monotonic() if origin is None else origin

    def __call__(self) -> float:
        return time.monotonic() - self.origin

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class EpochClock:
    """Wall seconds since ``origin``, an epoch time (``time.time()``; default: construction): one clock
    that every process of a job reads alike, on this host or (with synchronised clocks) another."""

    def __init__(self, origin: float | None = None):
        self.origin = time.time() if origin is None else origin

    def __call__(self) -> float:
        return time.time() - self.origin

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class SimulatedClock:
    """A deterministic clock: every reading advances it by ``tick_s`` seconds (so work between two
    readings takes ``tick_s``), and ``sleep(s)`` advances it by ``s`` at once.

    Raises ``ValueError`` for a negative ``tick_s``.
    """

    def __init__(self, tick_s: float = 0.1):
        if tick_s < 0:
            raise ValueError(f"tick_s must be ≥ 0 seconds, got {tick_s}")
        self.tick_s, self.now = float(tick_s), 0.0

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, float(seconds))
