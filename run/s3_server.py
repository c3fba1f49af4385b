"""An S3-compatible object store in a process of this machine: moto's server mode (``moto_server``).

The exchange of an emulated run (``network.emulate``: ``flows.datacenters``) lives there, in the hub's
namespace, so that the learners' fragments cross their datacenters' links; the tests use it as their
S3 endpoint. Clients find it through the standard AWS variables (:attr:`S3Server.env`:
``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``, and with ``credentials`` the key and secret), which
botocore, hence s3fs, reads. It keeps its objects in memory: a store for one run, not a durable one.
The server gets SIGKILL when the process that started it dies (``PR_SET_PDEATHSIG``). No JAX here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from unittest import mock

# Exec'd by a fresh interpreter that first asks the kernel for SIGKILL when its parent dies (a
# ``preexec_fn`` would run Python between fork and exec in a process that holds JAX's threads).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL); "  # PR_SET_PDEATHSIG
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that its process gets SIGKILL when the process that started it dies."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, *argv]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class S3Server:
    """``with S3Server(log=…) as s3:`` moto's S3 server on ``s3.endpoint`` (``host``: the address it
    listens on); ``s3.env`` is the environment a client needs. ``credentials``: the key and secret
    put in :attr:`env` (moto's default server accepts any). ``server_env``: extra variables of the
    server process. Raises ``RuntimeError`` (with the server's log) if it does not answer within
    ``timeout_s`` seconds."""

    def __init__(
        self,
        *,
        log: Path,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        credentials: tuple[str, str] | None = None,
        server_env: dict[str, str] | None = None,
    ):
        self.port = free_port(host)
        self.endpoint = f"http://{host}:{self.port}"
        self.host, self.log, self.timeout_s = host, Path(log), timeout_s
        self.env = {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
        if credentials is not None:
            self.env.update(AWS_ACCESS_KEY_ID=credentials[0], AWS_SECRET_ACCESS_KEY=credentials[1])
        self.server_env = server_env or {}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> S3Server:
        exe = Path(sys.executable).with_name("moto_server")
        if not exe.exists():
            raise RuntimeError(f"moto's server is not installed here ({exe}): uv sync --extra emulate")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                die_with_parent([str(exe), "-H", self.host, "-p", str(self.port)]),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C stops the run, which stops the store
                env={**os.environ, **self.server_env},
            )
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).read()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    log = self.log.read_text()[-2000:]
                    raise RuntimeError(f"moto_server did not answer on {self.endpoint}: {log}") from None
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` through s3fs with :attr:`env` (an existing one is kept)."""
        import s3fs

        with mock.patch.dict(os.environ, self.env):
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            if not fs.exists(bucket):
                fs.mkdir(bucket)
