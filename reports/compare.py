"""A comparison across run directories: the table and plots of an experiment sweep.

:func:`build_comparison` reads each run's ``config.json``, ``status.json`` and ``report/report.json``
and writes ``comparison.md``, ``comparison.json``, ``comparison.csv`` and the plots into one folder.
What it reads, writes and returns, and the units: docs/report.md ("A comparison across runs").
"""

from __future__ import annotations

import csv
import datetime as _dt
import difflib
import io
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

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
    """(absolute path, config, status or None, report) of one run directory; ReportInputError
    (one line: the path, the problem, the fix) otherwise."""
    path = Path(os.path.abspath(Path(given).expanduser()))
    if not path.exists():
        raise ReportInputError(path, f"does not exist; {RUN_HINT}")
    if not path.is_dir():
        raise ReportInputError(path, f"is not a directory; {RUN_HINT}")
    layout = RunLayout(path)
    if not layout.config.is_file():
        raise ReportInputError(path, f"is not a run directory (no config.json); {RUN_HINT}")
    config = read_json(layout.config)
    report_path = layout.report_json
    if not report_path.is_file():
        raise ReportInputError(path, f"has no report/{REPORT_JSON}; build it with `ddiloco report {path}`")
    report = read_json(report_path)
    if report.get("schema") != REPORT_SCHEMA:
        raise ReportInputError(
            report_path,
            f"report schema {report.get('schema')!r}, a comparison reads schema "
            f"{REPORT_SCHEMA}; rebuild it with `ddiloco report {path}`",
        )
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
    keys = list(dict.fromkeys(k for lv in leaves for k in lv))
    axes, partial = [], []
    for k in keys:
        if k in IGNORED_KEYS:
            continue
        if all(k in lv for lv in leaves):
            if len({_canon(lv[k]) for lv in leaves}) > 1:
                axes.append(k)
        else:
            partial.append(k)
    return axes, partial


def _check_axes(axes: Iterable[str], leaves: list[dict[str, Any]]) -> list[str]:
    known = list(dict.fromkeys(k for lv in leaves for k in lv))
    out = []
    for a in axes:
        a = str(a).strip()
        if a in out:
            continue
        if a not in known:
            under = [k for k in known if k.startswith(a + ".")]
            if under:
                raise ValueError(
                    f"axis {a!r} is a config section, not a value; give one of its keys, e.g. {', '.join(under[:3])}"
                )
            close = difflib.get_close_matches(a, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"axis {a!r} is not a key of the runs' config.json{hint}; give a dotted key such as "
                "diloco.learners or train.token_budget"
            )
        out.append(a)
    return out


def _partial_summary(partial: list[str], runs: list[_Run]) -> list[str]:
    """Keys present in only some runs, a whole section missing from a run shortened to ``section.*``,
    each with the runs that lack it."""
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
    """One row per run (run, status, axes, unit, ``<method>/<figure>`` of the runs-table's
    pretraining rows, the post-training task and metric, path) and the methods of some run."""
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
    """The table's columns (``key``, ``header``, ``unit``, ``fmt``, ``group``), optional ones only
    where some run has a value."""
    units = list(dict.fromkeys(r["unit"] for r in rows))
    unit, per = (units[0] if len(units) == 1 else " or ".join(units)), " or ".join(per_unit(u) for u in units)
    cols = [_col("label", "run", "run"), _col("status", "status", "run")]
    cols += [_col(a, a, "axis", "value") for a in axes] + [_col("unit", "unit", "run")]
    post = any(r.get("post/metric") is not None for r in rows)
    for group, figures, baseline in _GROUPS:
        if group == "post" and not post:
            continue
        if group == "post" and baseline:
            cols += [
                {"key": f"post/{k}", "header": k, "unit": "", "fmt": "", "group": "post"} for k in ("task", "metric")
            ]
        for m in [m for m in methods if baseline or m != BASELINE]:
            for f in figures:
                key, shown_ = _key(m, f), shown(f, m, per, unit)
                if f in _REQUIRED or any(r.get(key) is not None for r in rows):
                    cols.append(
                        {"key": key, "header": shown_.header, "unit": shown_.unit, "fmt": shown_.fmt, "group": group}
                    )
    cols.append({"key": "run_dir", "header": "path", "unit": "", "fmt": "", "group": "path"})
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
    text = cell(r.get(c["key"]), c["fmt"])
    if (
        c["key"].endswith(("/post_diff", "/loss_gap_pct")) and r.get(c["key"]) is not None
    ):  # "−0.1273 [−0.1663, −0.0862]"
        lo, hi = r.get(c["key"] + "_ci_low"), r.get(c["key"] + "_ci_high")
        text += f" [{cell(lo, c['fmt'])}, {cell(hi, c['fmt'])}]" if lo is not None and hi is not None else ""
    return text


def _md_table(cols: list[dict], rows: list[dict]) -> str:
    cols = [c for c in cols if not c["key"].endswith(("_ci_low", "_ci_high"))]  # shown beside their figure
    return md_table([c["header"] for c in cols], [[_md_cell(r, c) for c in cols] for r in rows])


def _csv_value(v: Any) -> Any:
    return "" if v is None else cell(v) if isinstance(v, (list, dict, bool)) else v


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


def _marker(m: str) -> str:
    return MARKERS.get(m, "^")


def _style(m: str, methods: list[str]) -> str:
    if m in LINESTYLES:
        return LINESTYLES[m]
    others = [x for x in methods if x not in LINESTYLES]
    return OTHER_LINESTYLES[others.index(m) % len(OTHER_LINESTYLES)]


def _gap_title(methods: list[str]) -> str:
    """ "DiLoCo − DP held-out loss gap (%)", or "Held-out loss gap to DP (%)" for several methods."""
    if len(methods) == 1:
        return f"{short_label(methods[0])} − {short_label(BASELINE)} held-out loss gap (%)"
    return f"Held-out loss gap to {short_label(BASELINE)} (%)"


def _loss_and_gap(draw, methods: list[str], per: str, loss_title: str, where: str) -> tuple:
    """``draw(key_of, ylabel, title, which, fmt)`` of the final held-out loss and, with a method
    besides the baseline, of the loss gap to it (else None); the gap's title ends in ``where``."""
    loss = draw(lambda m: f"{m}/final_val_loss", f"final held-out loss (nats/{per})", loss_title, methods, "{:.4f}")
    gaps = [m for m in methods if m != BASELINE]
    if not gaps:
        return loss, None
    ylabel, title = f"loss gap to {short_label(BASELINE)} (%)", f"{_gap_title(gaps)} {where}"
    return loss, draw(lambda m: f"{m}/loss_gap_pct", ylabel, title, gaps, "{:+.2f} %")


def _axis_line(ax, pts: list, done: list[bool], color, ls: str, marker: str, fmt: str | None, below: bool) -> bool:
    """One line through the mean of the points ``pts`` ((x, y) per run) at each x, every run a small
    marker where several share an x and a hollow one where it did not complete (``done`` False), the
    values at the points in ``fmt`` (none when None; up to 8 points). True when a marker is hollow."""
    avg = pd.Series([y for _, y in pts]).groupby([x for x, _ in pts]).mean()  # sorted by x
    line_x, line_y = [float(x) for x in avg.index], [float(y) for y in avg]
    ax.plot(line_x, line_y, ls=ls, color=color, lw=1.8, marker=marker, ms=5)
    if len(pts) > len(line_x):  # repeated runs at one x: every run a small marker
        ax.scatter([x for x, _ in pts], [y for _, y in pts], s=14, color=color, alpha=0.6, zorder=3)
    unfinished = [p for p, d in zip(pts, done) if not d]
    if unfinished:  # a run that did not complete: a hollow marker
        ax.scatter(
            [x for x, _ in unfinished],
            [y for _, y in unfinished],
            s=36,
            facecolors="white",
            edgecolors=color,
            linewidths=1.5,
            zorder=4,
        )
    if fmt is not None and len(line_x) <= 8:
        for x, y in zip(line_x, line_y):
            ax.annotate(
                fmt.format(y),
                xy=(x, y),
                xytext=(0, -9 if below else 7),
                textcoords="offset points",
                ha="center",
                va="top" if below else "bottom",
                fontsize=8,
                color=color,
            )
    return bool(unfinished)


def _axis_handles(combos: dict, combo_text: dict, colors: list, which: list[str], hollow: bool) -> list:
    """The legend of an axis figure: a colour per combination (several) or per method (one)."""
    if len(combos) > 1:
        handles = [
            Line2D([], [], color=colors[ci % len(colors)], lw=2.5, label=combo_text[k] or "(all)")
            for ci, k in enumerate(combos)
        ]
        handles += [
            Line2D([], [], color="0.3", ls=_style(m, which), lw=1.8, marker=_marker(m), ms=5, label=short_label(m))
            for m in which
        ]
    else:
        handles = [
            Line2D(
                [], [], color=series_color(m, mi), ls=_style(m, which), lw=1.8, marker=_marker(m), label=short_label(m)
            )
            for mi, m in enumerate(which)
        ]
    if hollow:
        handles.append(Line2D([], [], ls="", marker="o", mfc="white", mec="0.3", label="run not completed"))
    return handles


def _axis_ticks(ax, xs_all: list, numeric: bool, cats: list[str], cat_text: dict[str, str]) -> None:
    """x ticks at the axis' values (log scale over a 16-fold range or more) or at its categories."""
    if numeric:
        values = sorted({float(x) for x in xs_all})
        if values[0] > 0 and values[-1] / values[0] >= 16:
            ax.set_xscale("log")
        if len(values) <= 12:
            ax.set_xticks(values, [cell(v if not float(v).is_integer() else int(v)) for v in values])
            ax.minorticks_off()
    else:
        ax.set_xticks(range(len(cats)), [cat_text[c] for c in cats])
        ax.set_xlim(-0.5, len(cats) - 0.5)


def _axis_figures(rows: list[dict], axis: str, axes: list[str], methods: list[str], per: str):
    """(loss figure, gap figure or None): one line per combination of the other axes' values (its
    colour) and method (its line style), the mean over runs at one x joined, every run a marker
    (hollow: the run did not complete)."""
    xs_all = [r.get(axis) for r in rows]
    numeric = all(_is_number(x) for x in xs_all)
    cats = list(dict.fromkeys(_canon(x) for x in xs_all))
    cat_text = {_canon(x): cell(x) for x in xs_all}
    pos = (lambda x: float(x)) if numeric else (lambda x: float(cats.index(_canon(x))))
    others = [b for b in axes if b != axis]
    combos: dict[str, list[dict]] = {}
    for r in rows:
        combos.setdefault(_canon([r.get(b) for b in others]), []).append(r)
    combo_text = {k: ", ".join(f"{_leaf(b, axes)}={cell(v)}" for b, v in zip(others, json.loads(k))) for k in combos}
    colors = cycle_colors()

    def draw(key_of, ylabel: str, title: str, which: list[str], fmt: str):
        fig = new_figure(7.5, 4.6)
        ax = fig.add_subplot()
        drawn, hollow = False, False
        means = {m: [r[key_of(m)] for r in rows if _is_number(r.get(key_of(m)))] for m in which}
        lowest = min((m for m in which if means[m]), key=lambda m: sum(means[m]) / len(means[m]), default=None)
        for ci, (_combo, rs) in enumerate(combos.items()):
            for mi, m in enumerate(which):
                runs = [r for r in rs if _is_number(r.get(key_of(m)))]
                if not runs:
                    continue
                drawn = True
                color = colors[ci % len(colors)] if len(combos) > 1 else series_color(m, mi)
                pts = [(pos(r.get(axis)), r[key_of(m)]) for r in runs]
                done = [r.get("status") == COMPLETED for r in runs]
                # values at the points (one line per method): the lowest method's below them
                label = fmt if len(combos) == 1 else None
                below = m == lowest and len(which) > 1
                hollow |= _axis_line(ax, pts, done, color, _style(m, which), _marker(m), label, below)
        if not drawn:
            return None
        handles = _axis_handles(combos, combo_text, colors, which, hollow)
        _axis_ticks(ax, xs_all, numeric, cats, cat_text)
        ax.margins(y=0.15)
        finish_axes(ax, axis, ylabel, title)
        ax.legend(handles=handles, fontsize=8)
        return fig, ax

    loss, gap = _loss_and_gap(draw, methods, per, f"Held-out loss vs {axis}", f"vs {axis}")
    if gap is not None:
        gap[1].axhline(0.0, color="0.5", lw=0.8)
    return (loss[0] if loss else None), (gap[0] if gap else None)


def _bar_figures(rows: list[dict], methods: list[str], per: str):
    """(loss figure, gap figure or None) with one group of bars per run (hatched: the run did not
    complete)."""
    labels = [r["label"] for r in rows]
    width = max(6.0, 1.0 + 1.1 * len(rows))
    rotate = len(rows) > 3 or max(len(x) for x in labels) > 14

    def bars(key_of, ylabel: str, title: str, which: list[str], fmt: str):
        have = [m for m in which if any(_is_number(r.get(key_of(m))) for r in rows)]
        if not have:
            return None
        fig = new_figure(width, 4.6)
        ax = fig.add_subplot()
        w = 0.8 / len(have)
        for mi, m in enumerate(have):
            xs = [i - 0.4 + w * (mi + 0.5) for i in range(len(rows))]
            ys = [r.get(key_of(m)) if _is_number(r.get(key_of(m))) else 0.0 for r in rows]
            bs = ax.bar(xs, ys, width=w * 0.95, color=series_color(m, mi), label=short_label(m))
            for b, r in zip(bs, rows):  # a run that did not complete: hatched
                if r.get("status") != COMPLETED:
                    b.set_hatch("//")
                    b.set_edgecolor("white")
            ax.bar_label(
                bs,
                labels=[fmt.format(r[key_of(m)]) if _is_number(r.get(key_of(m))) else MISSING for r in rows],
                fontsize=8,
                padding=2,
            )
        ax.set_xticks(
            range(len(rows)), labels, rotation=20 if rotate else 0, ha="right" if rotate else "center", fontsize=8
        )
        ax.axhline(0.0, color="0.5", lw=0.8)
        ax.margins(y=0.12)
        finish_axes(ax, "run", ylabel, title, grid_axis="y")
        handles = ax.get_legend_handles_labels()[0]
        if any(r.get("status") != COMPLETED for r in rows):
            handles.append(Patch(facecolor="0.55", edgecolor="white", hatch="//", label="run not completed"))
        fig.legend(
            handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False
        )  # below the axes, clear of the bars' labels
        return fig

    return _loss_and_gap(bars, methods, per, "Final held-out loss per run", "per run")


# -- markdown ------------------------------------------------------------------------------------


def not_completed(comparison: dict) -> list[str]:
    """One line per run that failed, was interrupted, is still running, or has no status.json, and
    per method of a run that did not run."""
    out = []
    for run in comparison["runs"]:
        if run["status"] != COMPLETED:
            what = run["status"] or "no status.json"
            why = f" ({run['reason']})" if run.get("reason") else ""
            done = ", ".join(run.get("completed_stages") or []) or "none"
            out.append(f"{run['label']}: {what}{why}; completed stages: {done}")
        for m in run.get("methods_not_run") or []:
            out.append(f"{run['label']}: {short_label(m)} has no final held-out loss (not run or not finished)")
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

    ``run_dirs``: local run directories, each holding ``config.json``, ``status.json`` (optional)
    and ``report/report.json`` of schema 3. ``axes``: dotted config keys to compare along
    (``["diloco.learners", "diloco.quorum"]``); None detects them (the keys whose values differ,
    :data:`IGNORED_KEYS` left out). ``labels``: one row name per run (default: the folder names).
    ``title``: the markdown's title; ``source``: what built it (shown under the title). ``no_results``:
    runs meant to be compared that have no results (a sweep's cells without a report), each a dict
    with ``label``, ``run_dir``, ``status``, ``reason`` and ``why``, listed as "no results".

    Returns (and writes as ``comparison.json``) a strict-JSON dict: docs/report.md lists its keys;
    losses in nats per token (or image), wall time in seconds, gaps in % against DP, bytes as payload
    bytes, missing values None (shown "—").

    Raises :class:`ReportInputError` (one line naming the path and the fix) for a path that does not
    exist, is not a directory, holds no config.json, has no report/report.json, or holds a corrupt
    or other-schema JSON file, for a run directory given twice, and for an ``out_dir`` that is a
    file or inside a compared run; ``ValueError`` for no run directories, an axis that is not a
    config key (or is a section), or labels that do not match the runs. Every check runs before
    anything is written.
    """
    runs = _read_runs(list(run_dirs), labels)
    leaves = [r.leaves for r in runs]
    detected, partial = detect_axes(leaves)
    chosen = detected if axes is None else _check_axes(axes, leaves)
    out = _out_dir(out_dir, runs)
    rows, methods, columns = _table(runs, chosen)
    units = list(dict.fromkeys(row["unit"] for row in rows))
    per = " or ".join(per_unit(u) for u in units)

    comparison: dict[str, Any] = {
        "schema": SCHEMA,
        "title": title,
        "generated_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "source": source,
        "stage": STAGE,
        "baseline": BASELINE,
        "runs": [_run_entry(r, row, methods) for r, row in zip(runs, rows)],
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
            {k: r.get(k) for k in ("label", "run_dir", "status", "reason", "why")} for r in (no_results or [])
        ],
        "paths": {
            "out_dir": str(out),
            "markdown": str(out / COMPARISON_MD),
            "json": str(out / COMPARISON_JSON),
            "csv": str(out / COMPARISON_CSV),
        },
    }
    comparison["notes"] = not_completed(comparison)
    return _write_comparison(comparison, out, per)


def _table(runs: list[_Run], chosen: list[str]) -> tuple[list[dict], list[str], list[dict]]:
    """The table's rows (one per run, in column order), its methods (those with a final held-out
    loss in some run, else every method) and its columns."""
    rows, methods_all = _rows(runs, chosen)
    methods = [m for m in methods_all if any(row[f"{m}/final_val_loss"] is not None for row in rows)] or methods_all
    columns = _columns(rows, chosen, methods)
    return [{c["key"]: row.get(c["key"]) for c in columns} for row in rows], methods, columns


def _read_runs(given: list[str | Path], labels: list[str] | None) -> list[_Run]:
    """Each run directory read and checked (:func:`_read_run`), each once, with its label."""
    if not given:
        raise ValueError(f"no run directories given; {RUN_HINT}")
    read, seen = [], {}
    for g in given:
        path, config, status, report = _read_run(g)
        key = path.resolve()
        if key in seen:
            raise ReportInputError(path, "is given twice; give each run directory once")
        seen[key] = path
        read.append((path, config, status, report))
    names = _labels([p for p, *_ in read], labels)
    return [_Run(lb, p, c, s, r, flatten(c, sep=".")) for lb, (p, c, s, r) in zip(names, read)]


def _out_dir(out_dir: str | Path, runs: list[_Run]) -> Path:
    """``out_dir`` made absolute; refused when it is a file or lies inside a compared run."""
    out = Path(os.path.abspath(Path(out_dir).expanduser()))
    if out.exists() and not out.is_dir():
        raise ReportInputError(out, "exists and is not a directory; choose a new folder for the comparison")
    for r in runs:
        if out == r.path or r.path in out.parents:
            raise ReportInputError(
                out,
                f"is inside the run directory {r.path}, which a comparison never writes "
                "into; choose a folder outside it",
            )
    return out


def _run_entry(r: _Run, row: dict, methods: list[str]) -> dict:
    """One run of comparison.json's ``runs``."""
    return {
        "label": r.label,
        "run_dir": str(r.path),
        "name": r.config.get("name"),
        "status": _status_text(r.status),
        "reason": (r.status or {}).get("reason"),
        "completed_stages": (r.status or {}).get("completed_stages"),
        "unit": row["unit"],
        "methods_not_run": [m for m in methods if row[f"{m}/final_val_loss"] is None],
    }


def _write_comparison(comparison: dict, out: Path, per: str) -> dict:
    """Write the figures, comparison.json, .csv and .md into ``out``; returns the JSON-safe dict."""
    rows, chosen, methods, columns = (comparison[k] for k in ("rows", "axes", "methods", "columns"))

    # Everything is checked: write.
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):  # never leave a figure of an earlier comparison in this folder
        if old.name.startswith(FIGURE_PREFIXES):
            old.unlink()
    axis = comparison["plot_axis"]
    if axis is not None:
        figs = _axis_figures(rows, axis, chosen, methods, per)
        names_ = (f"loss_vs_{slug(axis)}.png", f"gap_vs_{slug(axis)}.png")
    else:
        figs = _bar_figures(rows, methods, per)
        names_ = ("loss_per_run.png", "gap_per_run.png")
    for key, fig, name in zip(("loss", "gap"), figs, names_):
        if fig is not None:
            save_png(fig, out / name)
            comparison["plots"][key] = name

    comparison = json.loads(json.dumps(json_safe(comparison), allow_nan=False))
    atomic.write_json(out / COMPARISON_JSON, comparison, newline=True, default=None, allow_nan=False)
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(
        [[c["key"] for c in columns]] + [[_csv_value(row.get(c["key"])) for c in columns] for row in comparison["rows"]]
    )
    atomic.write_text(out / COMPARISON_CSV, buf.getvalue())
    atomic.write_text(out / COMPARISON_MD, render_comparison(comparison))
    return comparison
