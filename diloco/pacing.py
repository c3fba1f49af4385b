"""Turns on one host's compute for learners that share it (threads of one process)."""

from __future__ import annotations

import collections
import threading


class FairTurns:
    """First-come-first-served turns on one host's compute for co-located learners.

    At most ``slots`` learners run an inner step at once; the others queue and are served in
    arrival order, so a learner that just stepped queues behind every learner already waiting.
    Without turns the OS scheduler lets some learner threads run many inner steps ahead of others
    on the same cores, and the fast ones' steps taken while a fragment is in flight are
    overwritten when the merged fragment comes back (or, with ``keep_in_flight``, land on a Θ
    that is many steps old). Turns pace co-located learners the way separate devices of equal speed
    would. Nothing else is shared: a learner that fails or stops simply stops queueing, so no
    learner ever waits for another's progress, only for a free slot.

    Raises ``ValueError`` if ``slots`` < 1.
    """

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be ≥ 1, got {slots}")
        self._guard = threading.Lock()
        self._queue: collections.deque[threading.Event] = collections.deque()
        self._free = slots

    def __enter__(self) -> "FairTurns":
        with self._guard:
            if self._free > 0 and not self._queue:
                self._free -= 1
                return self
            ticket = threading.Event()
            self._queue.append(ticket)
        ticket.wait()  # __exit__ hands its slot straight to the first ticket in the queue
        return self

    def __exit__(self, *exc) -> None:
        with self._guard:
            if self._queue:
                self._queue.popleft().set()
            else:
                self._free += 1
