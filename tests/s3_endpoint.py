"""A local S3-compatible endpoint for the tests: moto's server mode in a process of its own
(``run.s3_server``), with authenticated requests.

Credentials and the endpoint reach clients through the standard AWS variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``), which botocore, hence
s3fs, reads: the same way a cluster's nodes are configured (docs/scale-out.md). The server process
gets SIGKILL when the process that started it dies (``PR_SET_PDEATHSIG``), so nothing outlives a
failed or killed test session.
"""

from __future__ import annotations

from pathlib import Path

from run.s3_server import S3Server, die_with_parent, free_port

__all__ = ["MotoServer", "die_with_parent", "free_port"]

_USER = "ddiloco-test"
_S3_POLICY = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'
_USER_CALLS = ("CreateUser", "PutUserPolicy", "CreateAccessKey")


class MotoServer(S3Server):
    """``with MotoServer() as s3:`` the product's S3 server (``run.s3_server``) on loopback with its
    requests authenticated: after the first three, which make the user whose key the tests use
    (:meth:`_make_user`), a wrong key or secret is refused as a real store refuses it."""

    def __init__(self, *, log: Path, timeout_s: float = 60.0):
        super().__init__(
            log=log, timeout_s=timeout_s, server_env={"INITIAL_NO_AUTH_ACTION_COUNT": str(len(_USER_CALLS))}
        )

    def __enter__(self) -> MotoServer:
        super().__enter__()
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
