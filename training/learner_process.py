"""A DiLoCo learner as a process of its own in an emulated datacenter (``network.emulate``).

The learner task (``tasks.pretrain.learner_task``, a thread of the flow's process) starts
``python -m training.learner_process RUN --learner M --attempt A`` in datacenter M's namespace
(:func:`learner_in_datacenter`) and waits for it: the process runs one attempt
(``training.decoupled.setup.learner_attempt``) against the run's exchange, the hub's S3 server, so that every
fragment, heartbeat and published Θ crosses its datacenter's link. A scheduled failure ends it with
exit code 3 and a SIGKILL kills it; either way the task raises and Prefect's retries
(``diloco.learner_retries``) start a new process, which resumes from the learner's resume point.

Files: ``RUN/pretrain/diloco/network/`` (``run.layout.NetworkFolder``): the stage's config, the
datacenters, and per attempt its summary and output.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from pathlib import Path

from run.atomic import write_json
from run.layout import NetworkFolder, RunLayout
from run.processes import INJECTED_EXIT, exit_reason, python_module, run_watched


def _folder(run_dir: str | Path) -> NetworkFolder:
    return NetworkFolder(RunLayout(run_dir).network("pretrain", "diloco"))


def learner_main(argv: list[str] | None = None) -> int:
    """One attempt of one learner (the module docstring); returns the process's exit code."""
    ap = argparse.ArgumentParser(prog="python -m training.learner_process", description="one DiLoCo learner attempt")
    ap.add_argument("run_dir")
    ap.add_argument("--learner", type=int, required=True)
    ap.add_argument("--attempt", type=int, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stop reaches the learner through the exchange
    from configs.load import stored_config
    from diloco.faults import InjectedFailure
    from training.decoupled.setup import learner_attempt

    folder = _folder(args.run_dir)
    cfg = stored_config(json.loads(folder.config.read_text()))
    try:
        out = learner_attempt(cfg, args.run_dir, args.learner, args.attempt)
    except InjectedFailure as exc:
        print(f"learner {args.learner}: {exc}", file=sys.stderr, flush=True)
        os._exit(INJECTED_EXIT)
    write_json(folder.attempt(args.learner, args.attempt, ".json"), out)
    return 0


def learner_in_datacenter(run_dir: str | Path, learner: int, attempt: int) -> dict:
    """Run attempt ``attempt`` of learner ``learner`` as a process in its datacenter and wait for it;
    returns its summary. Raises ``InjectedFailure`` (a scheduled failure) or ``RuntimeError`` (killed,
    crashed: the reason and its log), which the learner task's retries answer."""
    from diloco.faults import InjectedFailure
    from run.netem import Datacenters

    folder = _folder(run_dir)
    dcs = Datacenters.load(folder.datacenters)
    args = [Path(run_dir).absolute(), "--learner", learner, "--attempt", attempt]
    argv = python_module("training.learner_process", args, functools.partial(dcs.wrap, learner))
    log = folder.attempt(learner, attempt, ".log")
    code = run_watched(argv, log)
    if code == 0:
        return json.loads(folder.attempt(learner, attempt, ".json").read_text())
    why = f"learner {learner} (attempt {attempt}, datacenter {dcs.addresses[learner]}): {exit_reason(code, log)}"
    if code == INJECTED_EXIT:
        raise InjectedFailure(why)
    raise RuntimeError(why)


if __name__ == "__main__":
    sys.exit(learner_main())
