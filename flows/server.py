r"""Prefect's temporary server for a command-line run, in a session of its own.

With no ``PREFECT_API_URL`` set, the first flow call of a process starts Prefect's temporary API
server (``SubprocessASGIServer``: uvicorn in a child process) and stops it at exit. That child shares
the terminal's foreground process group, so Ctrl-C, which the terminal sends to the whole group,
killed the server at once while ``ddiloco`` was still stopping its run cleanly: every later API call
failed and retried for minutes, and the run ended with connection-refused tracebacks, exit 1 and no
report instead of exit 130 within seconds.

:func:`start_temporary_server` starts that same server (Prefect's class, arguments and settings)
before the flow runs, in a new session (``setsid``): the terminal's SIGINT reaches only ``ddiloco``,
which stops the run at the next step boundary, writes the report of what was done, and stops the
server on exit (Prefect's ``atexit``).

A ``ddiloco`` that dies without running its exit handlers (``kill -9``, a time-out's SIGKILL, the
out-of-memory killer) stops the server too, two ways, neither of which runs Python code between
fork and exec in the JAX process (``preexec_fn`` did, and JAX warns that such a fork may deadlock):

* util-linux's ``setpriv --pdeathsig TERM`` is put in front of Prefect's command (Linux, when
  ``setpriv`` is installed and knows the option, and the server is started from the main thread:
  the kernel sends the signal when the *thread* that started the child ends). ``setpriv`` sets the
  parent-death signal and ``exec``\ s the server, which keeps its PID, so Prefect stops it as usual.
* In any case the server runs Prefect's ``python -m uvicorn`` command as ``python -c`` with a
  watchdog thread first (:data:`WATCHDOG`): once its parent (``ddiloco``'s PID, passed in
  ``DDILOCO_SERVER_PARENT``) is no longer its parent, it sends itself SIGTERM and, should uvicorn
  not have exited 10 s later, ends the process. This is the fallback where ``setpriv`` is missing
  (macOS, a minimal image) and where the parent-death signal cannot be used.

The server is Prefect's process-wide singleton: every Prefect client of the process,
and the process engines' workers (:func:`flows.engines.engine_session`), use it.
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


def server_command(args: list[str]) -> list[str]:
    """Prefect's server command ``[python, -m, uvicorn, …]`` with the parent-death signal in front
    (:func:`setpriv`, main thread only) and the watchdog (:data:`WATCHDOG`) in place of ``-m
    uvicorn``. Any other command is returned unchanged."""
    args = list(args)
    if args[1:3] != ["-m", "uvicorn"]:
        return args
    command = [args[0], "-c", WATCHDOG, *args[3:]]
    if setpriv() is not None and threading.current_thread() is threading.main_thread():
        command = [setpriv(), "--pdeathsig", "TERM", "--", *command]
    return command


_Popen = subprocess.Popen  # (the real one: the server's start patches subprocess.Popen)


def start_server_process(args: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` of the server's command as :func:`server_command` rewrites it, in a new
    session, with this process's PID for the watchdog; other ``Popen`` arguments pass through."""
    env = {**(os.environ if env is None else env), "DDILOCO_SERVER_PARENT": str(os.getpid())}
    # setsid() in C: no fork hazard; setpriv and the watchdog act after exec
    return _Popen(server_command(args), env=env, start_new_session=True, **kwargs)


class _OwnSessionServer(SubprocessASGIServer):
    """Prefect's temporary server, its uvicorn child started in a session of its own, ended when the
    process that started it dies (see the module docstring)."""

    def _run_uvicorn_command(self) -> subprocess.Popen:
        setpriv()  # (looked up before Popen is patched: it runs setpriv --help)
        # Prefect's own command, arguments and environment; only how the child is started changes.
        with mock.patch.object(subprocess, "Popen", start_server_process):
            return super()._run_uvicorn_command()

    def stop(self) -> None:
        """Stop as Prefect does, without its "Stopping temporary server" log line, so that the last
        lines of a command-line run stay its own (results, or the reason it failed or stopped)."""
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
    """Start the run's reaper (:data:`REAPER`): a small process, in a session of its own, that ends
    whatever this process started (the temporary server, a local Ray instance with its agents, a
    local Dask cluster, worker processes) once this process dies, however it dies. Ray's dashboard
    and runtime-env agents, for one, outlive a SIGKILLed driver: they report the raylet's death to
    the GCS, which died with it, and wait. The parent-death signal (:func:`setpriv`) and a poll of
    the parent PID both wake it; a process it noted whose start time differs (a reused PID) is
    left alone. Call it from the main thread of a command-line run."""
    command = [sys.executable, "-c", REAPER, str(os.getpid())]
    if setpriv() is not None and threading.current_thread() is threading.main_thread():
        command = [setpriv(), "--pdeathsig", "TERM", "--", *command]
    return _Popen(
        command, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def start_temporary_server() -> str | None:
    """Start the run's reaper (:func:`start_reaper`) and Prefect's temporary server in a session of
    its own, unless a Prefect API is configured (``PREFECT_API_URL``: then no server is started and
    None is returned). Returns the server's API URL. Call it in the main thread before the first
    flow call; stopped at exit. Raises ``RuntimeError`` if the server does not answer within
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
    """For the block, a Prefect API that processes started apart from this one (a Dask or Ray
    cluster's workers) can be handed: the one ``PREFECT_API_URL`` names, or Prefect's temporary
    server (:func:`start_temporary_server`), whose URL is then put in this process's environment and
    settings (benchmarks/engines.py's clusters give it to their workers)."""
    url = start_temporary_server()
    if url is None:  # PREFECT_API_URL is set: its server
        yield
        return
    with api_for_workers(url):
        yield


@contextlib.contextmanager
def api_for_workers(url: str) -> Iterator[None]:
    """For the block, ``PREFECT_API_URL`` is ``url`` in this process's environment (which worker
    processes started in the block inherit) and in Prefect's settings (shipped with every task);
    both restored after."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with mock.patch.dict(os.environ, {"PREFECT_API_URL": url}), temporary_settings(updates={PREFECT_API_URL: url}):
        yield
