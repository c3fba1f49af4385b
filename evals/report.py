"""The run report: Decoupled DiLoCo and the data-parallel (DP) baseline side by side.

Decoupled DiLoCo: Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training",
arXiv 2604.21428 (2026).

Everything is read back from one run directory (``docs/contracts.md``); nothing depends on the
in-memory state of an earlier flow, so a report can be rebuilt for any finished (or half-finished)
run::

    from evals.report import build_report
    report = build_report(Path("runs/default-20261129-101500"))

:func:`build_report` writes ``RUN/report/``:

``report.md``
    The human report: header (run name, date, git commit, package versions), the side-by-side
    table, the loss gap, hyperparameters, data manifest, token ledger, learner failures and the
    merges that happened while a learner was down, and the plots (embedded by relative path).
``report.json``
    Every number shown in ``report.md``, machine-readable; ``json.loads`` of the file equals the
    dict that :func:`build_report` returns.
``loss_vs_tokens.png``
    Held-out loss (mean next-token cross entropy, **nats/token**) against training **tokens**
    consumed (DiLoCo: summed over all learners), both methods on one axes, final values annotated.
``loss_vs_time.png``
    The same held-out loss against wall-clock **seconds** since the method's training started.
``merges_over_time.png`` (only when there were merges)
    One marker per merge of a fragment (y: fragment index, x: seconds since training start, colour:
    number of contributing learners); learner failures (red) and restarts (green) as vertical
    lines, the downtime shaded. Markers inside a shaded span are merges the syncer made while
    that learner was down.

Units used throughout: tokens (counts of BPE tokens), seconds (wall clock), bytes (payload bytes
on the wire, as the methods record them), nats (natural-log cross entropy; perplexity = exp(loss)).

A run directory is the folder the pipeline creates (``flows.pipeline.make_run_dir``): it holds
``config.json`` and, once pretraining ran, ``pretrain/`` (plus ``data/``, ``metrics/``, ``eval/``,
``checkpoints/``). A path that does not exist, or a folder with neither ``config.json`` nor
``pretrain/``, raises :class:`ReportInputError` naming the path (and nothing is written there).
Missing inputs inside a run directory are normal (DP disabled, eval disabled, no failures): the
part they feed says "not run". A file that exists but is not valid JSON raises
:class:`ReportInputError` naming it.

:func:`publish_report_artifacts` publishes the report to Prefect and must run inside a flow or
task run.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any, Iterable

from matplotlib.figure import Figure  # the Agg canvas; no pyplot, so thread-safe inside tasks
from matplotlib.ticker import EngFormatter, MaxNLocator

METHODS = ("diloco", "dp")
LABELS = {"diloco": "Decoupled DiLoCo", "dp": "Data-parallel"}
COLORS = {"diloco": "tab:blue", "dp": "tab:orange"}
NOT_RUN = "not run"
PACKAGES = ("jax", "flax", "optax", "prefect", "lm_eval")
PAPER = ('Decoupled DiLoCo (Douillard et al., "Decoupled DiLoCo for Resilient Distributed '
         'Pre-training", arXiv 2604.21428, 2026)')

# The lm-eval metrics in the order the table shows them; anything else found follows, sorted.
EVAL_METRICS = (
    ("heldout_ppl/word_perplexity", "held-out word perplexity", "", "{:.3f}"),
    ("heldout_ppl/byte_perplexity", "held-out byte perplexity", "", "{:.4f}"),
    ("heldout_ppl/bits_per_byte", "held-out bits per byte", "bits/byte", "{:.4f}"),
    ("heldout_nextline/acc", "next-line accuracy", "fraction", "{:.4f}"),
    ("heldout_nextline/acc_norm", "next-line accuracy (length-normalised)", "fraction", "{:.4f}"),
    ("heldout_ppl/passages", "held-out perplexity passages", "passages", "int"),
    ("heldout_nextline/questions", "next-line questions", "questions", "int"),
    ("checkpoint_tokens", "tokens in the evaluated checkpoint", "tokens", "int"),
)

# Summary fields and the names the pretraining flows may use for them (first found wins).
SUMMARY_FIELDS: dict[str, tuple[str, ...]] = {
    "tokens": ("tokens",),
    "steps": ("steps",),
    "wall_s": ("wall_s",),
    "tokens_per_s": ("tokens_per_s",),
    "final_val_loss": ("final_val_loss", "final/val_loss", "val/loss", "final_loss"),
    "merges": ("merges",),
    "bytes_sent": ("bytes_to_syncer", "bytes_allreduced", "bytes_all_reduced", "bytes_sent"),
    "bytes_received": ("bytes_from_syncer", "bytes_allreduced", "bytes_all_reduced", "bytes_received"),
    "params": ("params", "n_params", "num_params"),
    "flops_per_token": ("flops_per_token",),
    "goodput": ("goodput",),
}
LEDGER_COLUMNS = ("processed", "submitted", "not_submitted", "merged", "dropped", "pending")
RUN_DIR_CONTENTS = (
    "a run directory is the folder the pipeline creates: it holds config.json and, once "
    "pretraining ran, pretrain/ (also data/, metrics/, eval/, checkpoints/)"
)


class ReportInputError(ValueError):
    """The input cannot be used: the path is not a run directory, or a run-directory file exists
    but is corrupt (bad JSON, wrong shape). The message names the path."""

    def __init__(self, path: Path, problem: str):
        self.path = Path(path)
        super().__init__(f"{self.path}: {problem}")


# --------------------------------------------------------------------------------------------
# Reading the run directory
# --------------------------------------------------------------------------------------------


def _read_json(path: Path, kind: type = dict) -> Any | None:
    """The parsed file, or ``None`` if it does not exist. Corrupt or wrong-typed → ReportInputError."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ReportInputError(path, f"corrupt JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
    except UnicodeDecodeError as e:
        raise ReportInputError(path, f"not UTF-8 text ({e})") from e
    if not isinstance(value, kind):
        raise ReportInputError(path, f"expected a JSON {kind.__name__}, found {type(value).__name__}")
    return value


def _read_jsonl(path: Path) -> list[dict] | None:
    """One dict per non-empty line, or ``None`` if the file does not exist."""
    if not path.is_file():
        return None
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportInputError(path, f"corrupt JSON on line {lineno} ({e.msg})") from e
        if not isinstance(row, dict):
            raise ReportInputError(path, f"line {lineno} is not a JSON object")
        rows.append(row)
    return rows


def _first(d: dict, names: Iterable[str]) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return None


def _num(x: Any) -> float | int | None:
    """A JSON number as int/float; bools, strings and None → None."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _lid(x: Any) -> int | str:
    """Learner id normalised (``"0"`` and ``0`` are the same learner)."""
    try:
        return int(x)
    except (TypeError, ValueError):
        return str(x)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _eval_metrics(raw: dict) -> dict[str, float]:
    """Our flat metrics dict, or lm-eval's ``{"results": {task: {"metric,filter": v}}}`` flattened
    to ``task/metric`` (stderr entries and aliases dropped)."""
    if isinstance(raw.get("results"), dict):
        flat: dict[str, float] = {}
        for task, metrics in raw["results"].items():
            if not isinstance(metrics, dict):
                continue
            for k, v in metrics.items():
                metric, _, filt = k.partition(",")
                if "stderr" in metric or _num(v) is None:
                    continue
                flat[f"{task}/{metric}" + (f",{filt}" if filt and filt != "none" else "")] = _num(v)
        for k in ("eval_s",):
            if _num(raw.get(k)) is not None:
                flat[k] = _num(raw[k])
        return flat
    return {k: _num(v) for k, v in raw.items() if _num(v) is not None}


def _git_commit() -> str:
    """Short commit of the code producing the report (``git rev-parse --short HEAD``), or "unknown"."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _versions() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _safe_exp(x: float | None) -> float | None:
    if x is None:
        return None
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


# --------------------------------------------------------------------------------------------
# Analyses (pure: dicts in, dicts out)
# --------------------------------------------------------------------------------------------


def _merge_time(m: dict) -> float | None:
    """When the merge took effect: seconds since training start."""
    return _num(_first(m, ("merged_at_s", "t", "time_s", "quorum_at_s")))


def _event_time(e: dict) -> float | None:
    return _num(_first(e, ("t", "t_s", "time_s", "wall_s")))


def learner_failures(events: list[dict], merges: list[dict]) -> list[dict]:
    """Each ``failure`` event with its downtime and the merges that happened during it.

    The learner is down from the failure time until its next ``start`` event (a later attempt),
    or, if no start was logged, its next ``retry`` event; if neither, until the end of the run.
    A merge at time t counts as "while down" when failure_t ≤ t < restart_t (seconds since training
    start). ``merged_again_after_restart`` says whether any merge at or after the restart had this
    learner among its contributors.
    """
    evs = sorted(
        (e for e in events if _event_time(e) is not None),
        key=lambda e: _event_time(e),
    )
    timed_merges = [(t, m) for m in merges if (t := _merge_time(m)) is not None]
    out = []
    for i, f in enumerate(evs):
        if f.get("event") != "failure":
            continue
        lid = _lid(f.get("learner"))
        t_fail = _event_time(f)
        att = _num(f.get("attempt"))
        later = [e for e in evs[i + 1 :] if _lid(e.get("learner")) == lid]

        def _after(e: dict) -> bool:  # a start of a later attempt (when attempts are logged)
            a = _num(e.get("attempt"))
            return att is None or a is None or a > att

        restart = next((e for e in later if e.get("event") == "start" and _after(e)), None)
        if restart is None:
            restart = next((e for e in later if e.get("event") == "retry"), None)
        t_restart = _event_time(restart) if restart else None
        end = t_restart if t_restart is not None else math.inf
        during = [(t, m) for t, m in timed_merges if t_fail <= t < end]
        by_frag: dict[str, int] = {}
        for _, m in during:
            by_frag[str(m.get("fragment"))] = by_frag.get(str(m.get("fragment")), 0) + 1
        after = sorted(
            t
            for t, m in timed_merges
            if t_restart is not None
            and t >= t_restart
            and lid in {_lid(c) for c in (m.get("contributors") or [])}
        )
        out.append(
            {
                "learner": lid,
                "attempt": f.get("attempt"),
                "failed_at_s": t_fail,
                "failed_at_step": f.get("step"),
                "reason": f.get("reason"),
                "restarted_at_s": t_restart,
                "restart_attempt": restart.get("attempt") if restart else None,
                "downtime_s": (t_restart - t_fail) if t_restart is not None else None,
                "merges_while_down": len(during),
                "merges_while_down_by_fragment": dict(sorted(by_frag.items())),
                "merges_while_down_with_learner": sum(
                    lid in {_lid(c) for c in (m.get("contributors") or [])} for _, m in during
                ),
                "merged_again_after_restart": bool(after),
                "first_merge_with_learner_after_restart_s": after[0] if after else None,
            }
        )
    return out


def _merge_stats(merges: list[dict]) -> dict:
    """Counts over the merge log. ``bytes_in`` (submission bytes merged) and ``bytes_out`` (the
    syncer's publish fan-out: fragment bytes × learners) are summed only when every record has
    them; otherwise they are None ("not recorded", e.g. records written before ``bytes_out``
    existed) and ``bytes_*_recorded`` says in how many records they were."""
    by_frag: dict[str, int] = {}
    contributors, stale = [], 0
    for m in merges:
        k = str(m.get("fragment"))
        by_frag[k] = by_frag.get(k, 0) + 1
        contributors.append(len(m.get("contributors") or []))
        stale += sum(1 for s in (m.get("stale") or []) if s)
    sums: dict[str, Any] = {}
    for key in ("bytes_in", "bytes_out"):
        vals = [v for m in merges if (v := _num(m.get(key))) is not None]
        sums[key] = sum(vals) if len(vals) == len(merges) else None
        sums[f"{key}_recorded"] = len(vals)
    times = [t for m in merges if (t := _merge_time(m)) is not None]
    return {
        "count": len(merges),
        "by_fragment": dict(sorted(by_frag.items())),
        "mean_contributors": sum(contributors) / len(contributors) if contributors else None,
        "stale_contributions": stale,
        **sums,
        "first_s": min(times) if times else None,
        "last_s": max(times) if times else None,
    }


def _learner_table(events: list[dict]) -> list[dict]:
    """Per learner: starts (attempts begun), failures, submissions the syncer dropped, the last
    step seen in any event, and how its last attempt ended."""
    per: dict[Any, dict] = {}
    for e in sorted(events, key=lambda e: _event_time(e) or 0.0):
        if e.get("learner") is None:
            continue
        lid = _lid(e.get("learner"))
        row = per.setdefault(
            lid,
            {"learner": lid, "starts": 0, "failures": 0, "dropped_submissions": 0, "last_step": None,
             "ended": None},
        )
        ev = e.get("event")
        if ev == "start":
            row["starts"] += 1
        elif ev == "failure":
            row["failures"] += 1
        elif ev == "dropped":
            row["dropped_submissions"] += 1
        if e.get("step") is not None:
            row["last_step"] = e.get("step")
        if ev in ("stop", "failure"):
            row["ended"] = ev + (f" ({e['reason']})" if e.get("reason") else "")
    return [per[k] for k in sorted(per, key=lambda k: (0, k) if isinstance(k, int) else (1, str(k)))]


def _int(x: Any) -> int | None:
    """A ledger count as a whole number of tokens (the syncer's per-fragment averages are rounded)."""
    v = _num(x)
    if v is None or not math.isfinite(v):
        return None
    return int(round(v))


def _fragments(config: dict | None, summary: dict | None) -> int | None:
    """P, the number of fragments: from config.json, else the DiLoCo summary."""
    p = _num(_nested(config, ("diloco", "fragments")))
    if p is None and summary is not None:
        hp = _first(summary, ("hyperparameters", "hparams")) or {}
        p = _num(_first(hp, ("fragments (P)", "fragments"))) if isinstance(hp, dict) else None
        if p is None and isinstance(summary.get("fragment_bytes"), list):
            p = len(summary["fragment_bytes"]) or None
    return int(p) if p else None


def _ledger(summary: dict | None, fragments: int | None = None) -> dict:
    """DiLoCo's token ledger per learner (whole tokens), a total row and merged % of processed.

    Numeric entries become integer columns (the standard six first: processed, submitted,
    not_submitted, merged, dropped, pending); dict-valued entries (``drop_reasons``: reason →
    tokens) are kept as dicts and summed key-wise in the total. ``not_submitted`` is computed as
    processed − submitted for summaries that do not record it. Each learner row is checked
    against processed = submitted + not_submitted and submitted = merged + dropped + pending,
    allowing ±P tokens (``tolerance``) for the rounding of the per-fragment averages; rows that
    break either identity are listed in ``identity_violations``.
    """
    empty = {"columns": [], "rows": [], "total": None, "fragments": fragments, "tolerance": None,
             "not_submitted_computed": False, "identity_violations": []}
    if summary is None:
        return {"status": NOT_RUN, **empty}
    raw = summary.get("ledger")
    if isinstance(raw, dict) and isinstance(raw.get("ledger"), dict):
        raw = raw["ledger"]
    if not isinstance(raw, dict) or not raw:
        return {"status": "not recorded", **empty}
    learners = {k: dict(v) for k, v in raw.items() if isinstance(v, dict)}
    computed = False
    for v in learners.values():
        if v.get("not_submitted") is None and _num(v.get("processed")) is not None \
                and _num(v.get("submitted")) is not None:
            v["not_submitted"] = _num(v["processed"]) - _num(v["submitted"])
            computed = True
    extra = sorted({c for v in learners.values() for c in v} - set(LEDGER_COLUMNS))
    columns = [c for c in LEDGER_COLUMNS if any(c in v for v in learners.values())] + extra
    dict_cols = {c for c in columns if any(isinstance(v.get(c), dict) for v in learners.values())}
    rows = []
    for k in sorted(learners, key=lambda s: (0, int(s)) if str(s).isdigit() else (1, str(s))):
        v = learners[k]
        row: dict[str, Any] = {"learner": _lid(k)}
        for c in columns:
            if c in dict_cols:
                row[c] = {str(kk): _int(vv) for kk, vv in (v.get(c) or {}).items()}
            else:
                row[c] = _int(v.get(c))
        rows.append(row)
    total: dict[str, Any] = {"learner": "total"}
    for c in columns:
        if c in dict_cols:
            acc: dict[str, int] = {}
            for r in rows:
                for kk, vv in r[c].items():
                    acc[kk] = acc.get(kk, 0) + (vv or 0)
            total[c] = acc
        else:
            total[c] = sum(r[c] or 0 for r in rows)
    for r in [*rows, total]:
        p, mg = r.get("processed"), r.get("merged")
        r["merged_pct"] = 100.0 * mg / p if p and mg is not None else None
    tol = fragments or 1
    violations = []
    identities = (
        ("processed", ("submitted", "not_submitted")),
        ("submitted", ("merged", "dropped", "pending")),
    )
    for r in rows:
        for lhs, parts in identities:
            vals = [r.get(c) for c in (lhs, *parts)]
            if any(x is None for x in vals):
                continue
            diff = vals[0] - sum(vals[1:])
            if abs(diff) > tol:
                violations.append({"learner": r["learner"], "identity": f"{lhs} = {' + '.join(parts)}",
                                   "difference": diff})
    return {"status": "ok", "columns": columns, "rows": rows, "total": total, "fragments": fragments,
            "tolerance": tol, "not_submitted_computed": computed, "identity_violations": violations}


def _curve_summary(rows: list[dict] | None) -> dict:
    if not rows:
        return {"status": NOT_RUN, "points": 0}
    pts = [r for r in rows if _num(r.get("val/loss")) is not None]
    if not pts:
        return {"status": "no loss values", "points": 0}
    last = pts[-1]
    return {
        "status": "ok",
        "points": len(pts),
        "final_tokens": _num(last.get("tokens")),
        "final_wall_s": _num(last.get("wall_s")),
        "final_loss": _num(last.get("val/loss")),
        "best_loss": min(_num(r["val/loss"]) for r in pts),
    }


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _loss_figure(
    curves: dict[str, list[dict]], x_key: str, xlabel: str, title: str,
    finals: dict[str, float | None] | None = None,
) -> Figure | None:
    """Held-out loss (nats/token) against ``x_key`` for each method with a curve; None if none.

    Points are ordered by ``x_key`` with a stable sort, so rows that share an x value keep their
    file order (the file's later row is the later measurement) and the last point drawn is the
    last row written at the largest x. The "final" label shows ``finals[m]`` (the value the
    tables use: the summary's ``final_val_loss``) when given, else that last point's loss.
    """
    finals = finals or {}
    series = {}
    for m in METHODS:
        pts = [
            (_num(r.get(x_key)), _num(r.get("val/loss")))
            for r in (curves.get(m) or [])
            if _num(r.get(x_key)) is not None and _num(r.get("val/loss")) is not None
        ]
        if pts:
            series[m] = sorted(pts, key=lambda xy: xy[0])  # stable: ties keep file order
    if not series:
        return None
    final = {}
    for m, pts in series.items():
        f = _num(finals.get(m))
        final[m] = f if f is not None and math.isfinite(f) else pts[-1][1]
    fig = Figure(figsize=(7.0, 4.5), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    order = sorted(series, key=lambda m: final[m])
    for m, pts in series.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", ms=3, lw=1.6, color=COLORS[m], label=LABELS[m])
        # Put the lower final value's label below its point and the higher one's above.
        below = len(order) > 1 and m == order[0]
        ax.annotate(
            f"final {final[m]:.4f}",
            xy=(xs[-1], final[m]),
            xytext=(-8, -14 if below else 10),
            textcoords="offset points",
            ha="right",
            va="top" if below else "bottom",
            fontsize=9,
            color=COLORS[m],
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
            arrowprops={"arrowstyle": "-", "color": COLORS[m], "lw": 0.8},
        )
    ax.margins(x=0.03, y=0.12)  # room for the annotations inside the frame
    ax.xaxis.set_major_formatter(EngFormatter(unit=""))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def _plot_loss(
    curves: dict[str, list[dict]], x_key: str, xlabel: str, title: str, path: Path,
    finals: dict[str, float | None] | None = None,
) -> bool:
    """:func:`_loss_figure` saved to ``path``. False (nothing written) if no method has a curve."""
    fig = _loss_figure(curves, x_key, xlabel, title, finals)
    if fig is None:
        return False
    fig.savefig(path)
    return True


def _plot_merges(merges: list[dict], failures: list[dict], path: Path) -> bool:
    """Merge events per fragment over time, with learner downtime marked. False if no merges."""
    pts = [(t, m) for m in merges if (t := _merge_time(m)) is not None]
    if not pts:
        return False
    frag_ids = sorted(
        {str(m.get("fragment")) for _, m in pts},
        key=lambda s: (0, int(s)) if s.isdigit() else (1, s),
    )
    ypos = {f: i for i, f in enumerate(frag_ids)}
    fig = Figure(figsize=(8.0, 1.6 + 0.55 * len(frag_ids)), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    sc = ax.scatter(
        [t for t, _ in pts],
        [ypos[str(m.get("fragment"))] for _, m in pts],
        c=[len(m.get("contributors") or []) for _, m in pts],
        cmap="viridis",
        marker="D",
        s=28,
        zorder=3,
        vmin=0,
    )
    cbar = fig.colorbar(sc, ax=ax, pad=0.01)
    cbar.set_label("contributing learners")
    cbar.locator = MaxNLocator(integer=True)
    cbar.update_ticks()
    t_end = max(t for t, _ in pts)
    for i, f in enumerate(failures):
        t0 = f["failed_at_s"]
        t1 = f["restarted_at_s"]
        ax.axvline(t0, color="tab:red", ls="--", lw=1.2, label="learner failure" if i == 0 else None)
        if t1 is not None:
            ax.axvline(t1, color="tab:green", ls="--", lw=1.2, label="learner restart" if i == 0 else None)
        ax.axvspan(t0, t1 if t1 is not None else max(t_end, t0), color="tab:red", alpha=0.08)
        ax.annotate(
            f"learner {f['learner']} down: {f['merges_while_down']} merges",
            xy=(t0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3 - 11 * (i % 3)),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color="tab:red",
        )
    ax.set_yticks(range(len(frag_ids)), [f"fragment {f}" for f in frag_ids])
    ax.set_ylim(-0.6, len(frag_ids) - 0.4 + 0.5)
    ax.set_xlabel("time since training start (s)")
    ax.set_title("DiLoCo merges per fragment over time")
    ax.grid(True, axis="x", alpha=0.3)
    if failures:
        fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    fig.savefig(path)
    return True


# --------------------------------------------------------------------------------------------
# Building the report
# --------------------------------------------------------------------------------------------


def _json_safe(x: Any) -> Any:
    """Non-finite floats become the strings "nan"/"inf"/"-inf" so report.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _method(
    run_dir: Path, m: str, curve_rows: list[dict] | None, notes: list[str]
) -> tuple[dict, dict | None]:
    """One method's figures (and its raw summary, or None when the method did not run)."""
    summary_path = run_dir / "pretrain" / m / "summary.json"
    eval_path = run_dir / "eval" / f"{m}.json"
    summary = _read_json(summary_path)
    raw_eval = _read_json(eval_path)
    curve = _curve_summary(curve_rows)
    out: dict[str, Any] = {
        "status": "ok" if summary is not None else NOT_RUN,
        "summary_file": str(summary_path.relative_to(run_dir)),
        "eval_status": "ok" if raw_eval is not None else NOT_RUN,
        "eval": _eval_metrics(raw_eval) if raw_eval is not None else {},
        "curve": curve,
        "hyperparameters": {},
    }
    for field, names in SUMMARY_FIELDS.items():
        out[field] = _num(_first(summary, names)) if summary is not None else None
    # The final held-out loss: the summary's, else the last point of the eval curve.
    if out["final_val_loss"] is None and curve.get("final_loss") is not None:
        out["final_val_loss"] = curve["final_loss"]
        out["final_val_loss_source"] = f"metrics/{m}_eval.jsonl (last row)"
    elif out["final_val_loss"] is not None:
        out["final_val_loss_source"] = out["summary_file"]
        cl = curve.get("final_loss")
        if cl is not None and not math.isclose(cl, out["final_val_loss"], rel_tol=1e-6, abs_tol=1e-9):
            notes.append(
                f"{LABELS[m]}: summary final loss {out['final_val_loss']:.6f} differs from the last "
                f"eval-curve point {cl:.6f}; the table uses the summary's."
            )
    else:
        out["final_val_loss_source"] = None
    out["final_val_ppl"] = _safe_exp(out["final_val_loss"])
    if summary is not None:
        hp = _first(summary, ("hyperparameters", "hparams"))
        out["hyperparameters"] = _flatten(hp) if isinstance(hp, dict) else {}
        # tokens/s from tokens and wall time when the summary leaves it out.
        if out["tokens_per_s"] is None and out["tokens"] and out["wall_s"]:
            out["tokens_per_s"] = out["tokens"] / out["wall_s"]
    return out, summary


def _comparison(methods: dict[str, dict]) -> list[dict]:
    """Rows of the side-by-side table: value per method (None = not recorded, "not run")."""

    rows: list[dict] = []

    def add(key: str, label: str, unit: str, fmt: str, from_eval: bool = False) -> None:
        row = {"key": key, "label": label, "unit": unit, "fmt": fmt}
        for m in METHODS:
            info = methods[m]
            if from_eval:
                row[m] = info["eval"].get(key) if info["eval_status"] == "ok" else NOT_RUN
            elif info["status"] == "ok" or info.get(key) is not None:
                row[m] = info.get(key)  # None: the summary did not record it ("—")
            else:
                row[m] = NOT_RUN
        rows.append(row)

    add("tokens", "training tokens", "tokens", "int")
    add("steps", "optimizer steps (DiLoCo: inner steps summed over learners)", "steps", "int")
    add("wall_s", "training wall time", "s", "{:.1f}")
    add("tokens_per_s", "throughput", "tokens/s", "{:,.0f}")
    if any(methods[m].get("goodput") is not None for m in METHODS):
        add("goodput", "goodput", "fraction", "{:.3f}")
    add("final_val_loss", "final held-out loss", "nats/token", "{:.4f}")
    add("final_val_ppl", "final held-out perplexity exp(loss)", "", "{:.3f}")
    known = [k for k, *_ in EVAL_METRICS]
    present = set().union(*(methods[m]["eval"].keys() for m in METHODS))
    for k, label, unit, fmt in EVAL_METRICS:
        if k in present or not present:
            add(k, label, unit, fmt, from_eval=True)
    for k in sorted(present - set(known) - {"eval_s"}):
        add(k, k, "", "{:.4f}", from_eval=True)
    add("eval_s", "lm-eval time", "s", "{:.1f}", from_eval=True)
    add("merges", "merges (DiLoCo)", "merges", "int")
    add("bytes_sent", "bytes to syncer / all-reduced (DP)", "bytes", "bytes")
    add("bytes_received", "bytes from syncer / all-reduced (DP)", "bytes", "bytes")
    add("params", "parameters", "", "int")
    add("flops_per_token", "training FLOPs per token", "FLOPs", "{:.4g}")
    return rows


def _setup(config: dict | None) -> dict:
    """A few config values a reader needs to read the tables (M, P, H, K, budgets, model size)."""
    if not config:
        return {}
    g = lambda *ks: _nested(config, ks)  # noqa: E731
    out = {
        "learners (M)": g("diloco", "learners"),
        "fragments (P)": g("diloco", "fragments"),
        "sync every (H, inner steps)": g("diloco", "sync_every"),
        "quorum (K)": g("diloco", "quorum"),
        "grace window (s)": g("diloco", "grace_s"),
        "merge rule": g("diloco", "merge"),
        "token budget per method (tokens)": g("train", "token_budget"),
        "sequence length (tokens)": g("data", "seq_len"),
        "learner batch (sequences)": g("diloco", "batch_size"),
        "model": " ".join(
            f"{k}={v}" for k in ("kind", "d_model", "n_layers", "n_heads", "d_ff")
            if (v := g("model", k)) is not None
        ) or None,
        "DP enabled": g("dp", "enabled"),
        "lm-eval enabled": g("eval", "enabled"),
        "injected failures": g("chaos", "failures"),
    }
    return {k: v for k, v in out.items() if v is not None}


def _nested(d: Any, keys: Iterable[str]) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _manifest_items(manifest: dict) -> list[list[str]]:
    """The manifest flattened to (key, short text) pairs; long lists are abbreviated."""
    items = []
    for k, v in _flatten(manifest).items():
        if isinstance(v, list):
            if len(v) <= 8 and all(not isinstance(x, (dict, list)) for x in v):
                text = ", ".join(str(x) for x in v) or "(none)"
            else:
                head = ", ".join(str(x) for x in v[:3])
                text = f"{len(v)} items: {head}, …"
        elif isinstance(v, int) and not isinstance(v, bool):
            text = f"{v:,}"
        else:
            text = str(v)
        items.append([k, text])
    return items


def build_report(run_dir: Path) -> dict:
    """Read one run directory, write ``RUN/report/`` (see the module docstring), return the report.

    The returned dict is exactly what ``report.json`` holds. Its main entries:
    ``run`` (name, run_dir, generated_at, git_commit, versions), ``methods`` (per method: status,
    tokens, steps, wall_s [s], tokens_per_s, final_val_loss [nats/token], final_val_ppl, eval
    metrics, merges, bytes_sent / bytes_received [bytes], params, flops_per_token, hyperparameters,
    curve summary), ``comparison`` (the side-by-side rows), ``loss_gap`` (DiLoCo's final held-out
    loss relative to DP's, in %), ``manifest``, ``ledger`` (tokens per learner), ``merges``,
    ``learners``, ``failures`` (downtime [s] and merges while down), ``plots`` (file names relative
    to ``report/``, or None when not drawn) and ``notes``.

    Raises :class:`ReportInputError` naming the path when ``run_dir`` does not exist or is not a
    run directory (neither ``config.json`` nor ``pretrain/``; nothing is written then), and naming
    the file when an input exists but is corrupt.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        raise ReportInputError(run_dir, f"{what}; {RUN_DIR_CONTENTS}")
    if not (run_dir / "config.json").is_file() and not (run_dir / "pretrain").is_dir():
        raise ReportInputError(
            run_dir, f"not a run directory (no config.json and no pretrain/ folder); {RUN_DIR_CONTENTS}"
        )
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []

    config = _read_json(run_dir / "config.json")
    manifest = _read_json(run_dir / "data" / "manifest.json")
    curves = {m: _read_jsonl(run_dir / "metrics" / f"{m}_eval.jsonl") for m in METHODS}
    merges = _read_jsonl(run_dir / "metrics" / "diloco_merges.jsonl")
    events = _read_jsonl(run_dir / "metrics" / "diloco_learners.jsonl")

    methods, summaries = {}, {}
    for m in METHODS:
        methods[m], summaries[m] = _method(run_dir, m, curves[m], notes)

    ld, lp = methods["diloco"]["final_val_loss"], methods["dp"]["final_val_loss"]
    if ld is not None and lp is not None and math.isfinite(ld) and math.isfinite(lp) and lp != 0:
        loss_gap = {
            "status": "ok",
            "diloco_loss": ld,
            "dp_loss": lp,
            "gap_pct": 100.0 * (ld - lp) / lp,
            "formula": "100 * (diloco_loss - dp_loss) / dp_loss",
        }
    else:
        missing = [LABELS[m] for m, v in (("diloco", ld), ("dp", lp)) if v is None]
        loss_gap = {
            "status": NOT_RUN if missing else "undefined",
            "missing": missing,
            "why": f"no final held-out loss for {' and '.join(missing)}" if missing
            else "a final held-out loss is not finite (or DP's is 0)",
        }

    failures = learner_failures(events or [], merges or [])
    hp_keys = sorted(set(methods["diloco"]["hyperparameters"]) | set(methods["dp"]["hyperparameters"]))
    hyper = [
        {
            "name": k,
            **{
                m: (methods[m]["hyperparameters"].get(k) if methods[m]["status"] == "ok" else NOT_RUN)
                for m in METHODS
            },
        }
        for k in hp_keys
    ]

    run_name = (config or {}).get("name") or run_dir.name
    report: dict[str, Any] = {
        "schema": 1,
        "run": {
            "name": run_name,
            "run_dir": str(run_dir.resolve()),
            "run_id": run_dir.name,
            "generated_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "git_commit": _git_commit(),
            "versions": _versions(),
        },
        "setup": _setup(config),
        "methods": methods,
        "comparison": _comparison(methods),
        "loss_gap": loss_gap,
        "hyperparameters": hyper,
        "manifest": {
            "status": "ok" if manifest is not None else NOT_RUN,
            "items": _manifest_items(manifest) if manifest is not None else [],
        },
        "ledger": _ledger(summaries["diloco"], _fragments(config, summaries["diloco"])),
        "merges": {"status": "ok" if merges is not None else NOT_RUN, **_merge_stats(merges or [])},
        "learners": {
            "status": "ok" if events is not None else NOT_RUN,
            "rows": _learner_table(events or []),
        },
        "failures": failures,
        "plots": {},
        "notes": notes,
        "config": config,
    }

    plots = report["plots"]
    for name in ("loss_vs_tokens", "loss_vs_time", "merges_over_time"):
        (out_dir / f"{name}.png").unlink(missing_ok=True)  # never leave a stale plot from an old build
    finals = {m: methods[m]["final_val_loss"] for m in METHODS}  # the tables' final loss
    plots["loss_vs_tokens"] = "loss_vs_tokens.png" if _plot_loss(
        curves, "tokens", "training tokens (all learners)", "Held-out loss vs tokens",
        out_dir / "loss_vs_tokens.png", finals,
    ) else None
    plots["loss_vs_time"] = "loss_vs_time.png" if _plot_loss(
        curves, "wall_s", "wall-clock time since training start (s)", "Held-out loss vs wall-clock time",
        out_dir / "loss_vs_time.png", finals,
    ) else None
    plots["merges_over_time"] = "merges_over_time.png" if _plot_merges(
        merges or [], failures, out_dir / "merges_over_time.png"
    ) else None

    # What is on disk is what is returned: round-trip through strict JSON once.
    report = json.loads(json.dumps(_json_safe(report), allow_nan=False))
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    (out_dir / "report.md").write_text(render_markdown(report))
    return report


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def format_value(v: Any, fmt: str = "") -> str:
    """A table cell: ``None`` → "—", strings as is, ints with thousands separators,
    ``fmt == "bytes"`` → "12,345,678 (11.8 MiB)", otherwise ``fmt.format(v)``."""
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(", ", ": "))
    if fmt == "bytes":
        n, unit = float(v), "B"
        for u in ("KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024:
                break
            n, unit = n / 1024, u
        return f"{int(v):,}" + (f" ({n:.1f} {unit})" if unit != "B" else "")
    if fmt == "int" or (isinstance(v, int) and not fmt):
        return f"{int(round(v)):,}"
    if fmt:
        try:
            return fmt.format(v)
        except (ValueError, TypeError):
            return str(v)
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _cell_text(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell_text(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _bytes_or_missing(mg: dict, key: str) -> str:
    """A merge-log byte total, or "not recorded" when (some) merge records lack the field."""
    if mg.get(key) is not None:
        return format_value(mg[key], "bytes")
    n, of = mg.get(f"{key}_recorded", 0), mg.get("count", 0)
    return "not recorded" + (f" (in {n} of {of} merge records)" if n else "")


def render_markdown(report: dict) -> str:
    """The ``report.md`` text for a report dict from :func:`build_report` (pure)."""
    run, methods = report["run"], report["methods"]
    L: list[str] = []
    L.append(f"# Run report: {run['name']}")
    L.append("")
    L.append(f"{PAPER} compared with a data-parallel baseline on the same data and token budget.")
    L.append("")
    vers = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    L.append(f"- run directory: `{run['run_dir']}`")
    L.append(f"- generated: {run['generated_at']}")
    L.append(f"- git commit: `{run['git_commit']}`")
    L.append(f"- versions: {vers}")
    for m in METHODS:
        if methods[m]["status"] != "ok":
            L.append(f"- {LABELS[m]} pretraining: **{NOT_RUN}**")
        if methods[m]["eval_status"] != "ok":
            L.append(f"- {LABELS[m]} lm-eval: **{NOT_RUN}**")
    L.append("")

    if report.get("setup"):
        L.append("## Setup")
        L.append("")
        L.append(_table(["setting", "value"], [[k, format_value(v)] for k, v in report["setup"].items()]))
        L.append("")

    L.append("## DiLoCo vs data-parallel")
    L.append("")
    rows = []
    for r in report["comparison"]:
        label = r["label"] + (f" ({r['unit']})" if r["unit"] else "")
        rows.append([label] + [format_value(r[m], r["fmt"]) for m in METHODS])
    L.append(_table(["metric", LABELS["diloco"], LABELS["dp"]], rows))
    L.append("")
    L.append("Loss is the mean next-token cross entropy on the same held-out batches for both methods "
             "(nats/token; DiLoCo measured on the syncer's global parameters). Bytes are payload bytes "
             "as each method recorded them: DiLoCo learner→syncer and syncer→learner; DP the all-reduced "
             "gradient bytes.")
    L.append("")
    gap = report["loss_gap"]
    if gap["status"] == "ok":
        L.append(
            f"**Loss gap:** DiLoCo's final held-out loss is {gap['gap_pct']:+.2f}% relative to DP's "
            f"(100 × ({gap['diloco_loss']:.4f} − {gap['dp_loss']:.4f}) / {gap['dp_loss']:.4f}); "
            "negative means DiLoCo is better."
        )
    else:
        L.append(f"**Loss gap:** {gap['status']} ({gap['why']}).")
    L.append("")

    L.append("## Held-out loss curves")
    L.append("")
    for key, alt in (("loss_vs_tokens", "held-out loss vs training tokens"),
                     ("loss_vs_time", "held-out loss vs wall-clock seconds")):
        p = report["plots"].get(key)
        L.append(f"![{alt}]({p})" if p else f"*{alt}: {NOT_RUN} (no eval curve).*")
        L.append("")
    crow = [[LABELS[m], c.get("points", 0), format_value(c.get("final_tokens"), "int"),
             format_value(c.get("final_wall_s"), "{:.1f}"), format_value(c.get("final_loss"), "{:.4f}"),
             format_value(c.get("best_loss"), "{:.4f}")]
            for m in METHODS for c in [methods[m]["curve"]]]
    L.append(_table(["method", "points", "last tokens", "last wall (s)", "last loss (nats)", "best loss (nats)"], crow))
    L.append("")

    L.append("## Hyperparameters")
    L.append("")
    if report["hyperparameters"]:
        L.append(_table(["hyperparameter", LABELS["diloco"], LABELS["dp"]],
                        [[h["name"], format_value(h["diloco"]), format_value(h["dp"])]
                         for h in report["hyperparameters"]]))
    else:
        L.append(f"*{NOT_RUN}: no method summary recorded hyperparameters.*")
    L.append("")

    L.append("## Data")
    L.append("")
    man = report["manifest"]
    if man["status"] == "ok":
        L.append(_table(["manifest field", "value"], man["items"]))
    else:
        L.append(f"*data manifest: {NOT_RUN}.*")
    L.append("")

    L.append("## DiLoCo token ledger (tokens per learner)")
    L.append("")
    led = report["ledger"]
    if led["status"] == "ok":
        cols = led["columns"]
        def _lcell(v: Any) -> str:
            if isinstance(v, dict):
                return "; ".join(f"{k}: {format_value(x, 'int')}" for k, x in v.items()) or "—"
            return format_value(v, "int")

        rows = [[r["learner"]] + [_lcell(r[c]) for c in cols] + [format_value(r["merged_pct"], "{:.1f}")]
                for r in [*led["rows"], led["total"]]]
        L.append(_table(["learner"] + cols + ["merged % of processed"], rows))
        L.append("")
        p = led.get("fragments")
        tol = f"±{led['tolerance']} tokens (P = {p})" if p else f"±{led['tolerance']} token"
        L.append(
            "Tokens per learner: processed = trained on, submitted = sent to the syncer, not_submitted "
            "= processed but never sent (progress overwritten when a newer global fragment arrived, or "
            "still local at stop"
            + ("; computed here as processed − submitted, as this summary does not record it"
               if led.get("not_submitted_computed") else "")
            + "), merged = in a merged global fragment, dropped = rejected by the syncer (drop_reasons "
            "by reason), pending = submitted but not yet merged at stop, attempts = task attempts; "
            "the syncer's counts are averaged over the P fragments and rounded, and per learner "
            f"processed = submitted + not_submitted and submitted = merged + dropped + pending hold "
            f"within {tol}."
        )
        for v in led.get("identity_violations") or []:
            L.append("")
            L.append(f"**Ledger check failed:** learner {v['learner']}: {v['identity']} is off by "
                     f"{v['difference']:+,} tokens (more than {tol}).")
    else:
        L.append(f"*token ledger: {led['status']}.*")
    L.append("")

    L.append("## Merges and learner failures")
    L.append("")
    mg = report["merges"]
    if mg["status"] == "ok":
        by = ", ".join(f"fragment {k}: {v}" for k, v in mg["by_fragment"].items()) or "none"
        L.append(
            f"{mg['count']} merges ({by}); mean contributors per merge "
            f"{format_value(mg['mean_contributors'], '{:.2f}')}; stale contributions "
            f"{mg['stale_contributions']}; bytes into merges (learner submissions merged) "
            f"{_bytes_or_missing(mg, 'bytes_in')}, bytes out (syncer publishes: fragment bytes × "
            f"learners) {_bytes_or_missing(mg, 'bytes_out')}; from "
            f"{format_value(mg['first_s'], '{:.1f}')} s to {format_value(mg['last_s'], '{:.1f}')} s."
        )
    else:
        L.append(f"*merge log: {NOT_RUN}.*")
    L.append("")
    lt = report["learners"]
    if lt["status"] == "ok" and lt["rows"]:
        L.append(_table(["learner", "starts", "failures", "dropped submissions", "last step", "ended by"],
                        [[r["learner"], r["starts"], r["failures"], r["dropped_submissions"],
                          format_value(r["last_step"]), format_value(r["ended"])] for r in lt["rows"]]))
        L.append("")
    if report["failures"]:
        rows = []
        for f in report["failures"]:
            rows.append([
                f["learner"], format_value(f["attempt"]), format_value(f["failed_at_s"], "{:.1f}"),
                format_value(f["failed_at_step"]), format_value(f["reason"]),
                format_value(f["restarted_at_s"], "{:.1f}") if f["restarted_at_s"] is not None else "never",
                format_value(f["downtime_s"], "{:.1f}"), f["merges_while_down"],
                ", ".join(f"{k}: {v}" for k, v in f["merges_while_down_by_fragment"].items()) or "—",
                f["merges_while_down_with_learner"],
                "yes" if f["merged_again_after_restart"] else "no",
            ])
        L.append(_table(
            ["learner", "attempt", "failed at (s)", "at step", "reason", "restarted at (s)", "down for (s)",
             "merges while down", "by fragment", "…of which with its earlier submissions",
             "its submissions merged after restart"],
            rows,
        ))
        L.append("")
        L.append("Merges while down count every merge the syncer made between the failure and the "
                 "learner's next start (seconds since training start), i.e. training that continued "
                 "without it.")
    elif lt["status"] == "ok":
        L.append("No learner failures.")
    else:
        L.append(f"*learner events: {NOT_RUN}.*")
    L.append("")
    if report["plots"].get("merges_over_time"):
        L.append(f"![merges per fragment over time]({report['plots']['merges_over_time']})")
        L.append("")

    if report["notes"]:
        L.append("## Notes")
        L.append("")
        L += [f"- {n}" for n in report["notes"]]
        L.append("")
    return "\n".join(L)


# --------------------------------------------------------------------------------------------
# Prefect artifacts
# --------------------------------------------------------------------------------------------


def artifact_key(prefix: str, name: str) -> str:
    """``<prefix>-<slug>``: lowercase letters, digits and dashes only (Prefect's rule for keys)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"
    return re.sub(r"-+", "-", f"{prefix}-{slug}")


def publish_report_artifacts(report: dict, run_dir: Path) -> None:
    """Publish the report to Prefect: the markdown, the comparison table and the token ledger.

    Must be called inside a Prefect flow or task run (it raises ``RuntimeError`` otherwise), so the
    artifacts attach to that run. Keys are ``report-<slug>``, ``comparison-<slug>`` and
    ``ledger-<slug>`` with ``<slug>`` the run name (``config.name``) in lowercase letters, digits and
    dashes: repeated runs of one experiment become versions of the same keyed artifacts, and each
    description names the run directory. Images are not uploaded; the markdown artifact lists the
    plots' file paths instead.
    """
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        raise RuntimeError("publish_report_artifacts must be called inside a Prefect flow or task run")
    run_dir = Path(run_dir)
    out_dir = (run_dir / "report").resolve()
    md_path = run_dir / "report" / "report.md"
    markdown = md_path.read_text() if md_path.is_file() else render_markdown(report)
    markdown = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", lambda m: f"*{m[1]}*: `{out_dir / m[2]}`", markdown)
    name = report["run"]["name"]
    where = f"run directory {report['run']['run_dir']}"
    create_markdown_artifact(markdown, key=artifact_key("report", name), description=f"DiLoCo vs DP report, {where}")
    table = [
        {
            "metric": r["label"] + (f" ({r['unit']})" if r["unit"] else ""),
            "diloco": format_value(r["diloco"], r["fmt"]),
            "dp": format_value(r["dp"], r["fmt"]),
        }
        for r in report["comparison"]
    ]
    gap = report["loss_gap"]
    table.append({
        "metric": "loss gap DiLoCo vs DP (%)",
        "diloco": f"{gap['gap_pct']:+.2f}" if gap["status"] == "ok" else gap["status"],
        "dp": "",
    })
    create_table_artifact(table, key=artifact_key("comparison", name), description=f"DiLoCo vs DP, {where}")
    led = report["ledger"]
    if led["status"] == "ok":
        rows = [
            {
                "learner": str(r["learner"]),
                **{c: (json.dumps(r[c]) if isinstance(r[c], dict) else r[c]) for c in led["columns"]},
                "merged_pct": r["merged_pct"],
            }
            for r in [*led["rows"], led["total"]]
        ]
        create_table_artifact(rows, key=artifact_key("ledger", name),
                              description=f"DiLoCo token ledger per learner (tokens), {where}")
