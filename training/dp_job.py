"""The DP job's hosts as processes (``dp.hosts`` > 1): the host process, the agent that starts and
watches one, and the files a generation of hosts shares in the run directory. No Prefect here: a
Prefect task runs :func:`run_agent` on ``runtime.engine`` (``tasks.pretrain.dp_host_task``), one per
host, and ``flows.pretrain`` drives the generations (``training.dp.run_job``).

A host is ``python -m training.dp_job RUN --rank R --generation G``: it reads the job's config and
its generation's plan, meets the others through ``jax.distributed`` (host 0 picks a free port on
its address and writes ``HOST:PORT`` for the others; gloo carries the CPU collectives, NCCL the
GPU ones), and runs ``training.dp.run_host``. Host 0 writes the logs, checkpoints, its last step
(for the launcher's high-water mark) and the summary. A scheduled failure writes a note first, then
SIGKILLs the process (or exits 3). A stop (SIGTERM/SIGINT of the run) reaches every host as a step
to stop at, written by the launcher, so that all of them leave the SPMD loop at the same step.

Gloo connects to the address its host's name resolves to: on a cluster, each node's host name must
resolve to an address the other nodes reach (an emulated datacenter sets it: ``run.netem``).

Files: ``RUN/pretrain/dp/hosts/`` (:class:`HostFiles`, laid out by ``run.layout.HostsFolder``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

from run.atomic import write_json
from run.layout import HostsFolder, NetworkFolder, RunLayout
from run.processes import INJECTED_EXIT, python_module, run_watched

COORDINATOR_WAIT_S = 300.0  # how long hosts 1.. wait for host 0's address (and jax.distributed for all)


class HostFiles(HostsFolder):
    """The DP job's host files in ``run_dir``, of ``generation`` (``run.layout.HostsFolder``)."""

    def __init__(self, run_dir: str | Path, generation: int = 0):
        super().__init__(Path(RunLayout(run_dir).job_hosts("pretrain", "dp")), generation)

    def step(self) -> int:
        """Host 0's last completed step (0 before its first)."""
        try:
            return int(json.loads(self.progress.read_text())["step"])
        except (OSError, ValueError, KeyError):
            return 0

    def stop_at(self) -> int | None:
        """The step every host stops at, once the launcher asked for a stop; else None."""
        try:
            return int(json.loads(self.stop.read_text())["at_step"])
        except (OSError, ValueError, KeyError):
            return None

    def request_stop(self, margin: int = 2) -> int:
        """Ask the generation's hosts to stop at ``margin`` steps past host 0's last one (hosts of a
        lock-step job are at most one step apart); returns that step."""
        at = self.step() + margin
        write_json(self.stop, {"at_step": at})
        return at


def prepare_job(config_json: str, run_dir: str | Path) -> None:
    """Write the job's config (``config.model_dump_json()``) for its hosts."""
    files = HostFiles(run_dir)
    files.root.mkdir(parents=True, exist_ok=True)
    (files.root / ".config.json.tmp").write_text(config_json)
    os.replace(files.root / ".config.json.tmp", files.config)


def write_plan(run_dir: str | Path, gen) -> HostFiles:
    """Write generation ``gen``'s plan (a ``training.dp.Generation``) for its hosts."""
    files = HostFiles(run_dir, gen.number)
    write_json(files.plan, {**asdict(gen), "spent": list(gen.spent)})
    return files


def free_port() -> int:
    """A TCP port free on this host now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """This host's address as the other hosts and gloo see it: what its host name resolves to."""
    return socket.gethostbyname(socket.gethostname())


def coordinator(files: HostFiles, rank: int, wait_s: float = COORDINATOR_WAIT_S) -> str:
    """Host 0: a free port on its address, written for the others; hosts 1..: that ``HOST:PORT``
    once written (``TimeoutError`` after ``wait_s`` seconds, or at once if the generation was aborted)."""
    if rank == 0:
        address = f"{host_address()}:{free_port()}"
        tmp = files.gen / ".coordinator.tmp"
        tmp.write_text(address)
        os.replace(tmp, files.coordinator)
        return address
    deadline = time.monotonic() + wait_s
    while not files.coordinator.exists():
        if files.abort.exists() or time.monotonic() > deadline:
            raise TimeoutError(f"host 0 of {files.gen} gave no coordinator address within {wait_s:g} s")
        time.sleep(0.05)
    return files.coordinator.read_text().strip()


def host_main(argv: list[str] | None = None) -> int:
    """One host of the DP job (the module docstring); returns the process's exit code."""
    ap = argparse.ArgumentParser(prog="python -m training.dp_job", description="one host of a DP job")
    ap.add_argument("run_dir")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--generation", type=int, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stop comes as a step to stop at (HostFiles.stop)
    files = HostFiles(args.run_dir, args.generation)
    from configs.load import stored_config

    cfg = stored_config(json.loads(files.config.read_text()))
    address = coordinator(files, args.rank)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # (CPU only; GPUs use NCCL)
    jax.distributed.initialize(
        address, num_processes=cfg.dp.hosts, process_id=args.rank, initialization_timeout=int(COORDINATOR_WAIT_S)
    )
    from diloco.faults import InjectedFailure
    from run.clock import EpochClock
    from training.dp import DPHost, Generation, run_host, write_progress

    plan = json.loads(files.plan.read_text())
    gen = Generation(**{**plan, "spent": tuple(plan["spent"])})
    clock = EpochClock(gen.origin)
    on_step = (lambda step, _m: write_progress(files.progress, step, clock())) if args.rank == 0 else None
    host = DPHost(cfg, args.run_dir, clock, args.rank, on_step=on_step)

    def stop(step: int) -> bool:
        at = files.stop_at() if files.stop.exists() else None
        return at is not None and step >= at

    try:
        summary = run_host(host, gen, stop, note=lambda record: write_json(files.failed(args.rank), record))
    except InjectedFailure as exc:
        print(f"dp host {args.rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(INJECTED_EXIT)  # as a dead host: no shutdown barrier with the others
    finally:
        host.close()
    if summary is not None:
        write_json(files.summary, summary)
    jax.distributed.shutdown()
    return 0


def run_agent(run_dir: str | Path, rank: int, generation: int, poll_s: float = 0.1) -> dict:
    """Start host ``rank`` of ``generation`` as a process of this machine (in its datacenter under
    ``network.emulate``: ``RUN/pretrain/dp/network/datacenters.json``) and wait for it, SIGKILLing it
    when the launcher aborts the generation. Returns ``{"rank", "returncode" (None: aborted before it
    ended), "failure" (its scheduled failure's note, or None), "summary" (host 0's, when it
    finished)}``; never raises for the host's own end (the launcher decides)."""
    files = HostFiles(run_dir, generation)
    out: dict = {"rank": rank, "returncode": None, "failure": None, "summary": None}
    if files.abort.exists():  # an engine re-ran this agent after the generation ended
        return out
    dcs = NetworkFolder(RunLayout(run_dir).network("pretrain", "dp")).datacenters
    wrap = None
    if dcs.exists():
        from run.netem import Datacenters

        wrap = functools.partial(Datacenters.load(dcs).wrap, rank)
    args = [Path(run_dir).absolute(), "--rank", rank, "--generation", generation]
    argv = python_module("training.dp_job", args, wrap)
    out["returncode"] = run_watched(argv, files.log(rank), files.abort.exists, poll_s)
    if files.failed(rank).exists():
        out["failure"] = json.loads(files.failed(rank).read_text())
    if rank == 0 and out["returncode"] == 0 and files.summary.exists():
        out["summary"] = json.loads(files.summary.read_text())
    return out


if __name__ == "__main__":
    sys.exit(host_main())
