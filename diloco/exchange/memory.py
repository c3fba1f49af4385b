"""The in-process exchange: learners and the syncer as threads of one process, zero-copy arrays.

Exchanges are registered by key (the run directory) in a process-wide table, so a learner task
given only plain inputs (config, run directory, learner index) finds its run's exchange with
:func:`open_exchange`.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from diloco.exchange.base import Submission

_REGISTRY: dict[str, InMemoryExchange] = {}
_REGISTRY_LOCK = threading.Lock()


class InMemoryExchange:
    """Thread-safe in-process exchange (see ``diloco.exchange.base.Exchange``).

    Arrays are shared, never copied: senders hand over arrays they will not mutate (numpy copies
    of device arrays; the syncer publishes fresh arrays). ``clock()`` is seconds since creation.
    """

    def __init__(self, num_fragments: int, token_budget: int):
        self._lock = threading.Lock()
        self._inbox: list[Submission] = []
        self._published: list[tuple[int, dict[str, np.ndarray]] | None] = [None] * num_fragments
        self._learners: dict[int, dict] = {}
        self.token_budget = int(token_budget)
        self._claimed = 0
        self._closed = threading.Event()
        self._learners_done = threading.Event()
        self._stop = threading.Event()
        self._t0 = time.monotonic()

    # learners → syncer
    def submit(self, sub: Submission) -> None:
        with self._lock:
            self._inbox.append(sub)

    def drain(self) -> list[Submission]:
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def discard(self, keys) -> None:
        """Nothing to delete: drained submissions live only in the syncer's memory."""

    def take_events(self) -> list[dict]:
        """No exchange events: objects cannot be corrupted in memory."""
        return []

    def take_office(self) -> int:
        """The syncer's generation: always 1 (one syncer per run, in the process that holds this)."""
        return 1

    # syncer → learners
    def publish(self, fragment: int, version: int, params: dict[str, np.ndarray]) -> None:
        with self._lock:
            self._published[fragment] = (version, params)

    def latest(self, fragment: int) -> tuple[int, dict[str, np.ndarray]]:
        """``(version, params)`` of the newest published Θ_p; ``RuntimeError`` before the first."""
        with self._lock:
            entry = self._published[fragment]
        if entry is None:
            raise RuntimeError(f"fragment {fragment} has not been published by the syncer yet")
        return entry

    def versions(self) -> list[int]:
        with self._lock:
            return [-1 if e is None else e[0] for e in self._published]

    # liveness and progress
    def heartbeat(self, learner: int, **info) -> None:
        with self._lock:
            entry = self._learners.setdefault(learner, {})
            entry.update(info)
            entry["last_seen"] = time.monotonic()

    def refresh(self) -> None:
        """Nothing cached: every read is current."""

    def learners(self) -> dict[int, dict]:
        with self._lock:
            return {m: dict(v) for m, v in self._learners.items()}

    # the global token budget
    def claim_tokens(self, n: int, learner: int | None = None, stop=None) -> bool:
        """Reserve ``n`` tokens of the budget, first come first served (``learner``/``stop`` unused:
        the claim never waits); False (and nothing reserved) once it would overflow."""
        with self._lock:
            if self._claimed + n > self.token_budget:
                return False
            self._claimed += n
            return True

    def grant(self, live=None) -> bool:
        """No grants: learners claim from the shared budget directly."""
        return False

    @property
    def claimed_tokens(self) -> int:
        with self._lock:
            return self._claimed

    # the run's clock and end
    def clock(self) -> float:
        """Seconds since the exchange was created (the run's training start)."""
        return time.monotonic() - self._t0

    def close(self) -> None:
        """The run is over (the syncer ended): learners stop at their next step boundary."""
        self._closed.set()

    def is_closed(self) -> bool:
        return self._closed.is_set()

    def mark_learners_done(self) -> None:
        """Every learner task has ended (set by the flow): the syncer flushes and ends."""
        self._learners_done.set()

    def learners_done(self) -> bool:
        return self._learners_done.is_set()

    def request_stop(self) -> None:
        """Ask every learner to stop at its next step boundary (a stop signal reached the flow)."""
        self._stop.set()

    def stop_requested(self) -> bool:
        return self._stop.is_set()


def register_exchange(key: str, exchange: InMemoryExchange) -> None:
    """Make ``exchange`` findable by ``key`` in this process. ``ValueError`` if the key is taken by
    an exchange that is not closed (two live runs on one run directory)."""
    with _REGISTRY_LOCK:
        old = _REGISTRY.get(key)
        if old is not None and not old.is_closed():
            raise ValueError(f"a live exchange is already registered for {key}")
        _REGISTRY[key] = exchange


def open_exchange(key: str) -> InMemoryExchange:
    """The exchange registered for ``key``. ``LookupError`` naming the key if there is none (the
    in-process backend only reaches learners in the process that set the run up)."""
    with _REGISTRY_LOCK:
        try:
            return _REGISTRY[key]
        except KeyError:
            raise LookupError(
                f"no in-process exchange for {key}: the DiLoCo run was not set up in this process "
                "(the in-process exchange serves learners of one process only)"
            ) from None


def unregister_exchange(key: str) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.pop(key, None)
