"""The exchange interface: how learners and the syncer talk, without ever waiting on each other.

Learners post fragment submissions and heartbeats and read published global fragments; the syncer
drains submissions and publishes merged fragments with versions. The exchange also holds the
global token budget (a learner claims the tokens of its next inner step before taking it, so the
total never exceeds the budget and the stop is cooperative), the run's clock (seconds since the
run started, one origin for every learner and the syncer) and the run's end (``close``).

Backends: ``diloco.exchange.memory.InMemoryExchange`` (threads of one process) and
``diloco.exchange.fsspec.FsspecExchange`` (separate processes or hosts, through any fsspec storage).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class Submission:
    """Learner ``learner``'s copy of fragment ``fragment`` plus the counters that weight it.

    ``params``: the payload as it crosses the wire, in the format ``wire`` (a
    ``diloco.wire.WireFormat.spec``): with ``"float32"`` (the default) tensor name → float32 array,
    the learner's θ_{m,p} itself; with ``"bfloat16"``, ``"int8[:b]"`` or ``"int4[:b]"`` the encoded
    update Δ = θ_{m,p} − Θ_p at ``base_version`` (codes and scales, ``diloco.wire``), which the
    syncer decodes and adds to its copy of that version. ``tokens``/``steps``: tokens
    and inner steps of progress the copy holds relative to ``base_version`` (c_tokens, c_steps).
    ``base_version``: the global version of the fragment the learner last received.
    ``local_step``: the learner's inner step when it sent. ``sent_at``: the run clock when it was sent
    (``Exchange.clock()``, seconds; ``time.monotonic()`` if built without one).
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
    key: str | None = None  # the exchange's name for the object (durable exchanges), set by submit/drain
    wire: str = "float32"  # the payload's wire format (diloco.wire.WireFormat.spec)

    @property
    def nbytes(self) -> int:
        """Payload bytes: the tensor bytes of ``params`` as sent (codes and scales for the quantised
        formats), no framing."""
        return int(sum(a.nbytes for a in self.params.values()))


class Exchange(Protocol):
    """What the learner and syncer loops use; every method is safe to call concurrently."""

    token_budget: int

    # learners → syncer
    def submit(self, sub: Submission) -> None: ...
    def drain(self) -> list[Submission]: ...
    def discard(self, keys: Iterable[str]) -> None: ...
    def take_events(self) -> list[dict]: ...
    def take_office(self) -> int: ...
    # syncer → learners
    def publish(self, fragment: int, version: int, params: dict[str, np.ndarray]) -> None: ...
    def latest(self, fragment: int) -> tuple[int, dict[str, np.ndarray]]: ...
    def versions(self) -> list[int]: ...
    # liveness and progress
    def heartbeat(self, learner: int, **info) -> None: ...
    def learners(self) -> dict[int, dict]: ...
    def refresh(self) -> None: ...  # forget cached reads (a durable exchange caches for poll_s)
    # the global token budget
    def claim_tokens(self, n: int, learner: int | None = None, stop: Callable[[], bool] | None = None) -> bool: ...
    def grant(self, live: set[int] | None = None) -> bool: ...
    @property
    def claimed_tokens(self) -> int: ...
    # the run's clock and end
    def clock(self) -> float: ...
    def close(self) -> None: ...
    def is_closed(self) -> bool: ...
    def mark_learners_done(self) -> None: ...
    def learners_done(self) -> bool: ...
    def request_stop(self) -> None: ...
    def stop_requested(self) -> bool: ...
