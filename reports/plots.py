"""The report's figures, and the plot style every figure of the project shares (the goodput
simulator's included: ``sim.plot``). Built on matplotlib's object API (:class:`Figure` with the Agg
canvas, no pyplot), so they are safe to draw inside threads and tasks.
"""

from __future__ import annotations

import io
import itertools
import math
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, MaxNLocator

from reports.common import label, num, short_label

DPI = 120
GRID_ALPHA = 0.3
METHOD_COLORS = {"diloco": "tab:blue", "dp": "tab:orange"}
SINCE_START = "seconds since the method's training start"


def cycle_colors() -> list[str]:
    """matplotlib's default colour cycle (tab10)."""
    return list(matplotlib.rcParams["axes.prop_cycle"].by_key()["color"])


def series_color(name: str, index: int) -> str:
    """The colour of series ``name``, the ``index``-th on its axes: a known method's own colour,
    else the ``index``-th colour of the cycle."""
    if name in METHOD_COLORS:
        return METHOD_COLORS[name]
    colors = cycle_colors()
    return colors[index % len(colors)]


def new_figure(width: float, height: float) -> Figure:
    """An empty figure of ``width`` × ``height`` inches at :data:`DPI`, constrained layout."""
    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def finish_axes(
    ax, xlabel: str, ylabel: str | None, title: str, grid_axis: str = "both", title_size: float | None = None
) -> None:
    """Axis labels, title (``title_size`` points; matplotlib's default when None) and the light grid
    of every figure."""
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.grid(True, axis=grid_axis, alpha=GRID_ALPHA)


def save_png(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as PNG to ``path`` (a local path or an fsspec ``UPath``); returns ``path``."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    path.write_bytes(buf.getvalue())
    return path


def loss_figure(
    curves: dict[str, list[dict] | None],
    x_key: str,
    xlabel: str,
    title: str,
    finals: dict[str, float | None] | None = None,
    unit: str = "token",
) -> Figure | None:
    """Held-out loss (nats/token) against ``x_key`` (``tokens`` or ``wall_s``, seconds) for each
    method with a curve (``curves``: method → eval rows with ``val/loss``); None if none has one.
    Points are sorted stably by ``x_key`` (rows sharing an x keep their file order); the "final"
    label shows ``finals[m]`` (the tables' final loss) when given, else the last point's loss.
    """
    finals, series = finals or {}, {}
    for m, rows in curves.items():
        pts = [(x, y) for r in rows or [] if None not in (x := num(r.get(x_key)), y := num(r.get("val/loss")))]
        if pts:
            series[m] = sorted(pts, key=lambda xy: xy[0])  # stable: ties keep file order
    if not series:
        return None
    final = {m: num(finals.get(m)) for m in series}
    final = {m: f if f is not None and math.isfinite(f) else series[m][-1][1] for m, f in final.items()}
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot()
    lowest = min(series, key=lambda m: final[m])
    for i, (m, pts) in enumerate(series.items()):
        xs, ys = zip(*pts)
        color = series_color(m, i)
        ax.plot(xs, ys, marker="o", ms=3, lw=1.6, color=color, label=label(m))
        dy, va = (-14, "top") if len(series) > 1 and m == lowest else (10, "bottom")  # the lowest below its point
        box = {"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85}
        arrow = {"arrowstyle": "-", "color": color, "lw": 0.8}
        text, xy = f"final {final[m]:.4f}", (xs[-1], final[m])
        kw = {"textcoords": "offset points", "ha": "right", "va": va, "fontsize": 9, "color": color}
        ax.annotate(text, xy=xy, xytext=(-8, dy), bbox=box, arrowprops=arrow, **kw)
    ax.margins(x=0.03, y=0.12)  # room for the annotations inside the frame
    ax.xaxis.set_major_formatter(EngFormatter(unit=""))
    finish_axes(ax, xlabel, f"held-out loss (nats/{unit})", title)
    ax.legend()
    return fig


def merges_figure(merges: list[dict], failures: list[dict], method: str = "diloco") -> Figure | None:
    """One marker per merge (y: fragment, x: ``merged_at_s``, colour: contributing learners), learner
    failures (red) and restarts (green) as vertical lines with the downtime shaded (``failures``
    from :func:`reports.learners.learner_failures`). None when no merge has a time."""
    pts = [(t, m) for m in merges if (t := num(m.get("merged_at_s"))) is not None]
    if not pts:
        return None
    frag_ids = sorted({str(m.get("fragment")) for _, m in pts}, key=lambda s: (0, int(s)) if s.isdigit() else (1, s))
    ypos = {f: i for i, f in enumerate(frag_ids)}
    fig = new_figure(8.0, 1.6 + 0.55 * len(frag_ids))
    ax = fig.add_subplot()
    xs, ys = [t for t, _ in pts], [ypos[str(m.get("fragment"))] for _, m in pts]
    learners = [len(m.get("contributors") or []) for _, m in pts]
    sc = ax.scatter(xs, ys, c=learners, cmap="viridis", marker="D", s=28, zorder=3, vmin=0)
    cbar = fig.colorbar(sc, ax=ax, pad=0.01)
    cbar.set_label("contributing learners")
    cbar.locator = MaxNLocator(integer=True)
    cbar.update_ticks()
    t_end = max(t for t, _ in pts)
    for i, f in enumerate(failures):
        t0, t1 = f["failed_at_s"], f["restarted_at_s"]
        ax.axvline(t0, color="tab:red", ls="--", lw=1.2, label="learner failure" if i == 0 else None)
        if t1 is not None:
            ax.axvline(t1, color="tab:green", ls="--", lw=1.2, label="learner restart" if i == 0 else None)
        ax.axvspan(t0, t1 if t1 is not None else max(t_end, t0), color="tab:red", alpha=0.08)
        text, dy = f"learner {f['learner']} down: {f['merges_while_down']} merges", -3 - 11 * (i % 3)
        kw = {"xycoords": ("data", "axes fraction"), "textcoords": "offset points", "va": "top", "fontsize": 8}
        ax.annotate(text, xy=(t0, 1.0), xytext=(3, dy), color="tab:red", **kw)
    ax.set_yticks(range(len(frag_ids)), [f"fragment {f}" for f in frag_ids])
    ax.set_ylim(-0.6, len(frag_ids) - 0.4 + 0.5)
    title = f"{short_label(method)} merges per fragment over time"
    finish_axes(ax, "time since training start (s)", None, title, grid_axis="x")
    if failures:
        fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return fig


def confusion_figure(evals: dict[str, dict | None]) -> Figure | None:
    """Each method's confusion matrix on the test images (rows: true class, columns: predicted;
    counts, shaded by the share of the true class), from its eval result's ``confusion`` and
    ``class_names``; None if no method has one."""
    have = {m: e for m, e in evals.items() if e and e.get("confusion")}
    if not have:
        return None
    fig = new_figure(4.2 * len(have), 4.0)
    axes = fig.subplots(1, len(have), squeeze=False)[0]
    for ax, (m, e) in zip(axes, have.items()):
        counts = [[int(x) for x in row] for row in e["confusion"]]
        k = len(counts)
        share = [[c / max(sum(row), 1) for c in row] for row in counts]
        ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
        for i, j in itertools.product(range(k), repeat=2):
            ink = "white" if share[i][j] > 0.5 else "black"
            if counts[i][j]:
                ax.text(j, i, str(counts[i][j]), ha="center", va="center", fontsize=7, color=ink)
        names = e.get("class_names") or [str(i) for i in range(k)]
        ax.set_xticks(range(k), names, fontsize=7)
        ax.set_yticks(range(k), names, fontsize=7)
        acc = e.get("test/accuracy")
        title = f"{label(m)}" + (f": accuracy {acc:.3f}" if acc is not None else "")
        finish_axes(ax, "predicted class", "true class", title)
        ax.grid(False)
    return fig


# Timeline states (reports.resilience.STATES) and their colours.
STATE_COLORS = {
    "running": "tab:green",
    "straggling": "#bcbd22",
    "waiting": "tab:orange",
    "recomputing": "tab:purple",
    "down": "tab:red",
    "absent": "#d9d9d9",
}


def resilience_timeline_figure(resilience: dict, merge_times: list[float] | None = None) -> Figure | None:
    """One row per DiLoCo learner, then one per DP replica, coloured by state (:data:`STATE_COLORS`)
    against seconds since each method's training start; DiLoCo's merges (``merge_times``, the same
    seconds) as ticks on a row of their own. None when neither method has a timeline."""
    d, p = resilience.get("diloco") or {}, resilience.get("dp") or {}
    dp_rows = list((p.get("timelines") or {}).items())
    rows = [(f"{short_label('diloco')} learner {m}", ivs) for m, ivs in (d.get("timelines") or {}).items()]
    rows += [(f"{short_label('dp')} replica {r}" if len(dp_rows) > 1 else short_label("dp"), ivs) for r, ivs in dp_rows]
    if not rows:
        return None
    ticks = merge_times is not None and bool(d)
    n = len(rows) + (1 if ticks else 0)
    fig = new_figure(9.0, 1.6 + 0.42 * n)
    ax = fig.add_subplot()
    labels, seen = [], set()
    y = n - 1
    if ticks:
        ax.vlines([t for t in merge_times if t >= 0], y - 0.35, y + 0.35, color="tab:blue", lw=0.6)
        labels.append((y, f"{short_label('diloco')} merges"))
        y -= 1
    for name, ivs in rows:
        by: dict[str, list[tuple[float, float]]] = {}
        for iv in ivs:
            by.setdefault(iv["state"], []).append((iv["start"], iv["end"] - iv["start"]))
        for state, spans in by.items():
            ax.broken_barh(spans, (y - 0.38, 0.76), facecolors=STATE_COLORS.get(state, "black"), linewidth=0)
            seen.add(state)
        labels.append((y, name))
        y -= 1
    ax.set_yticks([a for a, _ in labels], [b for _, b in labels], fontsize=8)
    ax.set_ylim(-0.7, n - 0.3)
    ends = [iv["end"] for _, ivs in rows for iv in ivs]
    ax.set_xlim(0, max(ends, default=1.0) * 1.01 or 1.0)
    title = "Learner and replica states over training (DiLoCo: run clock; DP: its own clock)"
    finish_axes(ax, SINCE_START, None, title, grid_axis="x")
    handles = [Patch(color=STATE_COLORS[s], label=s) for s in STATE_COLORS if s in seen]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    return fig


def resilience_loss_figure(series: list[dict], at_s: float | None = None, unit: str = "token") -> Figure | None:
    """Held-out loss (nats/``unit``) against seconds since each method's training start: one line per
    ``series`` entry (``method``, ``label``, ``points`` [(s, loss)], ``dashed``: a reference run
    without chaos), the equal-time point ``at_s`` as a vertical line. None without points."""
    have = [s for s in series if s.get("points")]
    if not have:
        return None
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot()
    for i, s in enumerate(have):
        xs, ys = zip(*s["points"])
        style = {"ls": "--", "alpha": 0.7} if s.get("dashed") else {"ls": "-", "alpha": 1.0}
        ax.plot(xs, ys, marker="o", ms=2.5, lw=1.4, color=series_color(s["method"], i), label=s["label"], **style)
    if at_s is not None:
        ax.axvline(at_s, color="grey", lw=0.8, ls=":", label=f"equal time: {at_s:.1f} s")
    title = "Held-out loss vs training time under the chaos schedule"
    finish_axes(ax, SINCE_START, f"held-out loss (nats/{unit})", title)
    ax.legend(fontsize=8)
    return fig
