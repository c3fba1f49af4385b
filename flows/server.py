"""Prefect's temporary server for a command-line run, in a session of its own.

With no ``PREFECT_API_URL`` set, the first flow call of a process starts Prefect's temporary API
server (``SubprocessASGIServer``: uvicorn in a child process) and stops it at exit. That child shares
the terminal's foreground process group, so Ctrl-C, which the terminal sends to the whole group,
killed the server at once while ``ddiloco`` was still stopping its run cleanly: every later API call
failed and retried for minutes, and the run ended with connection-refused tracebacks, exit 1 and no
report instead of exit 130 within seconds.

:func:`start_temporary_server` starts that same server (Prefect's class, arguments and settings)
before the flow runs, in a new session (``setsid``): the terminal's SIGINT reaches only ``ddiloco``,
which stops the run at the next step boundary, writes the report of what was done, and stops the
server on exit (Prefect's ``atexit``). On Linux the server also gets SIGTERM when ``ddiloco`` dies
(``PR_SET_PDEATHSIG``), so a ``kill -9`` leaves no orphaned server behind. The server is Prefect's
process-wide singleton: every Prefect client of the process, and the process engines' workers
(:func:`flows.engines.engine_session`), use it.
"""

from __future__ import annotations

import ctypes
import functools
import signal
import subprocess
import sys
from unittest import mock

from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl = ctypes.CDLL(None).prctl if sys.platform == "linux" else None  # looked up here, not in the child


def _die_with_parent() -> None:  # runs in the child between fork and exec: no imports, no allocation
    """In the server's child process: ask Linux for SIGTERM when the parent dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class _OwnSessionServer(SubprocessASGIServer):
    """Prefect's temporary server, its uvicorn child started in a session of its own."""

    def _run_uvicorn_command(self) -> subprocess.Popen:
        popen = functools.partial(subprocess.Popen, start_new_session=True,
                                  preexec_fn=_die_with_parent if _prctl is not None else None)
        # Prefect's own command, arguments and environment; only how the child is started changes.
        with mock.patch.object(subprocess, "Popen", popen):
            return super()._run_uvicorn_command()


def start_temporary_server() -> str | None:
    """Start Prefect's temporary server in a session of its own, unless a Prefect API is configured
    (``PREFECT_API_URL``: then nothing is started and None is returned). Returns the server's API
    URL. Call it in the main thread before the first flow call; stopped at exit. Raises
    ``RuntimeError`` if the server does not answer within
    ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``."""
    if get_current_settings().api.url:
        return None
    server = _OwnSessionServer()  # registers itself as the process's SubprocessASGIServer()
    if not isinstance(server, _OwnSessionServer):  # Prefect's own started first: keep it
        return server.api_url if server.running else None
    server.start()
    return server.api_url
