"""A comparison across run directories: the table and plots of an experiment sweep.

:func:`build_comparison` reads each run's ``config.json``, ``status.json`` and ``report/report.json``
and writes ``comparison.md``, ``comparison.json``, ``comparison.csv`` and the plots into one folder.
What it reads, writes and returns, and the units: docs/report.md ("A comparison across runs").
"""

from __future__ import annotations

import datetime as _dt
import difflib
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from reports.common import (
    BASELINE,
    REPORT_JSON,
    flatten,
    human_bytes,
    json_safe,
    md_table,
    nested,
    ordered_methods,
    per_unit,
    short_label,
    unit_of,
)
from reports.markdown import render
from reports.plots import cycle_colors, finish_axes, new_figure, save_png, series_color
from reports.read import ReportInputError, read_json
from reports.table import runs_table, shown, wide
from run import atomic
from run.layout import RunLayout

SCHEMA = 1  # comparison.json layout
REPORT_SCHEMA = 3  # the report.json layout this module reads
COMPARISON_MD = "comparison.md"
COMPARISON_JSON = "comparison.json"
COMPARISON_CSV = "comparison.csv"
OUTPUTS = (COMPARISON_MD, COMPARISON_JSON, COMPARISON_CSV)
STAGE = "pretrain"
# Config keys that only name or place a run: never detected as axes (they may still be given).
IGNORED_KEYS = ("name", "run_root", "data.cache_dir")
COMPLETED = "completed"
MISSING = "—"
LINESTYLES = {"diloco": "-", "dp": "--"}
OTHER_LINESTYLES = (":", "-.")
FIGURE_PREFIXES = ("loss_vs_", "gap_vs_", "loss_per_run", "gap_per_run")
RUN_HINT = "give a run directory made by `ddiloco run` (it holds config.json, status.json and report/report.json)"


@dataclass
class _Run:
    label: str
    path: Path
    config: dict
    status: dict | None
    report: dict
    leaves: dict[str, Any]


# -- reading -------------------------------------------------------------------------------------


def _read_run(given: str | Path) -> tuple[Path, dict, dict | None, dict]:
    """(absolute path, config, status or None, report) of one run directory, else ReportInputError."""
    path = Path(os.path.abspath(Path(given).expanduser()))
    if not path.is_dir():
        raise ReportInputError(path, f"{'is not a directory' if path.exists() else 'does not exist'}; {RUN_HINT}")
    layout = RunLayout(path)
    if not layout.config.is_file():
        raise ReportInputError(path, f"is not a run directory (no config.json); {RUN_HINT}")
    config, report_path = read_json(layout.config), layout.report_json
    if not report_path.is_file():
        raise ReportInputError(path, f"has no report/{REPORT_JSON}; build it with `ddiloco report {path}`")
    report = read_json(report_path)
    if report.get("schema") != REPORT_SCHEMA:
        why = f"report schema {report.get('schema')!r}, a comparison reads schema {REPORT_SCHEMA}"
        raise ReportInputError(report_path, f"{why}; rebuild it with `ddiloco report {path}`")
    return path, config, read_json(layout.status), report


def _labels(paths: list[Path], labels: list[str] | None) -> list[str]:
    if labels is None:  # the folder names; the parent too where two runs share a folder name
        names = [p.name for p in paths]
        return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]
    labels = [str(x).strip() for x in labels]
    if len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} run directories; give one label per run")
    if any(not x for x in labels) or len(set(labels)) != len(labels):
        raise ValueError(f"labels must be non-empty and distinct, got {labels}")
    return labels


def _canon(v: Any) -> str:
    """A hashable text of a config value (lists and dicts as sorted JSON)."""
    return json.dumps(v, sort_keys=True, default=str)


def detect_axes(leaves: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(axes, partial keys): the dotted keys present in every run whose values differ (config-file
    order, :data:`IGNORED_KEYS` left out), and the keys present in some runs only (a config written
    by an older schema, or a field of another model family), which are not axes by themselves."""
    keys = [k for k in dict.fromkeys(k for lv in leaves for k in lv) if k not in IGNORED_KEYS]
    partial = [k for k in keys if any(k not in lv for lv in leaves)]
    return [k for k in keys if k not in partial and len({_canon(lv[k]) for lv in leaves}) > 1], partial


def _check_axes(axes: Iterable[str], leaves: list[dict[str, Any]]) -> list[str]:
    known = list(dict.fromkeys(k for lv in leaves for k in lv))
    out = list(dict.fromkeys(str(a).strip() for a in axes))
    for a in (a for a in out if a not in known):
        under = [k for k in known if k.startswith(a + ".")][:3]
        if under:
            raise ValueError(
                f"axis {a!r} is a config section, not a value; give one of its keys, e.g. {', '.join(under)}"
            )
        close = difflib.get_close_matches(a, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        key = "give a dotted key such as diloco.learners or train.token_budget"
        raise ValueError(f"axis {a!r} is not a key of the runs' config.json{hint}; {key}")
    return out


def _partial_summary(partial: list[str], runs: list[_Run]) -> list[str]:
    """Keys in only some runs (a section missing whole as ``section.*``), each with the runs lacking it."""
    groups: dict[tuple, list[str]] = {}  # the runs lacking the keys -> the keys
    for k in partial:
        lacking = tuple(r.label for r in runs if k not in r.leaves)
        top = k.split(".")[0]
        whole = "." in k and all(top not in r.config for r in runs if r.label in lacking)
        name = f"`{top}.*`" if whole else f"`{k}`"
        if name not in groups.setdefault(lacking, []):
            groups[lacking].append(name)
    return [f"{', '.join(keys)} (not in {', '.join(lacking)})" for lacking, keys in groups.items()]


# -- the table -----------------------------------------------------------------------------------


def _status_text(status: dict | None) -> str | None:
    return None if status is None else str(status.get("status") or "unknown")


# The table's columns after the run's: (group, figures of the runs-table, for the baseline too),
# each figure for each method; the figures in _REQUIRED get a column even where no run has a value.
_GROUPS = (
    ("loss", ("val_loss", "test_loss", "test_accuracy"), True),
    ("loss", ("loss_gap_pct", "loss_gap_pct_ci_low", "loss_gap_pct_ci_high", "seeds"), False),
    ("cost", ("wall_s", "tokens", "tokens_per_s", "goodput", "bytes_total"), True),
    ("post", ("post_score",), True),
    ("post", ("post_diff", "post_diff_ci_low", "post_diff_ci_high", "post_verdict"), False),
)
_REQUIRED = ("val_loss", "wall_s", "tokens", "tokens_per_s")
_KEYS = {"val_loss": "final_val_loss"}  # comparison.json/.csv keys that differ from the table's


def _key(m: str, figure: str) -> str:
    return f"{m}/{_KEYS.get(figure, figure)}"


def _rows(runs: list[_Run], axes: list[str]) -> tuple[list[dict], list[str]]:
    """One row per run (label, status, axes, unit, ``<method>/<figure>``, post task and metric, path); methods."""
    t = runs_table({r.label: r.report for r in runs})
    t = t[t.stage == STAGE]
    methods = ordered_methods(t.method)
    figures = [f for _, fs, _ in _GROUPS for f in fs]
    w = wide(t, figures, methods, [r.label for r in runs])
    rows = []
    for r, (_, values) in zip(runs, w.iterrows()):
        ft = r.report.get("finetune") or {}
        row = {"label": r.label, "status": _status_text(r.status)} | {a: r.leaves.get(a) for a in axes}
        row["unit"] = nested(r.report, ("stages", STAGE, "unit")) or unit_of(r.config)
        row |= {_key(*k.split("/")): v for k, v in values.items()}
        row |= {"post/task": nested(ft, ("task", "name")), "post/metric": ft.get("primary"), "run_dir": str(r.path)}
        rows.append(row)
    return rows, methods


def _col(key: str, header: str, group: str, fmt: str = "", unit: str = "") -> dict:
    return {"key": key, "header": header, "unit": unit, "fmt": fmt, "group": group}


def _columns(rows: list[dict], axes: list[str], methods: list[str]) -> list[dict]:
    """The table's columns (``key``, ``header``, ``unit``, ``fmt``, ``group``); optional ones where a run has one."""
    units = list(dict.fromkeys(r["unit"] for r in rows))
    unit, per = " or ".join(units), " or ".join(per_unit(u) for u in units)
    cols = [_col("label", "run", "run"), _col("status", "status", "run")]
    cols += [_col(a, a, "axis", "value") for a in axes] + [_col("unit", "unit", "run")]
    post = any(r.get("post/metric") is not None for r in rows)
    for group, figures, baseline in _GROUPS:
        if group == "post" and not post:
            continue
        if group == "post" and baseline:
            cols += [_col(f"post/{k}", k, "post") for k in ("task", "metric")]
        for m in [m for m in methods if baseline or m != BASELINE]:
            for f in figures:
                key, fig = _key(m, f), shown(f, m, per, unit)
                if f in _REQUIRED or any(r.get(key) is not None for r in rows):
                    cols.append(_col(key, fig.header, group, fig.fmt, fig.unit))
    cols.append(_col("run_dir", "path", "path"))
    return cols


# -- formatting ----------------------------------------------------------------------------------


def cell(v: Any, fmt: str = "") -> str:
    """A table cell as shown in comparison.md: None → "—", numbers by ``fmt``, lists/dicts as JSON."""
    if v is None:
        return MISSING
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if fmt == "bytes":
        return human_bytes(v) or f"{int(v):,} B"
    if fmt == "int":
        return f"{int(round(v)):,}"
    if fmt and fmt != "value":
        return fmt.format(v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def _md_cell(r: dict, c: dict) -> str:
    """A cell of comparison.md; a figure with ``<key>_ci_low``/``_high`` as "−0.1273 [−0.1663, −0.0862]"."""
    v, lo, hi = (r.get(c["key"] + suffix) for suffix in ("", "_ci_low", "_ci_high"))
    return cell(v, c["fmt"]) + (f" [{cell(lo, c['fmt'])}, {cell(hi, c['fmt'])}]" if None not in (v, lo, hi) else "")


def _md_table(cols: list[dict], rows: list[dict]) -> str:
    cols = [c for c in cols if not c["key"].endswith(("_ci_low", "_ci_high"))]  # shown beside their figure
    return md_table([c["header"] for c in cols], [[_md_cell(r, c) for c in cols] for r in rows])


# -- plots ---------------------------------------------------------------------------------------


def slug(text: str) -> str:
    """A file-name-safe form of an axis key (letters, digits, ``.``, ``_``, ``-``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "axis"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_axis(rows: list[dict], axes: list[str]) -> str | None:
    """The axis the plots use: the first with two or more distinct values for which some
    combination of the other axes' values holds runs at two of its values (else a line would join
    runs that differ in other keys too); None (bars per run) when there is none."""
    for a in axes:
        if len({_canon(r.get(a)) for r in rows}) < 2:
            continue
        others = [b for b in axes if b != a]
        groups: dict[str, set] = {}
        for r in rows:
            groups.setdefault(_canon([r.get(b) for b in others]), set()).add(_canon(r.get(a)))
        if any(len(v) >= 2 for v in groups.values()):
            return a
    return None


def _leaf(key: str, keys: list[str]) -> str:
    """The last part of a dotted key when no other key ends the same way, else the whole key."""
    short = key.rsplit(".", 1)[-1]
    return short if sum(k.rsplit(".", 1)[-1] == short for k in keys) == 1 else key


MARKERS = {"diloco": "o", "dp": "s"}  # a lone point still says its method


def _figures(rows: list[dict], axis: str | None, axes: list[str], methods: list[str], per: str) -> tuple:
    """(loss figure, gap figure or None) against ``axis`` (None: per run); figure text: docs/report.md."""
    others = [b for b in axes if b != axis] if axis else []
    pts = pd.DataFrame(
        [
            {"x": r.get(axis) if axis else r["label"], "method": m, "done": r.get("status") == COMPLETED}
            | {"combo": ", ".join(f"{_leaf(b, axes)}={cell(r.get(b))}" for b in others)}
            | {"loss": r.get(f"{m}/final_val_loss"), "gap": r.get(f"{m}/loss_gap_pct")}
            for r in rows
            for m in methods
        ]
    )
    numeric = axis is not None and all(_is_number(x) for x in pts.x)
    cats = list(dict.fromkeys(_canon(x) for x in pts.x))
    pts["pos"] = [float(x) if numeric else float(cats.index(_canon(x))) for x in pts.x]
    gaps = [m for m in methods if m != BASELINE]
    where, b = (f"vs {axis}" if axis else "per run"), short_label(BASELINE)
    gap = f"{short_label(gaps[0])} − {b} held-out loss gap (%)" if len(gaps) == 1 else f"Held-out loss gap to {b} (%)"
    loss = f"Held-out loss vs {axis}" if axis else "Final held-out loss per run"
    specs = [("loss", f"final held-out loss (nats/{per})", loss, methods, "{:.4f}")]
    specs += [("gap", f"loss gap to {b} (%)", f"{gap} {where}", gaps, "{:+.2f} %")] if gaps else []
    figs = []
    for what, ylabel, title, which, fmt in specs:
        d = pts[pts.method.isin(which) & pts[what].notna()].astype({what: float})
        if d.empty:
            figs.append(None)
            continue
        fig = new_figure(7.5 if axis else max(7.5, 1.0 + 1.1 * len(cats)), 4.6)
        ax = fig.add_subplot()
        _lines(ax, d, what, which, fmt, axis is not None)
        if numeric and min(pts.pos) > 0 and max(pts.pos) / min(pts.pos) >= 16:
            ax.set_xscale("log")
        ticks = sorted(set(pts.pos)) if numeric else range(len(cats))
        if len(ticks) <= 12 or not numeric:
            text = (
                [cell(int(v) if v.is_integer() else v) for v in ticks]
                if numeric
                else [cell(json.loads(c)) for c in cats]
            )
            ax.set_xticks(list(ticks), text, rotation=0 if axis or len(cats) <= 3 else 20, fontsize=8)
            ax.minorticks_off()
        if what == "gap":
            ax.axhline(0.0, color="0.5", lw=0.8)
        ax.margins(x=0.1, y=0.15)
        finish_axes(ax, axis or "run", ylabel, title)
        ax.legend(fontsize=8, title="hollow: run not completed" if (~d.done.astype(bool)).any() else None)
        figs.append(fig)
    return tuple(figs) if gaps else (figs[0], None)


def _lines(ax, d: pd.DataFrame, what: str, which: list[str], fmt: str, joined: bool) -> None:
    """Per combination and method of ``d``, the mean of ``what`` at each x (a line when ``joined``)."""
    combos = list(dict.fromkeys(d.combo))
    lowest = d.groupby("method")[what].mean().idxmin()
    unstyled = [x for x in which if x not in LINESTYLES]
    for (combo, m), g in d.groupby(["combo", "method"], sort=False):
        ci, mi = combos.index(combo), which.index(m)
        color = cycle_colors()[ci % 10] if len(combos) > 1 else series_color(m, mi)
        g = g.assign(pos=g.pos + (0 if joined else 0.15 * (mi - (len(which) - 1) / 2)))  # per run: side by side
        mean = g.groupby("pos")[what].mean()
        text = short_label(m) + (f", {combo}" if len(combos) > 1 else "")
        ls = (LINESTYLES.get(m) or OTHER_LINESTYLES[unstyled.index(m) % len(OTHER_LINESTYLES)]) if joined else ""
        ax.plot(mean.index, mean.values, ls=ls, lw=1.8, marker=MARKERS.get(m, "^"), color=color, label=text)
        if len(g) > len(mean):  # repeated runs at one x: every run a small marker
            ax.scatter(g.pos, g[what], s=14, color=color, alpha=0.6, zorder=3)
        late = g[~g.done.astype(bool)]  # a run that did not complete: a hollow marker
        ax.scatter(late.pos, late[what], s=36, facecolors="white", edgecolors=color, linewidths=1.5, zorder=4)
        below = m == lowest and len(which) > 1  # the lowest method's values below its points
        for x, y in mean.items() if len(combos) == 1 and len(mean) <= 8 else ():
            dy, va = (-9, "top") if below else (7, "bottom")
            ax.annotate(
                fmt.format(y),
                (x, y),
                xytext=(0, dy),
                textcoords="offset points",
                ha="center",
                va=va,
                fontsize=8,
                color=color,
            )


# -- markdown ------------------------------------------------------------------------------------


def not_completed(comparison: dict) -> list[str]:
    """One line per run that failed, was interrupted, is still running, or has no status.json, and
    per method of a run that did not run."""
    out = []
    for run in comparison["runs"]:
        if run["status"] != COMPLETED:
            why = f" ({run['reason']})" if run.get("reason") else ""
            done = ", ".join(run.get("completed_stages") or []) or "none"
            out.append(f"{run['label']}: {run['status'] or 'no status.json'}{why}; completed stages: {done}")
        no_loss = "has no final held-out loss (not run or not finished)"
        out += [f"{run['label']}: {short_label(m)} {no_loss}" for m in run.get("methods_not_run") or []]
    for run in comparison.get("no_results") or []:
        why = f" ({run['reason']})" if run.get("reason") else ""
        out.append(f"{run['label']}: no results ({run['why']}); status {run['status'] or 'no status.json'}{why}")
    return out


def render_comparison(comparison: dict) -> str:
    """comparison.md from the dict :func:`build_comparison` returns (computes no figure of its own):
    ``reports/templates/compare.md.j2``."""
    return render("compare.md.j2", c=comparison, MISSING=MISSING, columns_table=_md_table)


# -- the whole -----------------------------------------------------------------------------------


def build_comparison(
    run_dirs: Iterable[str | Path],
    out_dir: str | Path,
    *,
    axes: list[str] | None = None,
    labels: list[str] | None = None,
    title: str = "Comparison",
    source: str = "`ddiloco compare`",
    no_results: Iterable[dict] | None = None,
) -> dict:
    """Compare run directories: one table row per run, plots along an axis, written to ``out_dir``.

    ``run_dirs``: local run directories (``config.json``, optional ``status.json``,
    ``report/report.json`` of schema 3). ``axes``: dotted config keys to compare along; None detects
    them (:func:`detect_axes`). ``labels``: one row name per run (default: the folder names).
    ``title``, ``source``: the markdown's title and what built it. ``no_results``: runs without
    results to list (dicts with ``label``, ``run_dir``, ``status``, ``reason``, ``why``).

    Returns (and writes as ``comparison.json``) a strict-JSON dict; keys and units: docs/report.md.
    Raises :class:`ReportInputError` (one line: the path and the fix) for a path that is missing, not
    a run directory, lacks report/report.json or holds a corrupt or other-schema JSON file, a run
    given twice, or an ``out_dir`` that is a file or inside a compared run; ``ValueError`` for no run
    directories, an axis that is not a config key (or is a section), or labels that do not match the
    runs. Every check runs before anything is written.
    """
    given = list(run_dirs)
    if not given:
        raise ValueError(f"no run directories given; {RUN_HINT}")
    read, seen = [], set()
    for g in given:
        read.append(_read_run(g))
        if read[-1][0].resolve() in seen:
            raise ReportInputError(read[-1][0], "is given twice; give each run directory once")
        seen.add(read[-1][0].resolve())
    names = _labels([p for p, *_ in read], labels)
    runs = [_Run(lb, p, c, st, r, flatten(c, sep=".")) for lb, (p, c, st, r) in zip(names, read)]
    leaves = [r.leaves for r in runs]
    detected, partial = detect_axes(leaves)
    chosen = detected if axes is None else _check_axes(axes, leaves)
    out = Path(os.path.abspath(Path(out_dir).expanduser()))
    if out.exists() and not out.is_dir():
        raise ReportInputError(out, "exists and is not a directory; choose a new folder for the comparison")
    for r in runs:
        if out == r.path or r.path in out.parents:
            why = f"is inside the run directory {r.path}, which a comparison never writes into"
            raise ReportInputError(out, f"{why}; choose a folder outside it")
    rows, methods_all = _rows(runs, chosen)
    methods = [m for m in methods_all if any(row[f"{m}/final_val_loss"] is not None for row in rows)] or methods_all
    columns = _columns(rows, chosen, methods)
    rows = [{c["key"]: row.get(c["key"]) for c in columns} for row in rows]
    units = list(dict.fromkeys(row["unit"] for row in rows))
    comparison: dict[str, Any] = {
        "schema": SCHEMA,
        "title": title,
        "generated_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "source": source,
        "stage": STAGE,
        "baseline": BASELINE,
        "runs": [
            {"label": r.label, "run_dir": str(r.path), "name": r.config.get("name"), "status": _status_text(r.status)}
            | {k: (r.status or {}).get(k) for k in ("reason", "completed_stages")}
            | {"unit": row["unit"], "methods_not_run": [m for m in methods if row[f"{m}/final_val_loss"] is None]}
            for r, row in zip(runs, rows)
        ],
        "axes": chosen,
        "axes_detected": axes is None,
        "ignored_keys": list(IGNORED_KEYS),
        "partial_keys": _partial_summary([k for k in partial if k not in chosen], runs),
        "plot_axis": plot_axis(rows, chosen),
        "methods": methods,
        "units": units,
        "columns": columns,
        "rows": rows,
        "plots": {"loss": None, "gap": None},
        "notes": [],
        "no_results": [
            {k: r.get(k) for k in ("label", "run_dir", "status", "reason", "why")} for r in no_results or []
        ],
        "paths": {"out_dir": str(out)} | {k: str(out / n) for k, n in zip(("markdown", "json", "csv"), OUTPUTS)},
    }
    comparison["notes"] = not_completed(comparison)
    return _write_comparison(comparison, out, " or ".join(per_unit(u) for u in units))


def _write_comparison(comparison: dict, out: Path, per: str) -> dict:
    """Write the figures, comparison.json, .csv and .md into ``out``; returns the JSON-safe dict."""
    rows, chosen, methods, axis = (comparison[k] for k in ("rows", "axes", "methods", "plot_axis"))
    out.mkdir(parents=True, exist_ok=True)  # everything is checked: write
    for old in out.glob("*.png"):  # never leave a figure of an earlier comparison in this folder
        if old.name.startswith(FIGURE_PREFIXES):
            old.unlink()
    for key, fig in zip(("loss", "gap"), _figures(rows, axis, chosen, methods, per)):
        if fig is not None:
            comparison["plots"][key] = name = f"{key}_vs_{slug(axis)}.png" if axis else f"{key}_per_run.png"
            save_png(fig, out / name)
    comparison = json.loads(json.dumps(json_safe(comparison), allow_nan=False))
    atomic.write_json(out / COMPARISON_JSON, comparison, newline=True, default=None, allow_nan=False)
    text = [{k: cell(v) if isinstance(v, (list, dict, bool)) else v for k, v in r.items()} for r in comparison["rows"]]
    table = pd.DataFrame(
        text, columns=[c["key"] for c in comparison["columns"]], dtype=object
    )  # lists as JSON, true/false
    atomic.write_text(out / COMPARISON_CSV, table.to_csv(index=False, lineterminator="\n"))
    atomic.write_text(out / COMPARISON_MD, render_comparison(comparison))
    return comparison
