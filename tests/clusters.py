"""Clusters started the way users start them, apart from the run (docs/scale-out.md, "On a cluster
you start"): ``dask scheduler`` and ``dask worker`` processes, or a Ray head (``ray start --head``)
and a second node (``ray start --address …``), all on loopback. Used by tests/test_clusters.py.

The commands are the documented ones (:data:`DASK_STEPS`, :data:`RAY_STEPS`, with the placeholders
filled in); tests/test_clusters.py checks that the docs still show them as written. Nothing outlives
a test: Dask's processes get SIGKILL when the test process dies (``PR_SET_PDEATHSIG``) and are ended
when the block ends; Ray's daemons detach from ``ray start``, so its nodes are ended by ``ray stop``
with the test's own temporary folder, and any process left in their session is killed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from tests.s3_endpoint import die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# The documented commands (docs/scale-out.md), {placeholders} filled in by the tests.
DASK_STEPS = {
    "scheduler": "dask scheduler --host {host} --port {port} --no-dashboard",
    "worker": "dask worker tcp://{host}:{port} --nthreads 1 --memory-limit 0 --no-dashboard",
}
RAY_STEPS = {
    "head": "ray start --head --node-ip-address {host} --port {port} --num-cpus {cpus} --include-dashboard false",
    "node": "ray start --address {host}:{port} --node-ip-address {host} --num-cpus {cpus}",
    "stop": "ray stop",
}


def argv(step: str, **values) -> list[str]:
    """A documented step's command line with its placeholders filled in, run from this environment."""
    words = shlex.split(step.format(**values))
    return [str(BIN / words[0]), *words[1:]]


@contextlib.contextmanager
def dask_cluster(workers: int, env: dict[str, str], log_dir: Path) -> Iterator[dict]:
    """A ``dask scheduler`` and ``workers`` ``dask worker`` processes (each a nanny and its worker
    process), started apart from the run with ``env`` added to their environment; yields
    ``{"address": "tcp://127.0.0.1:<port>", "workers": [Popen, …]}`` once every worker has joined."""
    host, port = "127.0.0.1", free_port()
    procs: list[subprocess.Popen] = []
    penv = {**os.environ, **env}

    def start(step: str, name: str) -> subprocess.Popen:
        with open(log_dir / f"{name}.log", "ab") as out:
            p = subprocess.Popen(
                die_with_parent(argv(step, host=host, port=port)),
                cwd=ROOT, env=penv, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        procs.append(p)
        return p

    try:
        start(DASK_STEPS["scheduler"], "scheduler")
        ws = [start(DASK_STEPS["worker"], f"worker-{i}") for i in range(workers)]
        from distributed import Client

        with Client(f"tcp://{host}:{port}", timeout=120) as client:
            client.wait_for_workers(workers, timeout=180)
        yield {"address": f"tcp://{host}:{port}", "workers": ws}
    finally:
        for p in reversed(procs):
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
            p.kill()
            p.wait()


def _ray_processes(temp_dir: Path) -> list[psutil.Process]:
    """The processes of Ray nodes whose session lives under ``temp_dir``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(temp_dir) in a for a in p.info["cmdline"] or ()):
                found.append(p)
    return found


@contextlib.contextmanager
def ray_cluster(cpus: tuple[int, int], env: dict[str, str], temp_dir: Path, log_dir: Path) -> Iterator[dict]:
    """A Ray head (``cpus[0]`` logical CPUs) and a second node (``cpus[1]``) on loopback, started
    with ``ray start`` apart from the run; yields ``{"address": "127.0.0.1:<port>", "node": <node id
    of the second node>}``. Ended with ``ray stop`` and, for anything left, SIGKILL."""
    host, port = "127.0.0.1", free_port()
    penv = {**os.environ, **env, "RAY_TMPDIR": str(temp_dir)}
    extra = ["--temp-dir", str(temp_dir), "--disable-usage-stats"]

    def ray(step: str, name: str, **values) -> None:
        with open(log_dir / f"ray-{name}.log", "ab") as out:
            subprocess.run(
                [*argv(step, host=host, port=port, **values), *(extra if name == "head" else ["--disable-usage-stats"])],
                cwd=ROOT, env=penv, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=240,
            )  # fmt: skip

    try:
        ray("head", "head", cpus=cpus[0])
        before = {n for n in _node_ids(f"{host}:{port}")}
        ray("node", "node", cpus=cpus[1], dashboard_agent_port=free_port())
        deadline = time.monotonic() + 120
        while not (new := _node_ids(f"{host}:{port}") - before) and time.monotonic() < deadline:
            time.sleep(1)
        if not new:
            raise RuntimeError(f"the second Ray node never registered (logs in {log_dir})")
        yield {"address": f"{host}:{port}", "node": new.pop()}
    finally:
        with contextlib.suppress(Exception):
            subprocess.run([str(BIN / "ray"), "stop", "--force"], env=penv, capture_output=True, timeout=60)
        for p in _ray_processes(temp_dir):
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)


def _node_ids(address: str) -> set[str]:
    """The ids of the alive nodes of the Ray cluster at ``address`` (its GCS), read in a fresh process."""
    code = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
        "print(' '.join(n['NodeID'] for n in ray.nodes() if n['Alive']))"
    )
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=120)
    return set(out.stdout.split())
