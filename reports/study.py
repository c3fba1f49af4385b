"""The report of a tuning study (``flows.tune``): each method's best settings, every trial, and the
tuned comparison's verdict over seeds. Writes ``report/study.md``, ``study.json`` and
``study_history.png`` (validation loss of each trial and the best so far, per method)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from reports.common import md_table, short_label
from reports.markdown import render
from reports.plots import save_png
from run import atomic
from run.layout import RunLayout, StudyLayout


def trials_table(record: dict) -> pd.DataFrame:
    """Every trial of the study (``tune.json``'s record), one row each: ``method``, ``trial``,
    ``state`` (Optuna's: COMPLETE, RUNNING, ...), ``value`` (validation loss on the whole split,
    nats per token; None before it completed) and ``params`` (the searched settings)."""
    rows = [
        {"method": m, "trial": t["number"], "state": t["state"], "value": t["value"], "params": t["params"]}
        for m, r in record["methods"].items()
        for t in r["trials"]
    ]
    return pd.DataFrame(rows, columns=["method", "trial", "state", "value", "params"])


def history_figure(trials: pd.DataFrame):
    """Validation loss against trial number per method (:func:`trials_table`), with the best so far
    (matplotlib Figure), or None without a completed trial."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    done = trials[trials.state == "COMPLETE"]
    if done.empty:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for m, t in done.groupby("method", sort=False):
        line = ax.plot(t.trial, t.value, "o", alpha=0.6, label=f"{short_label(m)} trials")[0]
        ax.step(t.trial, t.value.cummin(), where="post", color=line.get_color(), label=f"{short_label(m)} best so far")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="trial", ylabel="validation loss (whole split)", title="Tuning: the same number of trials per method")
    ax.legend()
    return fig


def _trials_md(t: pd.DataFrame) -> str:
    """One method's trials as a markdown table: trial, state, validation loss, then each setting."""
    if t.empty:
        return "*no trials yet*"
    state = t.state.map(lambda x: "stopped (tried again on resume)" if x == "RUNNING" else x.lower())
    loss = t.value.map(lambda v: "—" if v is None or v != v else f"{v:.4f}")
    params = pd.DataFrame(list(t.params), index=t.index).map(lambda v: f"{v:.4g}" if isinstance(v, float) else str(v))
    shown = pd.concat([t.trial.rename("trial"), state, loss.rename("validation loss"), params], axis=1)
    return md_table(list(shown.columns), shown.values.tolist())


def build_study_report(record: dict, study_dir: Path) -> str:
    """Write the study's report from its ``tune.json`` record; returns the path of ``study.md``."""
    layout = StudyLayout(study_dir)
    out = layout.report
    out.mkdir(parents=True, exist_ok=True)
    tuned = record.get("tuned") or {}
    verdicts = {}
    for arm, t in tuned.items():
        path = RunLayout(t["run_dir"]).report_json if t.get("run_dir") else None
        verdicts[arm] = json.loads(path.read_text()).get("verdict") if path and path.is_file() else None
    trials = trials_table(record)
    fig = history_figure(trials)
    if fig is not None:
        save_png(fig, out / "study_history.png")
    text = render(
        "study.md.j2",
        record=record,
        verdicts=verdicts,
        study_dir=study_dir,
        history=fig is not None,
        trials_table=lambda m: _trials_md(trials[trials.method == m]),
    )
    atomic.write_json(layout.study_json, record, newline=True, default=None)
    atomic.write_text(layout.study_md, text)
    return str(layout.study_md)
