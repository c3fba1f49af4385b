"""A local S3-compatible endpoint for the tests: moto's server mode in a process of its own.

Credentials and the endpoint reach clients through the standard AWS variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``), which botocore, hence
s3fs, reads: the same way a cluster's nodes are configured (docs/scale-out.md). The server process
gets SIGKILL when the process that started it dies (``PR_SET_PDEATHSIG``), so nothing outlives a
failed or killed test session.
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


_USER = "ddiloco-test"
_S3_POLICY = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'
_USER_CALLS = ("CreateUser", "PutUserPolicy", "CreateAccessKey")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """``with MotoServer() as s3:`` a moto S3 server on ``s3.endpoint``; ``s3.env`` is the
    environment a client needs. Raises ``RuntimeError`` (with the server's log) if it does not
    answer within ``timeout_s`` seconds."""

    def __init__(self, *, log: Path, timeout_s: float = 60.0):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        self.timeout_s = timeout_s
        self.env = {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> MotoServer:
        exe = Path(sys.executable).with_name("moto_server")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                die_with_parent([str(exe), "-H", "127.0.0.1", "-p", str(self.port)]),
                stdout=out,
                stderr=subprocess.STDOUT,
                # requests are authenticated (a wrong key or secret is refused) after the first three,
                # which make the user whose key the tests use (_make_user)
                env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(len(_USER_CALLS))},
            )
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    log = self.log.read_text()[-2000:]
                    raise RuntimeError(f"moto_server did not answer on {self.endpoint}: {log}") from None
                time.sleep(0.2)
        self._make_user()
        return self

    def _make_user(self) -> None:
        """An IAM user allowed every S3 action, and its access key in :attr:`env`."""
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        iam.create_user(UserName=_USER)
        iam.put_user_policy(UserName=_USER, PolicyName="s3", PolicyDocument=_S3_POLICY)
        key = iam.create_access_key(UserName=_USER)["AccessKey"]
        self.env["AWS_ACCESS_KEY_ID"] = key["AccessKeyId"]
        self.env["AWS_SECRET_ACCESS_KEY"] = key["SecretAccessKey"]

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
