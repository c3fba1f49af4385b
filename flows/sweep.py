"""The sweep flow: one pipeline run per cell of a grid of overrides, then one report across cells.

Layout of a sweep folder (``<sweep_root>/<name>``, or ``<name>-<UTC time>`` with ``resume: false``)::

    sweep.json            the spec, and per cell: overrides, config digest, run directory, state
    cells/<cell>/         the cell's pipeline run directory (a whole run: data, pretrain, eval, report)
    attempts/<cell>-<n>/  an earlier attempt of a cell that did not complete, moved aside (kept)
    report/               comparison.md, comparison.json, comparison.csv and plots (reports.compare)

**How cells run** (``launch``):

* ``subflow`` (the default): each cell is a child flow run of the ``pipeline`` flow, called from a
  ``sweep-cell`` task of the sweep's own flow run, in the sweep's process. It needs no work pool or
  worker, so ``ddiloco sweep`` runs anywhere; the UI shows each cell as a flow run nested under
  its task, with the pipeline's learner and syncer tasks inside.
* ``deployment``: each cell is a run of a pipeline deployment (``run_deployment``, linked as a
  child run), executed by a worker of that deployment's pool in a process of its own: cells on
  several machines, or isolated from each other's crashes.

Either way at most ``concurrency`` cells run at once, taken in grid order by a Prefect
``ThreadPoolTaskRunner`` of that many threads, and each ``sweep-cell`` task holds a slot of the
Prefect global concurrency limit ``sweep-<name>`` (created, or updated to ``concurrency``, when the
sweep starts) while its cell runs, so sweeps of one name share the limit, wherever they run. A
slot whose holder died (a process killed, a machine gone) comes back well within a minute, on a
persistent server too: the holder renews its lease and a heartbeat record every few seconds, and
a cell waiting for a slot releases the leases whose heartbeat stopped (:mod:`flows.slots`).

**Resuming.** A cell is identified by its resolved config (:func:`configs.sweep.config_digest`);
the record is the cell's run directory itself, not a Prefect result cache: it sits beside the
results it vouches for, survives a new Prefect server or database, and cannot point at results
that were deleted. A cell whose run directory holds a ``completed`` run of the same config, with its results
(:func:`missing_results`), is not run again; one whose run stopped (failed, interrupted, or killed
while ``running``), or that says ``completed`` but lacks its report or a method's summary, is moved
aside to ``attempts/`` and run anew; one that completed with another config is refused before anything
starts (the sweep's spec changed under the same name).
"""

# No `from __future__ import annotations`: Prefect validates flow parameters from the annotations
# (see flows/pipeline.py).

import datetime as dt
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.states import Cancelled, Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from configs.load import config_path, read_config_file
from configs.schema import ExperimentConfig
from configs.sweep import Cell, SweepSpec, cell_config, config_digest, expand_cells, load_sweep, resolve_sweep
from flows import run_logger
from flows.naming import sweep_run_name
from flows.preflight import check_config
from flows.slots import set_concurrency_limit, slot
from reports.common import flatten
from run import atomic
from run.control import graceful_stop, stop_requested
from run.directory import check_run_dir, is_run, read_status
from run.layout import SWEEP_RECORD as SWEEP_JSON, RunLayout, SweepLayout

__all__ = ["sweep", "sweep_preflight", "SweepPlan", "PlannedCell", "limit_name"]


@dataclass
class PlannedCell:
    """A cell as the sweep will treat it: ``action`` is ``run`` (new), ``skip`` (completed with
    this config) or ``rerun`` (an earlier attempt that did not complete; ``previous`` its status)."""

    cell: Cell
    cfg: ExperimentConfig
    run_dir: Path
    digest: str
    action: str
    previous: str | None = None


@dataclass
class SweepPlan:
    spec: SweepSpec
    sweep_dir: Path
    cells: list[PlannedCell]

    def record(self, results: dict[str, dict] | None = None) -> dict:
        """What ``sweep.json`` holds: the spec and one entry per cell."""
        results = results or {}
        return {
            "sweep": self.spec.model_dump(mode="json"),
            "sweep_dir": str(self.sweep_dir),
            "updated_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "cells": [
                {
                    "name": pc.cell.name,
                    "overrides": pc.cell.overrides,
                    "config_sha256": pc.digest,
                    "run_dir": str(pc.run_dir),
                    "action": pc.action,
                    "previous": pc.previous,
                    **results.get(pc.cell.name, {}),
                }
                for pc in self.cells
            ],
        }


def limit_name(spec: SweepSpec) -> str:
    """The Prefect global concurrency limit of a sweep: ``sweep-<name>``."""
    return f"sweep-{spec.name}"


def default_sweep_dir(spec: SweepSpec) -> Path:
    root = Path(spec.sweep_root).expanduser()
    if spec.resume:
        return (root / spec.name).absolute()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return (root / f"{spec.name}-{stamp}").absolute()


def _check_sweep_dir(path: Path) -> Path:
    if "://" in str(path):
        raise ValueError(f"sweep folder {path} is a URL; sweeps are written to a local folder: give a local path")
    path = Path(os.path.normpath(path.expanduser().absolute()))
    if path.exists() and not path.is_dir():
        raise ValueError(f"sweep folder {path} exists and is not a folder; choose another --sweep-dir")
    for above in [path, *path.parents]:
        if is_run(above):
            raise ValueError(f"sweep folder {path} is inside the run directory {above}; choose a path outside it")
    if path.is_dir() and any(path.iterdir()) and not SweepLayout(path).record.is_file():
        raise ValueError(
            f"sweep folder {path} is not empty and holds no {SWEEP_JSON} (not a sweep); choose a new "
            "--sweep-dir or sweep name"
        )
    return path


def _first_difference(old: dict, new: dict) -> str:
    """The first dotted config key whose value differs, with both values ('' if none)."""
    a, b = flatten(old, sep="."), flatten(new, sep=".")
    for key in list(a) + [k for k in b if k not in a]:
        if key not in a or key not in b:
            return key
        if a[key] != b[key]:
            return f"{key}: {a[key]!r} there, {b[key]!r} now"
    return ""


def missing_results(run_dir: Path, cfg: ExperimentConfig) -> list[str]:
    """What a completed pipeline run of ``cfg`` must hold in ``run_dir`` but does not, as paths
    relative to it (empty: all there): the report's ``report/report.json`` and each pretraining
    method's ``pretrain/<method>/summary.json`` (DiLoCo when ``diloco.enabled``, DP when ``dp.enabled``). Paths from
    :class:`run.layout.RunLayout`."""
    layout = RunLayout(run_dir)
    needed = [layout.report_json]
    seeds = cfg.run_seeds
    for sub in [layout] if len(seeds) == 1 else [RunLayout(layout.seed_run(s)) for s in seeds]:
        needed += [
            sub.summary("pretrain", m)
            for m in (["diloco"] if cfg.diloco.enabled else []) + (["dp"] if cfg.dp.enabled else [])
        ]
    return [p.relative_to(layout.root).as_posix() for p in needed if not p.is_file()]


def sweep_preflight(spec: SweepSpec, sweep_dir: str | Path | None = None) -> SweepPlan:
    """Every check of a sweep before anything is written: the sweep folder, each cell's config
    (schema, model, corpus: :func:`flows.preflight.check_config`; the corpus once per distinct data
    section) and each cell's run directory (new, completed with the same config, or an attempt to
    redo). Writes nothing.

    Raises ``ValueError``/``FileNotFoundError``/``ConnectionError`` in one line naming the sweep,
    the cell and the field (or the folder) and the fix.
    """
    path = _check_sweep_dir(Path(sweep_dir) if sweep_dir else default_sweep_dir(spec))
    try:
        base_raw = read_config_file(config_path(spec.base))
    except (FileNotFoundError, ValueError) as exc:
        raise type(exc)(f"sweep {spec.name}, base: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(
            f"sweep {spec.name}, base: {spec.base} is not valid YAML: {' '.join(str(exc).split())}"
        ) from None
    cells = expand_cells(spec)
    planned: list[PlannedCell] = []
    checked_data: set[str] = set()
    for cell in cells:
        cfg = cell_config(spec, cell, base_raw)
        data_key = json.dumps(cfg.data.model_dump(mode="json"), sort_keys=True)
        try:
            check_config(cfg, check_data=data_key not in checked_data)
        except (ValueError, FileNotFoundError, ConnectionError, OSError) as exc:
            raise type(exc)(f"sweep {spec.name}, cell {cell.name}: {exc}") from None
        checked_data.add(data_key)
        run_dir = SweepLayout(path).cell(cell.name)
        digest = config_digest(cfg)
        status = read_status(run_dir).get("status") if run_dir.exists() else None
        if not run_dir.exists():
            check_run_dir(run_dir)
            planned.append(PlannedCell(cell, cfg, run_dir, digest, "run"))
        elif status == "completed":
            try:
                old = json.loads(RunLayout(run_dir).config.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                old = None
            new = cfg.model_dump(mode="json")
            if old != new:
                what = _first_difference(old, new) if isinstance(old, dict) else "config.json is missing or unreadable"
                raise ValueError(
                    f"sweep {spec.name}, cell {cell.name}: {run_dir} holds a completed run of another config ({what}); "
                    "give the sweep a new name or --sweep-dir, or delete that cell's folder to run it again"
                )
            missing = missing_results(run_dir, cfg)
            if missing:  # status.json vouches for results that are not there: run it again
                planned.append(
                    PlannedCell(
                        cell,
                        cfg,
                        run_dir,
                        digest,
                        "rerun",
                        f"completed without its results (missing {', '.join(missing)})",
                    )
                )
            else:
                planned.append(PlannedCell(cell, cfg, run_dir, digest, "skip", status))
        else:
            planned.append(PlannedCell(cell, cfg, run_dir, digest, "rerun", status or "no status"))
    return SweepPlan(spec, path, planned)


def _write_record(plan: SweepPlan, results: dict[str, dict]) -> None:
    atomic.write_json(SweepLayout(plan.sweep_dir).record, plan.record(results), newline=True, default=None)


def _move_aside(pc: PlannedCell, sweep_dir: Path) -> Path:
    attempts = SweepLayout(sweep_dir).attempts
    attempts.mkdir(parents=True, exist_ok=True)
    n = 1
    while (attempts / f"{pc.cell.name}-{n}").exists():
        n += 1
    target = attempts / f"{pc.cell.name}-{n}"
    shutil.move(str(pc.run_dir), str(target))
    return target


def check_deployment(spec: SweepSpec) -> str | None:
    """With ``launch: deployment``: the Prefect server answers and the pipeline deployment exists on
    it; raises ``ValueError`` in one line naming the server or ``deployment`` otherwise. Returns a
    warning when no worker polls the deployment's work pool (its cells would wait for one), else None."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(spec.deployment)
            pool = client.read_work_pool(dep.work_pool_name) if dep.work_pool_name else None
        except ObjectNotFound:
            raise ValueError(
                f"sweep {spec.name}: deployment: {spec.deployment} is not deployed on the Prefect server "
                f"{client.api_url}; deploy it (`prefect --no-prompt deploy --all`) and start a worker, "
                "or use launch: subflow"
            ) from None
        except Exception as exc:  # the server does not answer (connection refused, timeout, ...)
            raise ValueError(
                f"sweep {spec.name}: launch: deployment: the Prefect server {client.api_url} "
                f"(PREFECT_API_URL) does not answer ({type(exc).__name__}); start it or use launch: "
                "subflow"
            ) from None
    if pool is not None and str(getattr(pool.status, "value", pool.status)).upper() != "READY":
        return (
            f"no worker polls the work pool {pool.name} of {spec.deployment}: the cells wait until one starts "
            f"(`prefect worker start --pool {pool.name}`)"
        )
    return None


def _run_through_deployment(deployment: str, parameters: dict, poll_s: float = 2.0):
    """Start a run of ``deployment`` (a child of this task run) and wait for its final state; on a stop
    signal ask it to cancel and return. Returns (state, flow run id)."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    flow_run = run_deployment(deployment, parameters=parameters, timeout=0)
    with get_client(sync_client=True) as client:
        cancelled = False
        while True:
            run = client.read_flow_run(flow_run.id)
            if run.state is not None and run.state.is_final():
                return run.state, str(run.id)
            if stop_requested() and not cancelled:
                run_logger().warning("stop: cancelling the cell's flow run %s", run.name)
                client.set_flow_run_state(run.id, Cancelling(message="the sweep was stopped"), force=True)
                cancelled = True
            if cancelled and (run.state is None or not run.state.is_running()):
                return client.read_flow_run(run.id).state, str(run.id)  # never started: nothing to wait for
            time.sleep(poll_s)


@task(name="sweep-cell", cache_policy=NO_CACHE, task_run_name="cell {name}")
def sweep_cell(
    name: str,
    config: ExperimentConfig,
    run_dir: str,
    launch: str,
    deployment: str,
    limit: str,
    dp_cache: str | None = None,
) -> dict:
    """Run one cell's pipeline while holding a slot of the global concurrency limit ``limit``;
    ``dp_cache``: the sweep's shared DP results (the pipeline's ``dp_cache``: DP trained once per
    DP setting).

    Returns ``{"state": <Prefect state type>, "status": <the run's status.json status>, "reason",
    "wall_s" [s], "flow_run_id"}``; a cell that fails is recorded, not raised, so the other cells
    go on.
    """
    logger = run_logger()
    with slot(limit) as held:
        if not held:
            return {"state": "NOT_STARTED", "status": None, "reason": "the sweep was stopped first"}
        t0 = time.perf_counter()
        logger.info("cell %s: %s in %s", name, launch, run_dir)
        if launch == "deployment":
            state, run_id = _run_through_deployment(
                deployment, {"config": config.model_dump(mode="json"), "run_dir": run_dir, "dp_cache": dp_cache}
            )
        else:
            from flows.pipeline import pipeline

            state = pipeline(config=config, run_dir=run_dir, dp_cache=dp_cache, return_state=True)
            run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
        wall = time.perf_counter() - t0
    status = read_status(run_dir)
    out = {
        "state": state.type.value if state else "UNKNOWN",
        "status": status.get("status"),
        "reason": status.get("reason") or (state.message if state and not state.is_completed() else None),
        "wall_s": wall,
        "flow_run_id": run_id,
    }
    logger.info("cell %s: %s (%s) in %.0f s", name, out["status"], out["state"], wall)
    return out


@task(name="sweep-report", cache_policy=NO_CACHE)
def sweep_report(plan: SweepPlan, results: dict[str, dict]) -> dict:
    """The comparison across the cells that have a report (:func:`reports.compare.build_comparison`),
    written to ``<sweep>/report/`` and published as artifacts. Every planned cell is listed: one
    without a readable ``report/report.json`` (failed before its report, or damaged) is shown as
    "no results" with its status and a warning is logged; with no cell to compare nothing is written
    and ``{}`` is returned."""
    from reports.artifacts import publish_comparison_artifacts
    from reports.compare import _read_run, build_comparison
    from reports.read import ReportInputError

    have, none = [], []
    for pc in plan.cells:
        report = RunLayout(pc.run_dir).report_json
        why = None
        if not report.is_file():
            why = "no report/report.json"
        else:
            try:
                _read_run(pc.run_dir)
            except ReportInputError as exc:  # corrupt or of another schema: shown, not fatal to the others
                why = str(exc)
        if why is None:
            have.append(pc)
            continue
        status = read_status(pc.run_dir) if pc.run_dir.is_dir() else {}
        none.append(
            {
                "label": pc.cell.name,
                "run_dir": str(pc.run_dir),
                "status": status.get("status"),
                "reason": status.get("reason"),
                "why": why,
            }
        )
    log = run_logger()
    for n in none:
        log.warning(
            "sweep %s: cell %s has no results (%s); status %s",
            plan.spec.name,
            n["label"],
            n["why"],
            n["status"] or "no status.json",
        )
    if not have:
        log.warning("sweep %s: no cell has results; no comparison written", plan.spec.name)
        return {}
    axes = list(dict.fromkeys(k for pc in plan.cells for k in pc.cell.overrides))
    comparison = build_comparison(
        [pc.run_dir for pc in have],
        SweepLayout(plan.sweep_dir).report,
        axes=axes,
        labels=[pc.cell.name for pc in have],
        title=f"Sweep {plan.spec.name}",
        source=f"the sweep flow (`{SweepLayout(plan.sweep_dir).record}`)",
        no_results=none,
    )
    publish_comparison_artifacts(comparison, plan.spec.name)
    return comparison


def _default_spec() -> SweepSpec:
    return load_sweep("tiny_grid")


@flow(name="sweep", flow_run_name=sweep_run_name, log_prints=True)
def sweep(
    spec: SweepSpec = _default_spec(),
    sweep_file: str | None = None,
    sweep_dir: str | None = None,
) -> str | State:
    """Run every cell of a sweep through the pipeline, then build the sweep's comparison report.

    Args:
        spec: the sweep, field by field (the UI form): base config, shared overrides, grid and/or
            cells, concurrency, launch, sweep_root, resume (:class:`configs.sweep.SweepSpec`).
        sweep_file: instead of ``spec``: a shipped sweep's name (``configs/sweeps/<name>.yaml``) or
            the path of a sweep YAML file.
        sweep_dir: the sweep's folder (default ``<sweep_root>/<name>``, or ``<name>-<UTC time>``
            when ``resume`` is false); an existing sweep folder is resumed.

    Returns the sweep folder (its report is ``report/comparison.md``). Raises
    ``ValueError``/``FileNotFoundError``/``ConnectionError`` from the checks, before anything is
    written. Ends ``Failed`` when a cell failed (the other cells run, the report covers the cells
    that have one) and ``Cancelled`` after a stop signal.
    """
    logger = run_logger()
    spec = resolve_sweep(spec, sweep_file)
    plan = sweep_preflight(spec, sweep_dir)
    if spec.launch == "deployment":
        warning = check_deployment(spec)
        if warning:
            logger.warning(warning)
    if stop_requested():
        return Cancelled(message="stopped before the sweep started; nothing was written")
    todo = [pc for pc in plan.cells if pc.action != "skip"]
    logger.info(
        "sweep %s: %d cells (%d to run, %d completed before) in %s; at most %d at once (%s)",
        spec.name,
        len(plan.cells),
        len(todo),
        len(plan.cells) - len(todo),
        plan.sweep_dir,
        spec.concurrency,
        spec.launch,
    )
    results: dict[str, dict] = {}
    prior = _prior_results(plan.sweep_dir, logger)
    for pc in plan.cells:
        if pc.action == "skip":
            results[pc.cell.name] = {
                **prior.get(pc.cell.name, {}),
                "status": "completed",
                "state": "COMPLETED",
                "skipped": True,
            }
    with graceful_stop():
        plan.sweep_dir.mkdir(parents=True, exist_ok=True)
        for pc in todo:
            if pc.action == "rerun":
                moved = _move_aside(pc, plan.sweep_dir)
                logger.info("cell %s: the earlier attempt (%s) moved to %s", pc.cell.name, pc.previous, moved)
        _write_record(plan, results)
        limit = limit_name(spec)
        set_concurrency_limit(limit, spec.concurrency)
        progress = _Progress(spec, len(plan.cells), len(plan.cells) - len(todo))
        # `concurrency` threads take the cells in grid order; the global limit holds them to
        # `concurrency` at once across every sweep of this name
        with ThreadPoolTaskRunner(max_workers=spec.concurrency) as runner:
            futures = {
                runner.submit(
                    sweep_cell,
                    {
                        "name": pc.cell.name,
                        "config": pc.cfg,
                        "run_dir": str(pc.run_dir),
                        "launch": spec.launch,
                        "deployment": spec.deployment,
                        "limit": limit,
                        "dp_cache": str(SweepLayout(plan.sweep_dir).dp_cache) if spec.reuse_dp else None,
                    },
                ): pc.cell.name
                for pc in todo
            }
            for future in as_completed(list(futures)):
                name = futures[future]
                try:
                    results[name] = {**future.result(), "skipped": False}
                except Exception as exc:  # the cell's own failure is recorded; the others go on
                    results[name] = {
                        "state": "FAILED",
                        "reason": f"{type(exc).__name__}: {exc}",
                        "skipped": False,
                        "status": read_status(SweepLayout(plan.sweep_dir).cell(name)).get("status"),
                    }
                _write_record(plan, results)
                progress.advance()
        comparison = sweep_report(plan, results)
    report = SweepLayout(plan.sweep_dir).comparison_md
    failed = [n for n, r in results.items() if r.get("status") != "completed" and r.get("state") != "NOT_STARTED"]
    if comparison:
        logger.info("sweep report: %s", report)
    if stop_requested():
        return Cancelled(
            message=f"stopped: cells completed: {sum(r.get('status') == 'completed' for r in results.values())} "
            f"of {len(plan.cells)}; re-run the sweep to resume ({plan.sweep_dir})"
        )
    if failed:
        return Failed(
            message=f"{len(failed)} of {len(plan.cells)} cells did not complete: "
            + "; ".join(f"{n}: {results[n].get('reason') or results[n].get('status')}" for n in failed)
            + f" (report of the others: {report})"
        )
    return str(plan.sweep_dir)


class _Progress:
    """The sweep's live progress artifact (``sweep-progress-<name>``): the share of cells finished."""

    def __init__(self, spec: SweepSpec, total: int, done: int) -> None:
        from prefect.artifacts import create_progress_artifact

        from reports.artifacts import artifact_key

        self.total, self.done = total, done
        self.id = create_progress_artifact(
            self.percent,
            key=artifact_key("sweep-progress", spec.name),
            description=f"sweep {spec.name}: cells finished of {total}",
        )

    @property
    def percent(self) -> float:
        return 100.0 * self.done / max(self.total, 1)

    def advance(self) -> None:
        from prefect.artifacts import update_progress_artifact

        self.done += 1
        if self.id is not None:
            update_progress_artifact(self.id, self.percent)


def _prior_results(sweep_dir: Path, logger=None) -> dict[str, dict]:
    """The results recorded for each cell by an earlier run of the sweep (empty if none).

    A ``sweep.json`` that is not a sweep record (not UTF-8 JSON, or not an object whose ``cells``
    is a list of objects with a ``name``) is not overwritten silently: it is renamed
    ``sweep.json.corrupt-<UTC time>`` beside it and a warning naming both is logged (on
    ``logger``, default the run's or this module's); the sweep then starts a new record."""
    path = SweepLayout(sweep_dir).record
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        problem = None
    except (ValueError, UnicodeDecodeError):
        record, problem = None, "not valid JSON"
    if problem is None and not (
        isinstance(record, dict)
        and isinstance(record.get("cells"), list)
        and all(isinstance(c, dict) and "name" in c for c in record["cells"])
    ):
        problem = "no list of cells with names"
    if problem is not None:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
        kept = path.with_name(f"{SWEEP_JSON}.corrupt-{stamp}")
        n = 1
        while kept.exists():
            n += 1
            kept = path.with_name(f"{SWEEP_JSON}.corrupt-{stamp}-{n}")
        os.replace(path, kept)
        (logger or run_logger()).warning(
            "%s is not a sweep record (%s); kept as %s, and a new record is written", path, problem, kept.name
        )
        return {}
    return {c["name"]: {k: c[k] for k in ("wall_s", "flow_run_id") if k in c} for c in record["cells"]}
