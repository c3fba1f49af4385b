"""A worker process of this machine started and watched by a task: a DP host (``training.dp_job``) or,
in emulated datacenters, a DiLoCo learner (``training.learner_process``). No JAX, no Prefect here.

The child imports the project (``PYTHONPATH``), runs in a session of its own (a terminal's Ctrl-C
reaches the run, which stops its workers in order), writes its output to a log file, and dies with
the thread that started it, however that one's process dies (util-linux's ``setpriv --pdeathsig
KILL``, put last in front of the Python command so that a namespace wrapper before it keeps it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the project (a worker process imports it)
INJECTED_EXIT = 3  # a worker that raised a scheduled failure (``diloco.faults.InjectedFailure``) exits so


def python_module(module: str, args: Sequence[str], wrap: Callable[[list[str]], list[str]] | None = None) -> list[str]:
    """``python -m module args…`` with the parent-death signal in front (where ``setpriv`` has it),
    run through ``wrap`` (e.g. ``run.netem.Datacenters.wrap``: into a datacenter) when given."""
    from run.control import setpriv

    cmd = [sys.executable, "-m", module, *map(str, args)]
    cmd = [setpriv(), "--pdeathsig", "KILL", "--", *cmd] if setpriv() else cmd
    return wrap(cmd) if wrap is not None else cmd


def run_watched(
    argv: list[str], log: Path, abort: Callable[[], bool] = lambda: False, poll_s: float = 0.1
) -> int | None:
    """Run ``argv`` (output appended to ``log``) until it exits; SIGKILL it once ``abort()`` is true.
    Returns its exit code (negative: killed by that signal), or None when it was aborted."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
            env=env,
        )
        try:
            while proc.poll() is None:
                if abort():
                    proc.kill()
                    proc.wait()
                    return None
                time.sleep(poll_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode


def exit_reason(code: int | None, log: Path) -> str:
    """A worker's end in words: killed by a signal, a scheduled failure, or an exit code (see its log)."""
    if code is None:
        return "aborted"
    if code < 0:
        return f"its process was killed by signal {-code}"
    if code == INJECTED_EXIT:
        return "a scheduled failure"
    return f"its process exited with code {code} (see {log})"
