"""The Prefect UI stack in one command (``make ui`` / ``ddiloco ui``): server, work pool,
deployments and a worker, started together and stopped together.

1. ``prefect server start`` on ``host:port`` (analytics and promotional content off; Prefect's own
   database), waited for until ``/api/health`` answers;
2. the process work pool ``local-proc`` (what prefect.yaml names), created if missing;
3. ``prefect --no-prompt deploy --all`` from the repository's prefect.yaml;
4. ``prefect worker start --pool local-proc``.

Each child runs in a session of its own, so SIGINT or SIGTERM to the stack, or a child that dies,
stops every other: the worker first (its running flow runs with it), then the server. Exit status: 0
after a stop signal, 1 when a part failed to start or died (its log's tail is printed), 2 for a port
that is taken.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POOL = "local-proc"
HEALTH_WAIT_S = 180.0


def port_taken(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port``."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host if host != "0.0.0.0" else "127.0.0.1", port)) == 0


class Stack:
    """The stack's children, each in its own session; :meth:`stop` ends them, last started first."""

    def __init__(self, env: dict[str, str], log_dir: Path, say: Callable[[str], None]) -> None:
        self.env, self.log_dir, self.say = env, log_dir, say
        self.children: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        """Start ``prefect <args>`` as the part ``name``, logging to ``<log_dir>/<name>.log``."""
        log, args = self.log_dir / f"{name}.log", [str(Path(sys.executable).with_name("prefect")), *args]
        with open(log, "ab") as fh:
            io = {"stdout": fh, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
            proc = subprocess.Popen(args, cwd=ROOT, env=self.env, start_new_session=True, **io)
        self.children.append((name, proc, log))
        return proc

    def died(self) -> tuple[str, int, Path] | None:
        """The first child of the long-running ones (server, worker) that exited: (name, code, log)."""
        gone = [
            (n, p.returncode, log) for n, p, log in self.children if n in ("server", "worker") and p.poll() is not None
        ]
        return gone[0] if gone else None

    def stop(self) -> None:
        for name, proc, _ in reversed(self.children):
            running = proc.poll() is None
            stop_group(proc, term_wait_s=20.0)
            if running:
                self.say(f"stopped the {name}")
        self.children.clear()


def stop_group(proc: subprocess.Popen, term_wait_s: float = 15.0) -> None:
    """End ``proc``'s process group: SIGTERM, SIGKILL after ``term_wait_s`` s, then SIGKILL to what of the
    group outlived its leader (a flow-run process)."""
    for sig, wait_s in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def _healthy(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def ensure_pool(api: str, name: str = POOL) -> bool:
    """Create the process work pool ``name`` on the server at ``api`` unless it exists; True if created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
            return True


def run_stack(
    host: str = "127.0.0.1",
    port: int = 4200,
    deploy: bool = True,
    worker: bool = True,
    log_dir: Path | None = None,
    say: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> int:
    """Start the stack and keep it up until SIGINT/SIGTERM (or ``stop`` is set), then stop it all.
    ``deploy``/``worker`` False leave those parts out; ``log_dir``: the parts' logs (default
    ``build/ui-stack/``). Returns the exit status (see the module)."""
    if port_taken(host, port):
        free = "4300" if port != 4300 else "4301"
        hint = f"stop it or pick another port: ddiloco ui --port {free} (make ui UI_PORT={free})"
        say(f"error: {host}:{port} is taken (another Prefect server?); {hint}")
        return 2
    log_dir = log_dir or ROOT / "build" / "ui-stack"
    log_dir.mkdir(parents=True, exist_ok=True)
    shown = "127.0.0.1" if host == "0.0.0.0" else host
    base, api = f"http://{shown}:{port}", f"http://{shown}:{port}/api"
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_UI_API_URL": os.environ.get("PREFECT_UI_API_URL", api),
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    }
    stop = stop or threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if threading.current_thread() is threading.main_thread():
        for s in previous:
            signal.signal(s, lambda *_: stop.set())
    stack = Stack(env, log_dir, say)
    try:
        server = stack.start("server", ["server", "start", "--host", host, "--port", str(port)])
        end = time.monotonic() + HEALTH_WAIT_S
        while not _healthy(api):
            if server.poll() is not None or time.monotonic() > end or stop.is_set():
                if stop.is_set():
                    return 0
                say(f"error: the Prefect server did not come up at {api}:\n{tail(log_dir / 'server.log')}")
                return 1
            time.sleep(0.5)
        say(f"server: {base} (API {api}; log {log_dir / 'server.log'})")
        say(f"work pool {POOL}: " + ("created (process)" if ensure_pool(api) else "exists"))
        if deploy and not stop.is_set():
            say("deploying prefect.yaml (every deployment; about 30 s) ...")
            proc = stack.start("deploy", ["--no-prompt", "deploy", "--all"])
            while proc.poll() is None and not stop.is_set():
                time.sleep(0.5)
            if stop.is_set():
                return 0
            if proc.returncode != 0:
                say(f"error: prefect deploy --all failed:\n{tail(log_dir / 'deploy.log')}")
                return 1
            say("deployments: created from prefect.yaml")
        if worker and not stop.is_set():
            stack.start("worker", ["worker", "start", "--pool", POOL])
            say(f"worker: polling {POOL} (log {log_dir / 'worker.log'})")
        say(f"ready: open {base} (Ctrl-C stops the server, the worker and its runs)")
        while not stop.wait(1.0):
            gone = stack.died()
            if gone is not None:
                name, code, log = gone
                say(f"error: the {name} exited ({code}); stopping the stack:\n{tail(log)}")
                return 1
        return 0
    finally:
        stack.stop()
        if threading.current_thread() is threading.main_thread():
            for s, handler in previous.items():
                signal.signal(s, handler)
