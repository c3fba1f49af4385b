"""Prefect's temporary server for a command-line run, in a session of its own.

With no ``PREFECT_API_URL`` set, the first flow call of a process starts Prefect's temporary API
server (``SubprocessASGIServer``: uvicorn in a child process) in the terminal's foreground process
group, so Ctrl-C killed it while ``ddiloco`` was still stopping its run cleanly (every later API call
failed, no report, exit 1). :func:`start_temporary_server` starts that same server (Prefect's class,
arguments and settings) before the flow runs, in a new session (``setsid``): SIGINT reaches only
``ddiloco``, which stops the run, writes its report and stops the server at exit.

A ``ddiloco`` killed without its exit handlers (``kill -9``, the out-of-memory killer) stops the server
too, two ways, neither running Python code between fork and exec in the JAX process:

* util-linux's ``setpriv --pdeathsig TERM`` in front of Prefect's command (when installed, from the
  main thread: the kernel signals when the *thread* that started the child ends); it execs the
  server, which keeps its PID.
* Always, the server runs Prefect's ``python -m uvicorn`` as ``python -c`` with a watchdog thread first
  (:data:`WATCHDOG`): once its parent (``DDILOCO_SERVER_PARENT``) is gone, it sends itself SIGTERM
  and ends the process 10 s later (where ``setpriv`` is missing or cannot be used).

The server is Prefect's process-wide singleton: every Prefect client of the process, and the process
engines' workers (:func:`flows.engines.engine_session`), use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from unittest import mock

from prefect.server.api import server as prefect_server
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

from run.control import setpriv

# Runs first in the server's process, then hands over to uvicorn's command line (what ``python -m
# uvicorn`` runs). Polls twice a second; a parent that is gone leaves the process to a reaper.
WATCHDOG = """\
import os, signal, sys, threading, time
def _watch(parent=int(os.environ.pop("DDILOCO_SERVER_PARENT"))):
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os._exit(1)
threading.Thread(target=_watch, name="ddiloco-parent-watchdog", daemon=True).start()
sys.argv[0] = "uvicorn"
import uvicorn
uvicorn.main()
"""


def _pdeathsig(command: list[str]) -> list[str]:
    """``command`` with ``setpriv --pdeathsig TERM`` in front, where installed and in the main thread."""
    if setpriv() is not None and threading.current_thread() is threading.main_thread():
        return [setpriv(), "--pdeathsig", "TERM", "--", *command]
    return command


_Popen = subprocess.Popen  # (the real one: the server's start patches subprocess.Popen)


def start_server_process(args: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` of Prefect's server command ``[python, -m, uvicorn, …]`` with the parent-death
    signal in front and the watchdog (:data:`WATCHDOG`, given this PID) in place of ``-m uvicorn``, in a
    new session; any other command unchanged."""
    args = list(args)
    if args[1:3] == ["-m", "uvicorn"]:
        args = _pdeathsig([args[0], "-c", WATCHDOG, *args[3:]])
    env = {**(os.environ if env is None else env), "DDILOCO_SERVER_PARENT": str(os.getpid())}
    # setsid() in C: no fork hazard; setpriv and the watchdog act after exec
    return _Popen(args, env=env, start_new_session=True, **kwargs)


class _OwnSessionServer(SubprocessASGIServer):
    """Prefect's temporary server, its uvicorn child in a session of its own (see the module)."""

    def _run_uvicorn_command(self) -> subprocess.Popen:
        setpriv()  # (looked up before Popen is patched: it runs setpriv --help)
        # Prefect's own command, arguments and environment; only how the child is started changes.
        with mock.patch.object(subprocess, "Popen", start_server_process):
            return super()._run_uvicorn_command()

    def stop(self) -> None:
        """Stop as Prefect does, without its "Stopping temporary server" line (a run's last lines are its own)."""
        log = prefect_server.subprocess_server_logger  # Prefect's "prefect" logger
        level = log.level
        log.setLevel(logging.WARNING)
        try:
            super().stop()
        finally:
            log.setLevel(level)


# The reaper's program (``python -c REAPER <parent pid>``): every second it notes the parent's
# descendants (PID and start time); once the parent is gone (its parent-death signal, or a new
# parent PID) it SIGKILLs each noted process still alive with the same start time, then exits.
REAPER = """\
import os, signal, sys, time
import psutil
parent, me, stop = int(sys.argv[1]), os.getpid(), []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
signal.signal(signal.SIGINT, signal.SIG_IGN)
seen = {}
while not stop and os.getppid() == parent:
    try:
        for p in psutil.Process(parent).children(recursive=True):
            if p.pid != me:
                seen.setdefault(p.pid, p.create_time())
    except psutil.Error:
        break
    time.sleep(1.0)
for pid, born in seen.items():
    try:
        p = psutil.Process(pid)
        if p.create_time() == born:
            p.kill()
    except psutil.Error:
        pass
"""


def start_reaper() -> subprocess.Popen:
    """Start the run's reaper (:data:`REAPER`), in a session of its own: it ends whatever this process
    started (the temporary server, a local Ray instance with its agents, which outlive a SIGKILLed
    driver, a local Dask cluster, workers) once this process dies, however it dies. Call it from the
    main thread of a command-line run."""
    return _Popen(
        _pdeathsig([sys.executable, "-c", REAPER, str(os.getpid())]),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def start_temporary_server() -> str | None:
    """Start the run's reaper and, unless ``PREFECT_API_URL`` is set (then None is returned), Prefect's
    temporary server in a session of its own; returns its API URL. Call it in the main thread before
    the first flow call; stopped at exit. Raises ``RuntimeError`` if the server does not answer within
    ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``."""
    start_reaper()
    if get_current_settings().api.url:
        return None
    server = _OwnSessionServer()  # registers itself as the process's SubprocessASGIServer()
    if not isinstance(server, _OwnSessionServer):  # Prefect's own started first: keep it
        return server.api_url if server.running else None
    server.start()
    return server.api_url


@contextlib.contextmanager
def temporary_server_for_workers() -> Iterator[None]:
    """For the block, a Prefect API that other processes (a cluster's workers) can be handed: the one
    ``PREFECT_API_URL`` names, or the temporary server's, then put in :func:`api_for_workers`."""
    url = start_temporary_server()  # None: PREFECT_API_URL is set, its server
    with contextlib.nullcontext() if url is None else api_for_workers(url):
        yield


@contextlib.contextmanager
def api_for_workers(url: str) -> Iterator[None]:
    """For the block, ``PREFECT_API_URL`` is ``url`` in this process's environment (inherited by workers
    started in it) and in Prefect's settings (shipped with every task); both restored after."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with mock.patch.dict(os.environ, {"PREFECT_API_URL": url}), temporary_settings(updates={PREFECT_API_URL: url}):
        yield
