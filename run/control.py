"""Cooperative stop on SIGTERM and SIGINT.

Cluster schedulers preempt with SIGTERM; people press Ctrl-C. Neither may leave a run training on,
nor kill it mid-write. Inside :func:`graceful_stop` both signals only set :data:`STOP`; the loops
check it at every step boundary (learners after their current inner step, the DP trainer after
its current step), hand in their work and end; the syncer then flushes, evaluates and saves its
state, and the pipeline records ``interrupted`` in the run directory (``status.json``) with the
stages it completed. A second signal falls through to the handler that was installed before
(Prefect's, or Python's ``KeyboardInterrupt``), for when a clean stop takes too long.

Nothing can interrupt a running XLA call, so the stop lands within one inner step (well under a
second for the shipped configs) plus the final hand-in and checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

STOP = threading.Event()
_signal_names = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
_received: list[int] = []
_first_at = [0.0]  # monotonic time of the first stop
# A repeat of the first signal within this many seconds is the same stop delivered twice (GNU
# `timeout` signals the command and then its process group), not the user insisting.
REPEAT_S = 1.0
log = logging.getLogger(__name__)


def stop_requested() -> bool:
    """True once SIGTERM or SIGINT arrived inside :func:`graceful_stop` (or :func:`request_stop` ran)."""
    return STOP.is_set()


def stop_signal() -> int | None:
    """The number of the first signal that asked for the stop, or None."""
    return _received[0] if _received else None


def request_stop(signum: int = signal.SIGTERM) -> None:
    """Ask every loop of this process to stop at its next step boundary (as a signal would)."""
    if not STOP.is_set():
        _received.append(int(signum))
        _first_at[0] = time.monotonic()
    STOP.set()


def reset() -> None:
    """Clear a previous stop (a new run in the same process starts clean)."""
    STOP.clear()
    _received.clear()


@contextlib.contextmanager
def graceful_stop() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT set :data:`STOP` instead of killing the process.

    Installs the handlers only in the main thread (Python delivers signals there); elsewhere it is a
    no-op and :data:`STOP` can still be set by :func:`request_stop`. The handlers in place before are
    restored on exit, and a second signal is passed on to them (a repeat of the first one within
    :data:`REPEAT_S` seconds is the same stop delivered twice, and is ignored).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in _signal_names}

    def handler(signum, frame):
        if STOP.is_set() and _received == [signum] and time.monotonic() - _first_at[0] < REPEAT_S:
            return  # the same stop delivered twice at once (e.g. `timeout` signals the process and its group)
        if STOP.is_set():  # second signal: the user insists
            signal.signal(signum, previous[signum])
            prev = previous[signum]
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL:
                signal.raise_signal(signum)
            return
        request_stop(signum)
        log.warning(
            "%s received: stopping at the next step boundary (send it again to abort at once)",
            _signal_names.get(signum, signum),
        )

    for s in _signal_names:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def dask_setup(worker) -> None:
    """Dask preload (``preload=["run.control"]``), run in each worker process of a local cluster as it
    starts, in its main thread: SIGINT does nothing there. Those processes share the terminal's
    process group with ``ddiloco``, and a Ctrl-C killed them (asyncio's ``KeyboardInterrupt``) while
    the flow was stopping the run cleanly; the stop reaches their learners through the exchange
    instead, and the cluster closes them as usual."""
    signal.signal(signal.SIGINT, _do_nothing)


def _do_nothing(signum, frame) -> None:
    """A signal handler that does nothing."""


@functools.cache
def setpriv() -> str | None:
    """util-linux's ``setpriv`` if it is installed and has ``--pdeathsig`` (util-linux ≥ 2.33, Linux
    only), else None."""
    path = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if path is None:
        return None
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path if "--pdeathsig" in usage else None
