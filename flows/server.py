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
server on exit (Prefect's ``atexit``). A ``kill -9`` of ``ddiloco`` leaves the server running, as it
did before (nothing runs at such an exit; a hook in the child, e.g. ``PR_SET_PDEATHSIG`` through
``preexec_fn``, would make Python fork a JAX process with Python code in the child, which JAX warns
may deadlock). The server is Prefect's process-wide singleton: every Prefect client of the process,
and the process engines' workers (:func:`flows.engines.engine_session`), use it.
"""

from __future__ import annotations

import functools
import subprocess
from unittest import mock

from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings


class _OwnSessionServer(SubprocessASGIServer):
    """Prefect's temporary server, its uvicorn child started in a session of its own."""

    def _run_uvicorn_command(self) -> subprocess.Popen:
        popen = functools.partial(subprocess.Popen, start_new_session=True)  # setsid() in C: no fork hazard
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
