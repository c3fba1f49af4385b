"""The tune flow: one Optuna study per method, the same trials and budget each, then the tuned comparison.

A study folder (``<study_root>/<name>``) is laid out as :class:`run.layout.StudyLayout` says (``optuna.log``:
Optuna's journal storage of every study: ``dp``, and ``diloco`` or ``diloco-<variant>`` per variant).
A trial is a pipeline run through the sweep's cell task (:func:`flows.sweep.sweep_cell`, holding a slot
of the limit ``tune-<name>``: ``concurrency`` trials at once), scored by its method's loss on the whole
validation split: selection never reads the test split, which only the tuned comparison reports. Each
study gets ``trials`` completed trials from a TPE sampler of the same seed; a failed trial is recorded
as failed and another is asked, at most ``trials`` more.

**Resuming**: running the study again (same name) loads the studies from ``optuna.log``; trials a
stopped study left running are marked failed and their settings asked again first, and the tuned
comparison is skipped when ``tuned/`` holds a completed run of the same config (else moved to
``attempts/``). A study folder of another spec is refused (:func:`flows.preflight.tune_preflight`).
"""

# No `from __future__ import annotations`: Prefect validates flow parameters from the annotations
# (see flows/pipeline.py).

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect.states import Cancelled, Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from configs.specs import load_spec
from configs.tune import TuneSpec
from flows import run_logger
from flows.naming import tune_run_name
from flows.preflight import missing_results, tune_preflight
from flows.slots import set_concurrency_limit
from flows.sweep import sweep_cell
from run import atomic
from run.control import graceful_stop, stop_requested
from run.directory import read_status
from run.layout import RunLayout, StudyLayout

__all__ = ["tune", "trial_value"]


def _distribution(r):
    if r.choices is not None:
        return CategoricalDistribution(r.choices)
    if r.is_int:
        return IntDistribution(int(r.low), int(r.high), log=r.log, step=int(r.step or 1))
    return FloatDistribution(r.low, r.high, log=r.log, step=r.step)


def trial_value(run_dir: Path, method: str) -> float | None:
    """The trial's objective: its method's loss on the whole validation split (nats per token or
    image; ``heldout.val.loss`` of ``pretrain/<method>/summary.json``), None when it has none."""
    try:
        summary = json.loads(RunLayout(run_dir).summary("pretrain", method).read_text())
    except (OSError, ValueError):
        return None
    v = ((summary.get("heldout") or {}).get("val") or {}).get("loss")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _record(spec: TuneSpec, study_dir: Path, studies: dict, tuned: dict | None = None) -> dict:
    """Write ``tune.json``: the spec, per study its trials and best, and ``tuned`` (an earlier attempt's if None)."""
    record = StudyLayout(study_dir).record
    if tuned is None and record.is_file():  # an earlier attempt's tuned comparison, kept
        tuned = json.loads(record.read_text()).get("tuned")
    out: dict[str, Any] = {"spec": spec.model_dump(mode="json"), "methods": {}, "tuned": tuned}
    for m, study in studies.items():  # m: the study's name
        trials = [
            {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params}
            | {k: t.user_attrs.get(k) for k in ("run_dir", "reason")}
            for t in study.trials
        ]
        done = [t for t in study.trials if t.state == TrialState.COMPLETE]
        best = min(done, key=lambda t: t.value) if done else None
        best = {"number": best.number, "value": best.value, "params": best.params} if best else None
        out["methods"][m] = {"trials": trials, "completed": len(done), "best": best}
    atomic.write_json(record, out, newline=True, default=None)
    return out


@task(name="tune-report", cache_policy=NO_CACHE)
def tune_report(record: dict, study_dir: str) -> str:
    """``report/study.md``, ``study.json`` and ``study_history.png`` (:func:`reports.study.build_study_report`)."""
    from reports.study import build_study_report

    return build_study_report(record, Path(study_dir))


def _enqueue_once(study, params: dict) -> bool:
    """Enqueue a trial of ``params`` unless one is completed or waiting with them; True when enqueued."""
    planned = [
        t.system_attrs.get("fixed_params", t.params)
        for t in study.trials
        if t.state in (TrialState.COMPLETE, TrialState.WAITING)
    ]
    if params in planned:
        return False
    study.enqueue_trial(params)  # the shipped settings first: tuning never ends worse than them
    return True


def _cell(name: str, cfg, rd: Path, limit: str, dp_cache: str | None = None) -> dict:
    """:func:`flows.sweep.sweep_cell`'s parameters for a pipeline run of ``cfg`` in ``rd``, in this process."""
    parameters = {"name": name, "config": cfg, "run_dir": str(rd), "launch": "subflow", "limit": limit}
    return parameters | {"deployment": "pipeline/default", "dp_cache": dp_cache}


def _run_trials(
    spec: TuneSpec, study_dir: Path, raw: dict, arm: tuple[str, str, dict], study, limit: str, logger
) -> None:
    """Ask, run and tell trials of one study until ``trials`` completed (at most ``trials`` failures more)."""
    name, method, variant = arm
    for t in study.trials:  # left running by a stopped study: failed, and its settings asked again first
        if t.state == TrialState.RUNNING:
            study.tell(t.number, state=TrialState.FAIL)
            study.enqueue_trial(t.params)
            logger.info(
                "%s trial %d: left running by an earlier attempt; marked failed, its settings tried again",
                name,
                t.number,
            )
    if spec.from_base and (base := spec.base_params(method, raw, variant)) is not None and _enqueue_once(study, base):
        logger.info("%s: the base config's settings %s are tried first", name, base)
    dists = {key: _distribution(r) for key, r in spec.space[method].items()}
    failed = 0
    while not stop_requested():
        done = sum(t.state == TrialState.COMPLETE for t in study.trials)
        if done >= spec.trials or failed > spec.trials:
            break
        batch = [study.ask(dists) for _ in range(min(spec.concurrency, spec.trials - done))]
        with ThreadPoolTaskRunner(max_workers=spec.concurrency) as runner:
            futures = []
            for trial in batch:
                rd = StudyLayout(study_dir).trial(name, trial.number)
                trial.set_user_attr("run_dir", str(rd))
                value = spec.trial_config(method, trial.params, raw, variant)
                cfg = load_spec("config", value=value, where=f"study {spec.name}, {name} trial")
                logger.info("%s trial %d: %s", name, trial.number, trial.params)
                futures.append((trial, rd, runner.submit(sweep_cell, _cell(f"{name}-{trial.number}", cfg, rd, limit))))
            wait([f for _, _, f in futures])
        for trial, rd, _future in futures:
            value = trial_value(rd, method) if read_status(rd).get("status") == "completed" else None
            if value is None:
                if stop_requested():
                    break  # left running: the next attempt marks it failed
                trial.set_user_attr("reason", read_status(rd).get("reason") or "no validation loss")
                study.tell(trial, state=TrialState.FAIL)
                failed += 1
            else:
                study.tell(trial, value)
                logger.info("%s trial %d: validation loss %.4f", name, trial.number, value)


def _tuned_comparison(
    spec: TuneSpec, study_dir: Path, raw: dict, best: dict, arm: tuple[str, str, dict], limit: str, logger
) -> dict:
    """The tuned comparison of one DiLoCo study against the tuned DP over ``seeds``, in ``tuned/<study>/``."""
    name, _, variant = arm
    value = spec.final_config(best["dp"], best[name], raw, variant, name)
    cfg = load_spec("config", value=value, where=f"study {spec.name}, the tuned comparison of {name}")
    layout = StudyLayout(study_dir)
    rd = layout.tuned(name)
    if rd.exists():
        config = RunLayout(rd).config
        old = json.loads(config.read_text()) if config.is_file() else None
        if (
            read_status(rd).get("status") == "completed"
            and old == cfg.model_dump(mode="json")
            and not missing_results(rd, cfg.pretrain_methods, cfg.run_seeds)
        ):
            logger.info("tuned comparison %s: completed before in %s", name, rd)
            return {"run_dir": str(rd), "status": "completed", "skipped": True}
        n = next(n for n in itertools.count(1) if not layout.attempt(name, n).exists())
        layout.attempt(name, n).parent.mkdir(exist_ok=True)
        shutil.move(str(rd), layout.attempt(name, n))
        logger.info("tuned comparison %s: an earlier attempt moved to attempts/tuned-%s-%d", name, name, n)
    logger.info("tuned comparison %s: seeds %s with %s and %s", name, spec.seeds, best["dp"], best[name])
    out = sweep_cell.submit(**_cell(f"tuned-{name}", cfg, rd, limit, str(layout.dp_cache))).result()
    return {"run_dir": str(rd), **out}


@flow(name="tune", flow_run_name=tune_run_name, log_prints=True)
def tune(spec: TuneSpec = load_spec("study", "tune_tiny"), study_file: str | None = None) -> str | State:
    """Tune DP and DiLoCo with the same trials and budget each, then run their best settings over ``seeds``.

    Args:
        spec: the study, field by field (the UI form; :class:`configs.tune.TuneSpec`).
        study_file: instead of ``spec``: a shipped study's name (``configs/studies/<name>.yaml``) or a YAML path.

    Returns the study folder (its report is ``report/study.md``). Raises ``ValueError`` /
    ``FileNotFoundError`` from the checks, before anything is written. Ends ``Cancelled`` after a
    stop signal (run it again to resume) and ``Failed`` when a method has no completed trial or
    the tuned comparison did not complete.
    """
    logger = run_logger()
    spec = load_spec("study", study_file, value=spec)
    plan = tune_preflight(spec)
    study_dir, raw = plan.study_dir, plan.base
    if stop_requested():
        return Cancelled(message="stopped before the study started; nothing was written")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with graceful_stop():
        study_dir.mkdir(parents=True, exist_ok=True)
        storage = JournalStorage(JournalFileBackend(str(StudyLayout(study_dir).journal)))
        arms = spec.arms()
        kw = {"storage": storage, "direction": "minimize", "load_if_exists": True}
        studies = {a[0]: optuna.create_study(study_name=a[0], **kw) for a in arms}
        for study in studies.values():  # a resumed study's sampler continues from another seed: no repeated draws
            study.sampler = optuna.samplers.TPESampler(seed=spec.sampler_seed + len(study.trials))
        _record(spec, study_dir, studies)
        limit = f"tune-{spec.name}"
        set_concurrency_limit(limit, spec.concurrency)
        at_once = f"{spec.trials} trials each, {spec.concurrency} at once"
        logger.info(f"study {spec.name} in {study_dir}: studies {', '.join(studies)}, {at_once}")
        for arm in arms:
            _run_trials(spec, study_dir, raw, arm, studies[arm[0]], limit, logger)
            record = _record(spec, study_dir, studies)
        best = {a: (record["methods"][a]["best"] or {}).get("params") for a in studies}
        missing = [a for a in studies if best[a] is None]
        tuned: dict = dict(record.get("tuned") or {})
        for arm in arms[1:]:
            if spec.compare and best["dp"] is not None and best[arm[0]] is not None and not stop_requested():
                tuned[arm[0]] = _tuned_comparison(spec, study_dir, raw, best, arm, limit, logger)
                record = _record(spec, study_dir, studies, tuned)
        report = tune_report(record, str(study_dir))
    logger.info("study report: %s", report)
    if stop_requested():
        return Cancelled(message=f"stopped; run the study again to resume ({study_dir})")
    if missing:
        see = StudyLayout(study_dir).record
        return Failed(message=f"study {spec.name}: no completed trial of {', '.join(missing)} (see {see})")
    bad = [a for a, t in tuned.items() if spec.compare and t.get("status") != "completed"]
    if bad:
        return Failed(
            message=f"study {spec.name}: the tuned comparison of {', '.join(bad)} did not complete "
            f"({tuned[bad[0]].get('reason')}); run the study again to retry it"
        )
    return str(study_dir)
