"""The exchange: how learners and the syncer talk, without ever waiting on each other.

Learners post fragment submissions and heartbeats and read published global fragments; the syncer
drains submissions and publishes merged fragments with versions. ``Exchange`` is the interface;
``InMemoryExchange`` is the in-process backend (threads in one process, zero-copy numpy arrays).
A durable fsspec backend for several processes or hosts implements the same methods.

The exchange also holds the global token budget: a learner claims the tokens of its next inner
step before taking it, so the total never exceeds the budget and the stop is cooperative.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class Submission:
    """Learner ``learner``'s copy of fragment ``fragment`` plus the counters that weight it.

    ``params``: tensor name → float32 array (the learner's θ_{m,p}). ``tokens``/``steps``: tokens
    and inner steps since the learner last received this fragment (c_tokens, c_steps).
    ``base_version``: the global version of the fragment the learner last received.
    ``sent_at``: seconds (time.monotonic) when it was sent.
    """

    learner: int
    fragment: int
    params: dict[str, np.ndarray]
    tokens: int
    steps: int
    base_version: int
    local_step: int
    attempt: int = 1
    sent_at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.params.values()))


class Exchange(Protocol):
    def submit(self, sub: Submission) -> None: ...
    def drain(self) -> list[Submission]: ...
    def publish(self, fragment: int, version: int, params: dict[str, np.ndarray]) -> None: ...
    def latest(self, fragment: int) -> tuple[int, dict[str, np.ndarray]]: ...
    def versions(self) -> list[int]: ...
    def heartbeat(self, learner: int, **info) -> None: ...
    def learners(self) -> dict[int, dict]: ...
    def claim_tokens(self, n: int) -> bool: ...
    @property
    def claimed_tokens(self) -> int: ...


class InMemoryExchange:
    """Thread-safe in-process exchange. Arrays are shared, never copied: senders must hand over
    arrays they will not mutate (numpy copies of jax arrays; the syncer publishes fresh arrays)."""

    def __init__(self, num_fragments: int, token_budget: int):
        self._lock = threading.Lock()
        self._inbox: list[Submission] = []
        self._published: list[tuple[int, dict[str, np.ndarray]] | None] = [None] * num_fragments
        self._learners: dict[int, dict] = {}
        self.token_budget = int(token_budget)
        self._claimed = 0
        self.closed = threading.Event()

    # learners → syncer
    def submit(self, sub: Submission) -> None:
        with self._lock:
            self._inbox.append(sub)

    def drain(self) -> list[Submission]:
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    # syncer → learners
    def publish(self, fragment: int, version: int, params: dict[str, np.ndarray]) -> None:
        with self._lock:
            self._published[fragment] = (version, params)

    def latest(self, fragment: int) -> tuple[int, dict[str, np.ndarray]]:
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

    def learners(self) -> dict[int, dict]:
        with self._lock:
            return {m: dict(v) for m, v in self._learners.items()}

    # the global token budget
    def claim_tokens(self, n: int) -> bool:
        """Reserve ``n`` tokens of the budget; False (and nothing reserved) once it would overflow."""
        with self._lock:
            if self._claimed + n > self.token_budget:
                return False
            self._claimed += n
            return True

    @property
    def claimed_tokens(self) -> int:
        with self._lock:
            return self._claimed
