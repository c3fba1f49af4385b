"""The DP job of several hosts (``dp.hosts`` > 1) on ``runtime.engine``: an elastic launcher.

Each generation of the job is ``dp.hosts`` Prefect tasks (``tasks.pretrain.dp_host_task``) on the run's
task runner, each starting a host process (a JAX process joined to the others by ``jax.distributed``;
``training.dp_job``). When one host ends badly the SPMD job cannot go on: the launcher aborts the
generation (every other host is SIGKILLed) and ``training.dp.run_job`` starts the next one from the
last checkpoint. A stop signal becomes a step every host stops at. The failure's time is when the
launcher saw the host end (polled every 0.1 s) unless the host noted a scheduled failure itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger
from prefect.futures import wait

from configs.schema import ExperimentConfig
from flows.engines import task_options
from run.clock import TrainingClock
from run.control import STOP
from run.layout import RunLayout
from run.processes import exit_reason
from tasks.pretrain import dp_host_task
from training.dp import Generation, Outcome
from training.dp_job import HostFiles, write_plan


def launcher(config: ExperimentConfig, run_dir: Path, runner, clock: TrainingClock, progress=None, every_s=10.0):
    """``launch(generation) -> training.dp.Outcome`` for ``training.dp.run_job``: the generation's host
    tasks on ``runner``, aborted at the first host that ends badly; ``progress``
    (``tasks.pretrain.dp_progress``) gets host 0's newest evaluation every ``every_s`` s."""
    hosts = config.dp.hosts
    reported = [0]

    def report() -> None:
        rows, train = _rows(run_dir, "eval"), _rows(run_dir, "train")
        if progress is not None and rows and rows[-1]["tokens"] > reported[0]:
            r = rows[-1]
            reported[0] = r["tokens"]
            budget = config.dp_steps * config.tokens_per_dp_step
            progress(r["tokens"], budget, train[-1]["train/loss"] if train else float("nan"), r["val/loss"])

    def launch(gen: Generation) -> Outcome:
        files = write_plan(run_dir, gen)
        with task_options(config.runtime, config.diloco, "dp-host"):
            futures = [
                runner.submit(dp_host_task, {"run_dir": str(run_dir), "rank": r, "generation": gen.number})
                for r in range(hosts)
            ]
        failure, next_report = None, time.monotonic() + every_s
        while True:
            done = wait(futures, timeout=0.1)
            if STOP.is_set() and not files.stop.exists():
                files.request_stop()
            if failure is None:
                failure = _first_death([(r, f) for r, f in enumerate(futures) if f in done.done], files, clock)
                if failure is not None:
                    files.abort.touch()  # every other host is SIGKILLed by its agent
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + every_s
                report()
            if not done.not_done:
                break
        report()
        if failure is not None:
            msg = "dp: %s (%s steps done); every host of the job restarts from its last checkpoint"
            get_run_logger().warning(msg, failure.get("reason"), failure.get("step"))
            return Outcome(failure=failure)
        summary = _result(futures[0])["summary"]
        if summary is None:
            raise RuntimeError(f"DP host 0 ended without a summary: see {files.log(0)}")
        return Outcome(summary=summary)

    return launch


def _rows(run_dir: Path, name: str) -> list[dict]:
    """Host 0's ``name`` log so far (a line it is writing at this instant is left for the next look)."""
    try:
        text = Path(RunLayout(run_dir).metrics("pretrain", "dp", name)).read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip().endswith("}")]


def _result(future) -> dict:
    """An agent task's report, or (its worker died, the task failed) one that says so."""
    try:
        return future.result()
    except BaseException as exc:  # noqa: BLE001 - the agent's worker died, or the task failed
        return dict.fromkeys(("rank", "returncode", "failure", "summary")) | {"state": f"{type(exc).__name__}: {exc}"}


def _first_death(done: list, files: HostFiles, clock: TrainingClock) -> dict | None:
    """The failure record of the first host that ended badly among ``done`` (``(rank, future)``), or None."""
    bad = [o for rank, f in done if (o := {**_result(f), "rank": rank}).get("returncode") != 0 or "state" in o]
    if not bad:
        return None
    noted = [o["failure"] for o in bad if o.get("failure")]
    if noted:
        return noted[0]
    now, step = clock(), files.step()
    killed = [o for o in bad if (o.get("returncode") or 0) < 0]
    out = (killed or bad)[0]
    rc, rank = out.get("returncode"), out.get("rank")
    lost = f"its task ended {out.get('state', 'without a report')} (a lost worker or node)"
    why = exit_reason(rc, files.log(rank)) if rc is not None else lost
    record = {"host": rank, "replica": rank, "index": None, "step": step, "t": now, "restart_delay_s": 0.0}
    return record | {"reason": f"DP host {rank}: {why}"}
