"""Pretraining flows: Decoupled DiLoCo (syncer + M learner tasks, concurrently) and the DP baseline.

Each takes the experiment config and a run directory that already holds the sharded data
(``flows.pipeline`` makes one), so either can be re-run alone from the Prefect UI.
"""

# No `from __future__ import annotations`: Prefect validates flow parameters from the annotations
# (see flows/pipeline.py).

import shutil
import time
from contextlib import closing
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.futures import wait
from prefect.states import Failed

from configs.schema import ExperimentConfig
from flows.datacenters import emulated
from flows.dp_hosts import launcher
from flows.engines import engine_session, task_options, task_runner_for
from flows.naming import pretrain_run_name
from reports.artifacts import artifact_key, run_slug
from reports.read import read_schedule
from reports.resilience import diloco_resilience
from run.atomic import write_json
from run.clock import EpochClock
from run.control import STOP, graceful_stop
from run.layout import RunLayout
from run.metrics import JsonlWriter, read_jsonl
from run.progress import Progress, report as report_progress
from run.records import StateEvent
from run.tracking import NO_TRACKING, PROGRESS_KEY, Tracker
from tasks.pretrain import dp_progress, dp_task, learner_task, retry_syncer, syncer_task
from training.common import budget_status, ensure_fresh, save_chaos_schedule
from training.decoupled.monitor import learners_gone, live_view
from training.decoupled.setup import host_turns_dir, prepare_diloco, warm_compilation_cache, with_absolute_exchange
from training.dp import run_job
from training.dp_job import prepare_job
from training.tracking import method_tracker


def _progress_line(exchange, eval_path: Path, budget: int, u: str, m: int) -> str:
    """The log's progress line (``budget`` in unit ``u``, ``m`` learners), also sent to ``run.progress``."""
    info = exchange.learners()
    up = sum(1 for v in info.values() if v.get("status") == "running")
    losses = [v["loss"] for v in info.values() if "loss" in v]
    loss = sum(losses) / len(losses) if losses else None
    evals, tokens, versions = read_jsonl(eval_path), exchange.claimed_tokens, exchange.versions()
    val = evals[-1]["val/loss"] if evals else None
    report_progress(
        Progress("diloco", int(tokens), int(budget), u, train_loss=loss, heldout_loss=val, learners=(up, m))
    )
    text = {k: "n/a" if v is None else f"{v:.3f}" for k, v in (("loss", loss), ("val", val))}
    return (
        f"diloco: {u} {tokens:,}/{budget:,} ({100 * tokens / budget:.0f}%)  train loss {text['loss']}  "
        f"held-out loss {text['val']}  merges {sum(versions)}  learners up {up}/{m}  versions {versions}"
    )


def _publish_live_view(config: ExperimentConfig, exchange, rd: Path, tracker: Tracker = NO_TRACKING) -> None:
    """The ``diloco-learners-<run>`` table artifact (with goodput and uptime so far), also to ``tracker``."""
    rows, t = live_view(config, exchange, rd)
    layout, goodput, so_far = RunLayout(rd), None, ""
    try:
        logs = [read_jsonl(layout.metrics("pretrain", "diloco", name)) for name in ("learners", "merges")]
        res = diloco_resilience(*logs, read_schedule(layout.chaos_schedule), now=exchange.clock())
    except (ValueError, KeyError, OSError):  # a line half-written at this instant: the next view has it
        res = None
    if res is not None:
        goodput, uptime = res["global"]["goodput"], res["uptime"]["uptime"] or 0.0
        per = {r["learner"]: r.get("goodput") for r in res["learners"]}
        for row in rows:
            row["goodput so far (%)"] = None if per.get(row["learner"]) is None else round(100 * per[row["learner"]], 1)
    live = {"learners/alive": float(t["alive"])}
    if goodput is not None:
        live |= {"resilience/goodput": float(goodput), "resilience/uptime": float(uptime)}
        so_far = f" Goodput so far {100 * goodput:.1f} %, uptime {100 * uptime:.1f} % "
        so_far += "(a learner computing and the syncer up)."
    tracker.scalars(PROGRESS_KEY, int(t["tokens claimed"]), live)
    create_table_artifact(
        key=artifact_key("diloco-learners", run_slug(rd)),
        table=rows,
        description=(
            f"**DiLoCo, live**: {t['alive']}/{t['learners']} learners alive; {t['merges']} merges, "
            f"versions {t['versions']}; {t['tokens claimed']:,} {config.unit} claimed, {t['tokens merged']:,} merged "
            f"into Θ; {t['bytes merged']:,} submission bytes merged. A learner is dead after "
            f"{config.diloco.heartbeat_timeout_s:g} s without a heartbeat (diloco.heartbeat_timeout_s) "
            "and left out of the quorum until it beats again." + so_far
        ),
    )


@flow(name="pretrain-diloco", flow_run_name=pretrain_run_name("diloco"), log_prints=True)
def pretrain_diloco(config: ExperimentConfig, run_dir: str, progress_every_s: float = 10.0) -> dict:
    """Decoupled DiLoCo: one syncer task and M learner tasks (retries) on the configured runner.

    A failed learner is retried by Prefect and rejoins from its resume point while the others and the
    syncer go on; with the fsspec exchange the syncer is retried too (``diloco.syncer_retries``) and
    resumes from its checkpoint and journal. Writes ``pretrain/diloco/``; returns the summary. When
    every learner ended before the budget was spent and no stop signal came, the stage ends ``Failed``
    (summary ``budget``: ``training.common.budget_status``); its summary and Θ are written all the same.
    """
    with graceful_stop(), emulated(config, Path(run_dir).absolute(), "diloco") as stage:
        return _pretrain_diloco(stage, Path(run_dir), progress_every_s)


def dropped_reasons(work_lost: dict) -> str:
    """The summary's ``work_lost.reasons`` in words, e.g. ``stale 12,288, quorum 4,096``, or ``no reason logged``."""
    return ", ".join(f"{r} {n:,}" for r, n in (work_lost.get("reasons") or {}).items()) or "no reason logged"


def _pretrain_diloco(config: ExperimentConfig, rd: Path, progress_every_s: float) -> dict:
    logger = get_run_logger()
    # paths made absolute here, once: worker processes may start in another folder
    config, rd = with_absolute_exchange(config), rd.absolute()
    exchange = prepare_diloco(config, rd)
    budget, d, rt, u = config.budget_tokens, config.diloco, config.runtime, config.unit
    logger.info(
        f"diloco: M={d.learners} learners, P={d.fragments} fragments, H={d.sync_every}, K={d.quorum}, "
        f"grace {d.grace_s:.2f}s, merge={d.merge}, budget {budget:,} {u} ({config.tokens_per_learner_step:,} "
        f"per learner step); engine {rt.engine}, exchange {rt.exchange_kind}"
        f"{f' at {exchange.url}' if rt.exchange_kind == 'fsspec' else ''}; precision: {config.precision.describe()}"
    )
    key = artifact_key("diloco-progress", run_slug(rd))
    progress_id = create_progress_artifact(0.0, key=key, description=f"DiLoCo {u} (%)")
    learner = learner_task.with_options(retries=d.learner_retries, retry_delay_seconds=d.retry_delay_s)
    # the syncer is retried only where it can resume (checkpoint + journal in the fsspec exchange)
    retries = d.syncer_retries if rt.exchange_kind == "fsspec" else 0
    syncer = syncer_task.with_options(
        retries=retries, retry_delay_seconds=d.retry_delay_s, retry_condition_fn=retry_syncer
    )
    eval_path = RunLayout(rd).metrics("pretrain", "diloco", "eval")
    with (
        engine_session(rt, config.engine_slots),
        task_runner_for(config) as runner,
        method_tracker(config, rd, "pretrain", "diloco") as tracker,
    ):

        def publish() -> None:  # the log's line, the progress artifact, the live view
            logger.info(_progress_line(exchange, eval_path, budget, u, d.learners))
            update_progress_artifact(progress_id, 100.0 * exchange.claimed_tokens / budget)
            _publish_live_view(config, exchange, rd, tracker)

        run = {"config": config, "run_dir": str(rd)}
        with task_options(config.runtime, config.diloco, "syncer"):
            syncer_future = runner.submit(syncer, run)
        with task_options(config.runtime, config.diloco, "learner"):
            futures = [runner.submit(learner, run | {"learner": m}) for m in range(d.learners)]
        t_submit = time.monotonic()
        if config.learner_processes:
            # while the worker processes import, compile their steps once into the run's cache
            warm_s = warm_compilation_cache(config, rd)
            if warm_s:
                logger.info("compiled the learner step and evaluation into the run's cache in %.1fs", warm_s)
        try:
            _wait_for_learners(config, exchange, futures, syncer_future, t_submit, progress_every_s, publish)
        finally:
            exchange.mark_learners_done()
            shutil.rmtree(host_turns_dir(rd), ignore_errors=True)  # this host's learner turns, if any
        for m, info in sorted(exchange.learners().items()):  # (Prefect's future states can lag behind)
            if info.get("status") != "done":
                why = f"{info.get('status')} after its retries ({info.get('reason', 'no reason recorded')})"
                logger.error(f"learner {m} ended {why}; the others spent its share of the budget")
        unreported = _unreported_failures(futures, exchange, rd)
        summary = syncer_future.result()
        exchange.refresh()
        _publish_live_view(config, exchange, rd, tracker)  # the final view: after the syncer's last merges
    learners = exchange.learners()
    finished = any(info.get("status") == "done" for info in learners.values())
    why = None if finished else learners_gone(learners, d.learners, unreported, d.learner_retries)
    interrupted = bool(summary["interrupted"])
    summary["budget"] = budget_status(summary["tokens"], budget, u, interrupted=interrupted, finished=finished, why=why)
    write_json(RunLayout(rd).summary("pretrain", "diloco"), summary)
    _log_diloco_end(logger, summary, budget, u)
    if summary["budget"]["status"] == "short":  # no learner left to train: the stage failed
        message = f"pretrain-diloco {summary['budget']['line']}"
        logger.error("%s; Θ as it stands is saved and the report can be built", message)
        return Failed(message=message)
    return summary


def _wait_for_learners(config: ExperimentConfig, exchange, futures, syncer_future, t_submit, every_s, publish) -> None:
    """Wait for the learners, passing on a stop signal and calling ``publish()`` every ``every_s`` s."""
    next_progress = time.monotonic() + every_s
    # a worker that cannot start the learner task may be re-run by a process engine for ever
    give_up_at = t_submit + max(config.runtime.start_wait_s, 60.0) + 120.0 if config.learner_processes else None
    while True:
        # short waits: a stop signal reaches learners in other processes within a second
        done = wait(futures, timeout=min(1.0, every_s))
        if STOP.is_set() and not exchange.stop_requested():
            exchange.request_stop()
        if not done.not_done or time.monotonic() >= next_progress:
            next_progress = time.monotonic() + every_s
            publish()
        if not done.not_done:
            break
        if give_up_at is not None and time.monotonic() > give_up_at:
            if not exchange.learners():
                exchange.request_stop()
                raise RuntimeError(
                    f"no learner reported to the exchange within {give_up_at - t_submit:.0f} s on runtime.engine "
                    f"{config.runtime.engine}: the worker processes could not start the learner task (see the "
                    "worker errors above: imports, packages, the run directory on every node)"
                )
            give_up_at = None
        if syncer_future.state.is_final():
            exchange.close()
            raise RuntimeError(f"the syncer ended while learners were running: {syncer_future.state}")


def _log_diloco_end(logger, summary: dict, budget: int, u: str) -> None:
    """Log the finished run, the work the syncer dropped and an early stop."""
    logger.info(
        f"diloco finished: {summary['tokens']:,} {u} in %.1f s (%.0f {u}/s), %d merges, held-out loss %.4f",
        *(summary[k] for k in ("wall_s", "tokens_per_s", "merges", "final_val_loss")),
    )
    lost = summary["work_lost"]
    if lost["status"] != "ok":
        logger.warning(
            f"diloco: the syncer dropped {100 * lost['dropped_fraction']:.1f} % of the learners' processed {u} "
            f"({lost['dropped_tokens']:,} of {lost['processed_tokens']:,}; {dropped_reasons(lost)})"
            + (" — above diloco.max_dropped_fraction: this run fails" if lost["status"] == "failed" else "")
        )
    if summary["interrupted"]:
        logger.warning(f"diloco: stopped early by a signal at {summary['tokens']:,} of {budget:,} {u}; state saved")


def _unreported_failures(futures, exchange, rd: Path) -> dict[int, str]:
    """Learner → state message of the tasks that failed before reporting, logged as failure and down events."""
    known = exchange.learners()
    out = {
        m: f.state.message or f.state.name
        for m, f in enumerate(futures)
        if m not in known and (f.state.is_failed() or f.state.is_crashed())
    }
    if out:
        with closing(JsonlWriter(RunLayout(rd).metrics("pretrain", "diloco", "learners"))) as events:
            for m, reason in out.items():
                t = exchange.clock()
                event = {"event": "failure", "learner": m, "attempt": 1, "reason": reason, "step": 0}
                events({**event, "t": t, "before_start": True, "source": "flow"})
                events(StateEvent(state="down", t=t, learner=m, attempt=1, reason=reason).line())
    return out


@flow(name="pretrain-dp", flow_run_name=pretrain_run_name("dp"), log_prints=True)
def pretrain_dp(config: ExperimentConfig, run_dir: str) -> dict:
    """The data-parallel baseline on the same data and budget: in this process, or ``dp.hosts`` > 1 host
    processes on ``runtime.engine`` (``flows.dp_hosts``). Ends ``Failed`` (its summary written) when the
    job stopped short of its budget without a stop signal (summary ``budget``)."""
    with graceful_stop(), emulated(config, Path(run_dir).absolute(), "dp") as stage:
        summary = dp_task(stage, run_dir) if stage.dp.hosts == 1 else _dp_hosts(stage, Path(run_dir).absolute())
    u, logger = config.unit, get_run_logger()
    logger.info(
        f"dp finished: {summary['tokens']:,} {u} in %.1f s (%.0f {u}/s), held-out loss %.4f",
        *(summary[k] for k in ("wall_s", "tokens_per_s", "final_val_loss")),
    )
    if summary["budget"]["status"] == "short":
        logger.error(message := f"pretrain-dp {summary['budget']['line']}")
        return Failed(message=message)
    return summary


def _dp_hosts(config: ExperimentConfig, rd: Path) -> dict:
    """The DP job as ``dp.hosts`` processes; writes and returns its summary."""
    ensure_fresh(rd, "pretrain", "dp")
    if config.chaos.against_dp:
        save_chaos_schedule(config.chaos_schedule(), rd)
    prepare_job(config.model_dump_json(), rd)
    origin = time.time()
    clock = EpochClock(origin)
    n, batch = config.dp.hosts, config.dp_batch_size
    get_run_logger().info(
        f"dp: {n} hosts on runtime.engine {config.runtime.engine}, {batch // n} rows each of a {batch}-row global batch"
    )
    with engine_session(config.runtime, config.engine_slots), task_runner_for(config) as runner:
        launch = launcher(config, rd, runner, clock, dp_progress(str(rd), config.name, config.unit))
        summary = run_job(config, rd, launch, clock, origin)
    write_json(RunLayout(rd).summary("pretrain", "dp"), summary)
    return summary
