"""Clusters started the way users start them, apart from the run (docs/scale-out.md, "On a cluster
you start"): ``dask scheduler`` and ``dask worker`` processes, or a Ray head (``ray start --head``)
and a second node (``ray start --address …``), all on loopback. Used by tests/test_clusters.py.

The commands are the documented ones (:data:`DASK_STEPS`, :data:`RAY_STEPS`, with the placeholders
filled in); tests/test_clusters.py checks that the docs still show them as written. Nothing outlives
a test: Dask's processes get SIGKILL when the test process dies (``PR_SET_PDEATHSIG``) and are ended
when the block ends; Ray's daemons detach from ``ray start``, so the nodes' processes are found by
the cluster's own session folder and killed when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
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
    "head": "ray start --head --port {port} --num-cpus {cpus} --include-dashboard false",
    "node": "ray start --address {host}:{port} --num-cpus {cpus}",
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


def processes_named(*markers: str) -> list[psutil.Process]:
    """The processes (other than this one) with an argument that contains one of ``markers`` (a Ray
    cluster's session folder; ``:<GCS port>``, which its Ray Client server names instead)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and any(m in a for a in p.info["cmdline"] or () for m in markers):
                found.append(p)
    return found


# start_reaper's process: sleeps until the process that started it dies (PR_SET_PDEATHSIG: SIGTERM),
# then kills every process processes_named(*markers) finds.
_REAPER = """
import ctypes, os, signal, sys
signal.signal(signal.SIGTERM, lambda *a: None)
ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() == int(sys.argv[1]):
    signal.pause()
from tests.clusters import processes_named
for p in processes_named(*sys.argv[2:]):
    try:
        p.kill()
    except Exception:
        pass
"""


def start_reaper(*markers: str) -> subprocess.Popen:
    """A process that waits for this one to die (however it dies: SIGKILL included), then kills every
    process :func:`processes_named` finds for ``markers``. Kill it once those processes are ended."""
    return subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), *markers], cwd=ROOT)


@contextlib.contextmanager
def ray_cluster(cpus: tuple[int, int], env: dict[str, str], log_dir: Path) -> Iterator[dict]:
    """A Ray head (``cpus[0]`` logical CPUs) and a second node (``cpus[1]``) on this host, started with
    the documented ``ray start`` commands apart from the run, ``env`` added to their environment (a
    token for Ray's token authentication among it); yields ``{"address": "<host>:<port>", "head":
    <node id>, "node": <node id of the second node>, "raylet": <pid of the second node's raylet>}``.
    Every process of the two nodes (found by their session folder, a temporary folder of this
    cluster's own) gets SIGKILL when the block ends; nothing else on the host is touched (``ray stop``
    would end every Ray process here)."""
    host, port = "127.0.0.1", free_port()
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # (short: Unix socket paths ≤ 107 bytes)
    penv = {**os.environ, **env}
    markers = (str(temp_dir), f":{port}")
    reaper = start_reaper(*markers)  # (for a death of this process that skips the block's end)

    def ray(step: str, name: str, extra: list[str]) -> None:
        with open(log_dir / f"ray-{name}.log", "ab") as out:
            subprocess.run(
                [*argv(step, host=host, port=port, cpus=cpus[name == "node"]), *extra, "--disable-usage-stats"],
                cwd=ROOT, env=penv, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=240,
            )  # fmt: skip

    try:
        # (on one host: the head's session folder is this cluster's own, and the second node's agent
        # listens on a port of its own)
        ray(RAY_STEPS["head"], "head", ["--temp-dir", str(temp_dir), "--node-ip-address", host])
        (head,) = _raylets(temp_dir)  # (``ray start`` returns once its node has registered)
        ray(RAY_STEPS["node"], "node", ["--node-ip-address", host, "--dashboard-agent-listen-port", str(free_port())])
        raylets = _raylets(temp_dir)
        (node,) = set(raylets) - {head}
        raylet = raylets[node]
        yield {"address": f"{host}:{port}", "head": head, "node": node, "raylet": raylet, "markers": markers}
    finally:
        procs = processes_named(*markers)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                procs += p.children(recursive=True)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        reaper.kill()
        reaper.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _raylets(temp_dir: Path) -> dict[str, int]:
    """The raylets of the Ray nodes whose session lives under ``temp_dir``: node id → PID."""
    found = {}
    for p in processes_named(str(temp_dir)):
        with contextlib.suppress(psutil.Error):
            args = p.cmdline()
            if Path(args[0]).name == "raylet":
                found[next(a.split("=", 1)[1] for a in args if a.startswith("--node_id="))] = p.pid
    return found
