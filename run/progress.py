"""Training progress for whoever shows it: the pretraining stages report here, a display subscribes.

The stages call :func:`report` at each progress line (DiLoCo's flow every ``progress_every_s``, DP
at each evaluation); ``ddiloco run`` in a terminal subscribes a rich progress display
(``flows.terminal``), a worker started from the UI subscribes nothing and the calls cost nothing.
No Prefect and no JAX here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Progress:
    """One progress line of one method: ``done`` of ``total`` units (tokens or images) and the latest
    figures (``train_loss``, ``heldout_loss``: nats per unit; ``learners``: ``(up, M)`` for DiLoCo)."""

    method: str
    done: int
    total: int
    unit: str = "tokens"
    train_loss: float | None = None
    heldout_loss: float | None = None
    learners: tuple[int, int] | None = None
    extra: dict = field(default_factory=dict)


_sinks: list[Callable[[Progress], None]] = []
_lock = threading.Lock()


def subscribe(sink: Callable[[Progress], None]) -> Callable[[], None]:
    """Call ``sink(progress)`` at every report from now on; returns the function that unsubscribes."""
    with _lock:
        _sinks.append(sink)

    def unsubscribe() -> None:
        with _lock:
            if sink in _sinks:
                _sinks.remove(sink)

    return unsubscribe


def report(progress: Progress) -> None:
    """Hand ``progress`` to every subscriber; a subscriber's error never reaches the training."""
    with _lock:
        sinks = list(_sinks)
    for sink in sinks:
        try:
            sink(progress)
        except Exception:  # noqa: BLE001 - a display never stops a run
            pass
