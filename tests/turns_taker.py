"""A process that takes turns on a HostTurns folder (tests/test_learner.py).

Kept apart from the test module so that a spawned child imports the turns alone, not JAX."""

from __future__ import annotations

import os
import signal
import time

from diloco.pacing import HostTurns


def take_turns(path: str, slots: int, turns: int, hold_s: float, out, go, die_holding: bool = False) -> None:
    """Take ``turns`` turns of ``hold_s`` seconds each, putting ``(pid, start, end)`` on ``out`` for
    every one, once ``go`` (an Event) is set. With ``die_holding``, SIGKILL this process in the
    middle of its first turn."""
    host = HostTurns(path, slots, check_s=0.02)
    out.put(("ready", os.getpid(), time.time()))
    go.wait()
    for _ in range(turns):
        with host:
            start = time.time()
            if die_holding:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(hold_s)
            end = time.time()
        out.put((os.getpid(), start, end))
