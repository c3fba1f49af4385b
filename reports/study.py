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


def history_figure(record: dict):
    """Validation loss against trial number per method, with the best so far (matplotlib Figure),
    or None without a completed trial."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    drawn = False
    for m, r in record["methods"].items():
        done = [(t["number"], t["value"]) for t in r["trials"] if t["state"] == "COMPLETE"]
        if not done:
            continue
        x, y = zip(*done)
        line = ax.plot(x, y, "o", alpha=0.6, label=f"{short_label(m)} trials")[0]
        best = pd.Series(y).cummin()
        ax.step(x, best, where="post", color=line.get_color(), label=f"{short_label(m)} best so far")
        drawn = True
    if not drawn:
        return None
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel("validation loss (whole split)")
    ax.set_title("Tuning: the same number of trials per method")
    ax.legend()
    return fig


def _trials_table(r: dict) -> str:
    rows = [
        {
            "trial": t["number"],
            "state": "stopped (tried again on resume)" if t["state"] == "RUNNING" else t["state"].lower(),
            "validation loss": "—" if t["value"] is None else f"{t['value']:.4f}",
            **{k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in t["params"].items()},
        }
        for t in r["trials"]
    ]
    return md_table(list(rows[0]), [list(r.values()) for r in rows]) if rows else "*no trials yet*"


def build_study_report(record: dict, study_dir: Path) -> str:
    """Write the study's report from its ``tune.json`` record; returns the path of ``study.md``."""
    out = StudyLayout(study_dir).report
    out.mkdir(parents=True, exist_ok=True)
    tuned = record.get("tuned") or {}
    verdicts = {}
    for arm, t in tuned.items():
        path = RunLayout(t["run_dir"]).report_json if t.get("run_dir") else None
        verdicts[arm] = json.loads(path.read_text()).get("verdict") if path and path.is_file() else None
    fig = history_figure(record)
    if fig is not None:
        save_png(fig, out / "study_history.png")
    text = render(
        "study.md.j2",
        record=record,
        verdicts=verdicts,
        study_dir=study_dir,
        history=fig is not None,
        trials_table=_trials_table,
    )
    atomic.write_json(out / "study.json", record, newline=True, default=None)
    atomic.write_text(out / "study.md", text)
    return str(out / "study.md")
