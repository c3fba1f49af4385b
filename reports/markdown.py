"""``report.md`` from the dict :func:`reports.build_report` returns, through the jinja2 templates in
``reports/templates/``: every number printed is read from that dict, so ``report.md`` and ``report.json``
cannot disagree. This module holds the environment and the cell helpers the templates share (docs/report.md).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

from reports.analyses import COMPLETING_TEXT
from reports.common import (
    BASELINE,
    BYTES_CONVENTION,
    NOT_RUN,
    PAPER,
    STALE_DEFINITION,
    format_value,
    label,
    md_table,
    per_unit,
    short_label,
    with_ci,
)
from reports.verdict import verdict_table


def row_cell(row: dict, m: str) -> str:
    """One method's cell of a comparison row; eval rows add "± stderr" and "(chance c)"."""
    v = row.get(m)
    text = format_value(v, row["fmt"])
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        se = (row.get("stderr") or {}).get(m)
        if se is not None:
            text += " ± " + format_value(se, row["fmt"])
        if row.get("chance") is not None:
            text += f" (chance {row['chance']:.3g})"
    return text


def row_label(row: dict) -> str:
    """The row's label with its unit: "training tokens (tokens)"."""
    return row["label"] + (f" ({row['unit']})" if row["unit"] else "")


def bytes_or_missing(figures: dict, key: str) -> str:
    """A merge-log byte total, or "not recorded" when (some) merge records lack the field."""
    if figures.get(key) is not None:
        return format_value(figures[key], "bytes")
    n, of = figures.get(f"{key}_recorded", 0), figures.get("merge_records", 0)
    return "not recorded" + (f" (in {n} of {of} merge records)" if n else "")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def headlines(report: dict) -> list[str]:
    """The bold lines under the title: the pipeline's state, each method short of its budget (unless the
    pipeline's reason says so), each method's lost work."""
    pipeline = report.get("pipeline") or {}
    methods = [f for s in report["stages"].values() for f in s["methods"].values()]
    short = [
        b
        for f in methods
        if (b := f.get("budget")) and b.get("headline") and b["line"] not in (pipeline.get("reason") or "")
    ]
    found = [pipeline] + short + [f.get("work_lost") for f in methods]
    return [x["headline"] for x in found if x and x.get("headline")]


def side_by_side(st: dict, group: str, first: list[str], extra: str | None = None) -> tuple[list[str], list[list[str]]]:
    """A stage's comparison rows of ``group`` as (headers, rows): label, [``extra``,] one cell per method."""
    methods = list(st["methods"])
    rows = [
        [row_label(r)] + ([r[extra]] if extra else []) + [row_cell(r, m) for m in methods]
        for r in st["comparison"]
        if r["group"] == group
    ]
    return first + [label(m) for m in methods], rows


def trained_with(report: dict, key: str) -> str:
    """A hyperparameter (``backend``, ``precision``) of the methods: the one value, each method's, or ""."""
    seen = {
        m: f["hyperparameters"][key]
        for s in report["stages"].values()
        for m, f in s["methods"].items()
        if key in (f.get("hyperparameters") or {})
    }
    values = sorted(set(seen.values()))
    if len(values) <= 1:
        return values[0] if values else ""
    return "; ".join(f"{label(m)} {v}" for m, v in seen.items())


def _pct_ci(d: dict | None, key: str = "goodput") -> str:
    if not d or d.get(key) is None:
        return "—"
    ci = d.get(f"{key}_ci")
    return f"{100 * d[key]:.1f} %" + (f" ± {100 * ci:.1f}" if ci is not None and ci == ci else "")


def _ledger_cell(column: str, row: dict) -> str:
    v = row[column]
    if isinstance(v, dict):  # drop reasons
        return "; ".join(f"{k}: {format_value(x, 'int')}" for k, x in v.items()) or "—"
    return format_value(v, "int")


def _join_kv(kv: tuple, prefix: str = "", fmt: str = "") -> str:
    return f"{prefix}{kv[0]}: {format_value(kv[1], fmt) if fmt else kv[1]}"


class _Continued(jinja2.FileSystemLoader):
    """Template source with a line that ends in a backslash joined to the next (its indentation dropped)."""

    def get_source(self, environment, template):
        source, path, uptodate = super().get_source(environment, template)
        return re.sub(r"\\\n[ \t]*", "", source), path, uptodate


@cache
def environment() -> jinja2.Environment:
    """The report's jinja2 environment: ``reports/templates``, block lines trimmed, ``do``, the helpers."""
    env = jinja2.Environment(
        loader=_Continued(Path(__file__).with_name("templates")),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        extensions=["jinja2.ext.do"],
    )
    env.globals.update(
        BASELINE=BASELINE,
        BYTES_CONVENTION=BYTES_CONVENTION,
        NOT_RUN=NOT_RUN,
        PAPER=PAPER,
        PIPELINE_STATES={
            "completing": COMPLETING_TEXT,  # the run's last stage writes this report; "completed" follows
            "running": "running, or stopped without recording an end (a killed process): status.json says running",
        },
        COMPLETING_TEXT=COMPLETING_TEXT,
        STALE_DEFINITION=STALE_DEFINITION,
        bytes_or_missing=bytes_or_missing,
        fv=format_value,
        headlines=headlines,
        label=label,
        pct=_pct,
        pct_ci=_pct_ci,
        per_unit=per_unit,
        s=lambda x: format_value(x, "{:.2f}"),
        with_ci=with_ci,
        short=short_label,
        side_by_side=side_by_side,
        table=md_table,
        trained_with=trained_with,
        verdict_table=verdict_table,
    )
    env.filters.update(
        f=lambda x, fmt: fmt.format(x),
        completed=lambda mr: f"{short_label(mr[0])} {mr[1]['completed']}",
        join_kv=_join_kv,
        json=json.dumps,
        join_pct=lambda kv: f"{kv[0]} {_pct(kv[1])}",
        label=label,
        ledger_cell=_ledger_cell,
        seconds_of=lambda key, row: format_value(row[f"{key}_s"], "{:.2f}"),
        seed_value=lambda p: f"seed {p['seed']}: {format_value(p['value'], '{:.4f}')}",
        short=short_label,
        fv_of=lambda m, row: format_value(row[m]),
    )
    env.tests.update(
        in_any=lambda m, rows: any(m in r for r in rows),
        pulled_differs=lambda b: b.get("merged_in") is not None or b.get("published_out") is not None,
    )
    return env


def render(template: str, **context: Any) -> str:
    """One template of ``reports/templates`` rendered with ``context``."""
    return environment().get_template(template).render(**context)


def render_markdown(report: dict) -> str:
    """The ``report.md`` text for a report dict from ``build_report`` (pure): ``report.md.j2``."""
    return render("report.md.j2", report=report)
