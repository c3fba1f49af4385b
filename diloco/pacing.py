"""Turns on one host's compute for learners that share it: threads of one process
(:class:`FairTurns`) or processes of one host (:class:`HostTurns`)."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import json
import os
import pathlib
import select
import threading
import time
from collections.abc import Callable


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

    ``observer``: called after each turn with ``(asked, got, released)``, ``time.perf_counter()``
    seconds (when the turn was asked for, granted and handed back), in the learner's thread; for
    profiles (``benchmarks/overhead.py --breakdown``), None in runs.

    Raises ``ValueError`` if ``slots`` < 1.
    """

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be ≥ 1, got {slots}")
        self._guard = threading.Lock()
        self._queue: collections.deque[threading.Event] = collections.deque()
        self._free = slots
        self.observer: Callable[[float, float, float], None] | None = None
        self._asked = threading.local()

    def __enter__(self) -> FairTurns:
        if self.observer is not None:
            self._asked.at = time.perf_counter()
        with self._guard:
            if self._free > 0 and not self._queue:
                self._free -= 1
                ticket = None
            else:
                ticket = threading.Event()
                self._queue.append(ticket)
        if ticket is not None:
            ticket.wait()  # __exit__ hands its slot straight to the first ticket in the queue
        if self.observer is not None:
            self._asked.got = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        with self._guard:
            if self._queue:
                self._queue.popleft().set()
            else:
                self._free += 1
        observer = self.observer
        if observer is not None and hasattr(self._asked, "got"):
            observer(self._asked.at, self._asked.got, time.perf_counter())


class HostTurns:
    """First-come-first-served turns on one host's compute for learners in separate processes.

    The process engines' counterpart of :class:`FairTurns`: the learner processes of one run on one
    host share the folder ``path`` (local to the host, e.g. under the system's temporary folder) and
    take turns in arrival order, at most ``slots`` at once. The queue lives in ``path/state.json``
    (rewritten atomically under an ``fcntl.flock`` on ``path/lock``); a waiter blocks on its own
    named pipe, and whoever frees a slot hands it straight to the head of the queue and writes one
    byte to that pipe, so a hand-over costs a few system calls and no polling. A process killed while
    it holds or awaits a turn is found by its PID (every waiter re-checks every ``check_s`` seconds)
    and dropped from the queue, so a SIGKILL never blocks the others. POSIX only (``fcntl``,
    ``os.mkfifo``).

    Raises ``ValueError`` if ``slots`` < 1.
    """

    def __init__(self, path: str | os.PathLike, slots: int = 1, check_s: float = 0.05) -> None:
        if slots < 1:
            raise ValueError(f"slots must be ≥ 1, got {slots}")
        self.path = pathlib.Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.slots = slots
        self.check_s = check_s
        self._count = itertools.count()
        self._mine = threading.local()

    # -- the shared state, always read and written under the flock ---------------------------------
    @contextlib.contextmanager
    def _guarded(self):
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                state = json.loads((self.path / "state.json").read_text())
            except (FileNotFoundError, ValueError):
                state = {"holders": [], "queue": []}
            before = json.dumps(state)
            alive = [t for t in state["holders"] if _alive(t)]
            state = {"holders": alive, "queue": [t for t in state["queue"] if _alive(t)]}
            yield state
            # hand free slots to the head of the queue (a holder that died frees its slot here too)
            while state["queue"] and len(state["holders"]) < self.slots:
                head = state["queue"].pop(0)
                state["holders"].append(head)
                self._wake(head)
            if json.dumps(state) != before:
                tmp = self.path / f"state.{os.getpid()}.tmp"
                tmp.write_text(json.dumps(state))
                os.replace(tmp, self.path / "state.json")
        finally:
            os.close(fd)  # releases the flock

    def _pipe(self, ticket: str) -> pathlib.Path:
        return self.path / f"wait-{ticket}"

    def _wake(self, ticket: str) -> None:
        try:
            fd = os.open(self._pipe(ticket), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # its reader is gone: the waiter sees its grant at its next check
            return
        try:
            os.write(fd, b"1")
        except OSError:
            pass
        finally:
            os.close(fd)

    # -- the context manager -----------------------------------------------------------------------
    def __enter__(self) -> HostTurns:
        ticket = f"{os.getpid()}-{threading.get_ident()}-{next(self._count)}"
        self._mine.ticket = ticket
        pipe, reader = self._pipe(ticket), None
        with self._guarded() as state:
            if len(state["holders"]) < self.slots and not state["queue"]:
                state["holders"].append(ticket)
                return self
            os.mkfifo(pipe, 0o600)
            # opened before the flock is released, so whoever grants the turn finds a reader
            reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
            state["queue"].append(ticket)
        try:
            while True:
                ready, _, _ = select.select([reader], [], [], self.check_s)
                if ready and os.read(reader, 1):
                    return self
                with self._guarded() as state:  # a missed byte, or a dead holder to clear
                    pass
                if ticket in state["holders"]:
                    return self
        except BaseException:
            with self._guarded() as state:  # interrupted while waiting: leave the queue (or the turn)
                for key in ("queue", "holders"):
                    if ticket in state[key]:
                        state[key].remove(ticket)
            raise
        finally:
            os.close(reader)
            pipe.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        ticket = self._mine.ticket
        with self._guarded() as state:
            if ticket in state["holders"]:
                state["holders"].remove(ticket)


def _alive(ticket: str) -> bool:
    """Whether the process that took ``ticket`` ("<pid>-<thread>-<n>") is still running (a zombie,
    killed and not yet reaped by its parent, is not)."""
    pid = int(ticket.split("-", 1)[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:  # Linux: field 3 of /proc/<pid>/stat is the state, Z for a zombie
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
