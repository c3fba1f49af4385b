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
    The human report: header (run name, date, git commit, package versions), right under the
    title a bold line when the pipeline was interrupted or failed (``status.json``) and when
    DiLoCo's lost work crossed a threshold (``work_lost`` in its summary); then the side-by-side
    table, the loss gap, the lm-eval table (accuracies "0.412 ± 0.035 (chance 0.25)", truncated
    requests), the bytes on the wire (each byte figure named by what it counts and who counts it),
    hyperparameters, data manifest, token ledger and lost work, the scheduled chaos events and
    whether each fired, learner failures and the merges that happened while a learner was down,
    and the plots (embedded by relative path).
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

Units used throughout: tokens (counts of BPE tokens), seconds (wall clock), bytes (payload bytes,
see ``report_render.BYTES_CONVENTION`` for who counts what), nats (natural-log cross entropy;
perplexity = exp(loss)).

Every figure is computed once, in one function, from one named source (the contract's field
names; no aliases); every place of ``report.md`` that shows it reads that one value of the report
dict (rendering lives in ``evals/report_render.py`` and computes nothing).

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

from evals.report_render import (  # noqa: F401  (format_value, render_markdown: public here too)
    BYTES_CONVENTION,
    LABELS,
    METHODS,
    NOT_RUN,
    PAPER,
    STALE_DEFINITION,
    format_value,
    render_markdown,
    row_cell,
    row_label,
)

COLORS = {"diloco": "tab:blue", "dp": "tab:orange"}
PACKAGES = ("jax", "flax", "optax", "prefect", "lm_eval")

# lm-eval metric names → (label, unit, format); tasks are discovered from the eval keys
# ("<task>/<metric>"), these only name and order the metrics we know.
EVAL_METRIC_NAMES: dict[str, tuple[str, str, str]] = {
    "word_perplexity": ("word perplexity", "", "{:.3f}"),
    "byte_perplexity": ("byte perplexity", "", "{:.4f}"),
    "bits_per_byte": ("bits per byte", "bits/byte", "{:.4f}"),
    "perplexity": ("perplexity", "", "{:.3f}"),
    "acc": ("accuracy", "fraction", "{:.3f}"),
    "acc_norm": ("accuracy (length-normalised)", "fraction", "{:.3f}"),
    "passages": ("passages", "passages", "int"),
    "questions": ("questions", "questions", "int"),
}
EVAL_TASK_ORDER = ("heldout_ppl", "heldout_nextline")  # first, then any other task, sorted
CHANCE_METRICS = ("acc", "acc_norm")  # shown with "(chance c)" when "<task>/chance" exists
# Keys of the eval dict that are not "<task>/<metric>": (key, label, unit, format).
EVAL_RUN_KEYS = (
    ("checkpoint_tokens", "tokens in the evaluated checkpoint", "tokens", "int"),
    ("truncated_requests", "truncated requests (contexts cut to fit the window)", "requests", "int"),
    ("eval_s", "lm-eval time", "s", "{:.1f}"),
)
# Summary fields read as numbers (the contract's names, docs/contracts.md "Summaries").
SUMMARY_FIELDS = ("tokens", "steps", "wall_s", "tokens_per_s", "final_val_loss", "params",
                  "flops_per_token", "goodput")
INJECTED = "InjectedFailure"  # diloco.runtime's exception for a scheduled (chaos) failure
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
    to ``task/metric`` (standard errors kept as ``task/metric_stderr``; aliases and non-numbers
    such as "N/A" dropped)."""
    if isinstance(raw.get("results"), dict):
        flat: dict[str, float] = {}
        for task, metrics in raw["results"].items():
            if not isinstance(metrics, dict):
                continue
            for k, v in metrics.items():
                metric, _, filt = k.partition(",")
                if _num(v) is None:
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
    """When the merge took effect: ``merged_at_s``, seconds since training start."""
    return _num(m.get("merged_at_s"))


def _event_time(e: dict) -> float | None:
    """A learner event's ``t``: seconds since training start."""
    return _num(e.get("t"))


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
                "restart_event": restart.get("event") if restart else None,
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


def _stale_versions(x: Any) -> int:
    """A merge record's ``stale`` entry as versions behind (``True`` from older logs counts as 1)."""
    v = _num(x) if not isinstance(x, bool) else int(x)
    return int(v) if v is not None and math.isfinite(v) else 0


def _merge_stats(merges: list[dict] | None, summary: dict | None, notes: list[str]) -> dict:
    """The merge figures, once: counts from the merge log (the syncer's one line per merge), else
    the DiLoCo summary's ``merges`` (status "from summary"). A summary count that disagrees with
    the log is a note; the log's count is the one shown everywhere.

    ``contributions`` counts (merge, contributor) pairs; ``stale_contributions`` those with
    ``stale`` > 0 (merged into a version newer than the one they were based on) and
    ``max_stale_versions`` the largest ``stale``. Byte totals are in :func:`_byte_figures`."""
    summary_count = _num((summary or {}).get("merges"))
    if merges is None:
        status = "from summary" if summary_count is not None else NOT_RUN
        return {"status": status, "count": int(summary_count) if summary_count is not None else None,
                "source": "pretrain/diloco/summary.json (merges)" if summary_count is not None else None,
                "by_fragment": {}, "contributions": 0, "mean_contributors": None, "stale_contributions": 0,
                "max_stale_versions": None, "first_s": None, "last_s": None}
    by_frag: dict[str, int] = {}
    contributors, stale = [], []
    for m in merges:
        k = str(m.get("fragment"))
        by_frag[k] = by_frag.get(k, 0) + 1
        contributors.append(len(m.get("contributors") or []))
        stale += [_stale_versions(x) for x in (m.get("stale") or [])]
    times = [t for m in merges if (t := _merge_time(m)) is not None]
    if summary_count is not None and summary_count != len(merges):
        notes.append(f"DiLoCo summary says {int(summary_count)} merges but the merge log has {len(merges)} "
                     "lines; the report counts the merge log.")
    return {
        "status": "ok",
        "count": len(merges),
        "source": "metrics/diloco_merges.jsonl",
        "by_fragment": dict(sorted(by_frag.items(), key=lambda kv: _sort_key(kv[0]))),
        "contributions": sum(contributors),
        "mean_contributors": sum(contributors) / len(contributors) if contributors else None,
        "stale_contributions": sum(1 for x in stale if x > 0),
        "max_stale_versions": max(stale) if stale else None,
        "first_s": min(times) if times else None,
        "last_s": max(times) if times else None,
    }


def _sort_key(k: Any) -> tuple:
    s = str(k)
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


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
        p = _num(_nested(summary, ("hyperparameters", "fragments (P)")))
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


def _div(x: float | int | None, n: int | None) -> float | int | None:
    """x / n, an int when it divides evenly; None when either is missing."""
    if x is None or not n:
        return None
    return int(x) // n if float(x).is_integer() and int(x) % n == 0 else x / n


def _learner_count(config: dict | None, summary: dict | None) -> int | None:
    """M: ``diloco.learners`` from config.json, else the DiLoCo summary's hyperparameter."""
    m = _num(_nested(config, ("diloco", "learners")))
    if m is None:
        m = _num(_nested(summary, ("hyperparameters", "learners (M)")))
    return int(m) if m else None


def _byte_figures(config: dict | None, summaries: dict[str, dict | None], merges: list[dict] | None,
                  notes: list[str]) -> dict:
    """Every byte figure of the report, computed once (report.json ``bytes``; the tables and the
    merges section read these values).

    DiLoCo (``diloco``): ``sent`` = learner→syncer submission payload bytes (summary
    ``bytes_to_syncer``: every submission of every learner and attempt, merged, dropped or
    pending); ``received`` = syncer→learner pulled bytes (summary ``bytes_from_syncer``);
    ``merged_in`` / ``published_out`` = the merge log's ``bytes_in`` / ``bytes_out`` summed (None
    unless every record has the field; ``*_recorded`` says in how many it is).

    DP (``dp``): the ring all-reduce of the gradient, all workers: ``sent`` = summary
    ``bytes_to_syncer``, ``received`` = ``bytes_from_syncer`` and ``total`` = their sum, which is
    ``allreduce_bytes`` (half sent, half received). A summary with only ``allreduce_bytes`` is split
    evenly. Per-learner/worker figures are the totals divided by M.
    """
    out: dict[str, Any] = {"definitions": BYTES_CONVENTION}
    d = summaries.get("diloco")
    M = _learner_count(config, d)
    sent = _num(d.get("bytes_to_syncer")) if d else None
    received = _num(d.get("bytes_from_syncer")) if d else None
    fig: dict[str, Any] = {
        "status": "ok" if d is not None else NOT_RUN,
        "learners": M,
        "sent": sent,
        "received": received,
        "total": sent + received if sent is not None and received is not None else None,
        "sent_per_learner": _div(sent, M),
        "received_per_learner": _div(received, M),
        "merge_records": len(merges or []),
    }
    for key, field in (("merged_in", "bytes_in"), ("published_out", "bytes_out")):
        vals = [v for m in (merges or []) if (v := _num(m.get(field))) is not None]
        fig[key] = sum(vals) if merges and len(vals) == len(merges) else None
        fig[f"{key}_recorded"] = len(vals)
    fig["merged_in_source"] = "metrics/diloco_merges.jsonl (bytes_in)" if merges else None
    summary_merged = _num(d.get("bytes_merged")) if d else None
    if merges is None and summary_merged is not None:
        fig["merged_in"], fig["merged_in_source"] = summary_merged, "pretrain/diloco/summary.json (bytes_merged)"
    elif summary_merged is not None and fig["merged_in"] is not None and summary_merged != fig["merged_in"]:
        notes.append(f"DiLoCo summary bytes_merged {int(summary_merged):,} differs from the merge log's "
                     f"bytes_in total {int(fig['merged_in']):,}; the report shows the merge log's.")
    out["diloco"] = fig

    p = summaries.get("dp")
    W = _num(_nested(p, ("hyperparameters", "simulated workers"))) or M
    W = int(W) if W else None
    sent = _num(p.get("bytes_to_syncer")) if p else None
    received = _num(p.get("bytes_from_syncer")) if p else None
    allreduce = _num(p.get("allreduce_bytes")) if p else None
    if sent is None and received is None and allreduce is not None:
        sent = received = _div(allreduce, 2)
    total = sent + received if sent is not None and received is not None else allreduce
    if allreduce is not None and total is not None and total != allreduce:
        notes.append(f"DP summary allreduce_bytes {int(allreduce):,} is not bytes_to_syncer + "
                     f"bytes_from_syncer = {int(total):,} (a summary written before allreduce_bytes "
                     "counted both directions); the report shows the sent and received fields.")
    out["dp"] = {
        "status": "ok" if p is not None else NOT_RUN,
        "workers": W,
        "sent": sent,
        "received": received,
        "total": total,
        "sent_per_worker": _div(sent, W),
        "received_per_worker": _div(received, W),
    }
    return out


def _injected_at(reason: Any, at_step: Any) -> bool:
    """Is ``reason`` the injected (chaos) failure at local step ``at_step``?"""
    r = str(reason or "")
    return INJECTED in r and re.search(rf"at local step {int(at_step)}(?!\d)", r) is not None


def _chaos(config: dict | None, events: list[dict] | None, failures: list[dict]) -> dict:
    """The scheduled failures (config ``chaos.failures``) and whether each fired.

    A scheduled ``{"learner": m, "at_step": s}`` fired when a ``failure`` event of learner m has a
    reason with ``InjectedFailure`` and ``at local step s``; ``fired_at_s`` is that event's t,
    ``rejoined_at_s`` the t of the learner's next ``start`` (a later attempt), None when it never
    started again. ``fired`` is None when there is no learners log to tell.
    """
    if config is None:
        return {"status": NOT_RUN + " (no config.json)", "rows": []}
    scheduled = _nested(config, ("chaos", "failures")) or []
    last_step: dict[Any, int] = {}
    for e in events or []:
        s = _num(e.get("step"))
        if e.get("learner") is not None and s is not None:
            lid = _lid(e["learner"])
            last_step[lid] = max(last_step.get(lid, 0), int(s))
    used: set[int] = set()
    rows = []
    for spec in scheduled:
        if not isinstance(spec, dict):
            continue
        lid, at = _lid(spec.get("learner")), _num(spec.get("at_step"))
        row: dict[str, Any] = {"learner": lid, "at_step": at,
                               "event": f"learner {lid} fails at local step {format_value(at)}",
                               "fired": None, "fired_at_s": None, "failed_attempt": None,
                               "rejoined_at_s": None, "rejoin_attempt": None, "note": None}
        if events is not None and at is not None:
            hit = next((i for i, f in enumerate(failures) if i not in used and f["learner"] == lid
                        and _injected_at(f["reason"], at)), None)
            row["fired"] = hit is not None
            if hit is not None:
                used.add(hit)
                f = failures[hit]
                row["fired_at_s"], row["failed_attempt"] = f["failed_at_s"], f["attempt"]
                if f.get("restart_event") == "start":
                    row["rejoined_at_s"], row["rejoin_attempt"] = f["restarted_at_s"], f["restart_attempt"]
                else:
                    row["note"] = "no later attempt started"
            else:
                seen = last_step.get(lid)
                row["note"] = (f"learner {lid}'s last logged step: {seen}" if seen is not None
                               else f"no events of learner {lid} logged")
        rows.append(row)
    return {"status": "ok", "rows": rows,
            "unscheduled_failures": sum(1 for i in range(len(failures)) if i not in used)}


def _work_lost(summary: dict | None, ledger: dict) -> dict | None:
    """DiLoCo's lost work (summary ``work_lost``; None when the summary has none: older runs).

    Drop reasons (tokens) come from ``work_lost.reasons`` when the summary has it, else from the
    ledger's total ``drop_reasons``; shown as fractions of the processed tokens. ``headline`` is
    the bold line at the top of report.md when status is not ok.
    """
    raw = (summary or {}).get("work_lost")
    if not isinstance(raw, dict):
        return None
    wl = {k: _num(raw.get(k)) for k in ("processed_tokens", "dropped_tokens", "dropped_fraction",
                                        "warn_above", "fail_above")}
    wl["status"] = str(raw.get("status") or "unknown")
    reasons = raw.get("reasons")
    if not isinstance(reasons, dict):
        reasons = (ledger.get("total") or {}).get("drop_reasons") if ledger.get("status") == "ok" else None
    reasons = {str(k): n for k, v in (reasons or {}).items() if (n := _num(v))}
    processed = wl["processed_tokens"]
    wl["drop_reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    wl["drop_reason_fractions"] = {k: v / processed for k, v in wl["drop_reasons"].items()} if processed else {}
    wl["headline"] = None
    frac = wl["dropped_fraction"]
    if wl["status"] != "ok" and frac is not None:
        why = ", ".join(f"{k} {100 * x:.1f} %" for k, x in wl["drop_reason_fractions"].items())
        counts = (f" ({int(wl['dropped_tokens']):,} of {int(processed):,})"
                  if wl["dropped_tokens"] is not None and processed is not None else "")
        warn = f"diloco.warn_dropped_fraction = {wl['warn_above']:g}" if wl["warn_above"] is not None else None
        fail = f"diloco.max_dropped_fraction = {wl['fail_above']:g}" if wl["fail_above"] is not None else None
        if wl["status"] == "failed":
            verdict = f"this run failed its {fail or 'diloco.max_dropped_fraction'} check" + (
                f" (warning above {warn})" if warn else "")
        else:
            verdict = f"above {warn or 'diloco.warn_dropped_fraction'}" + (
                f"; the run fails above {fail}" if fail else "")
        wl["headline"] = (f"**Warning: {100 * frac:.1f} % of DiLoCo's processed tokens{counts} were dropped"
                          + (f" ({why})" if why else "") + f"; {verdict}.**")
    return wl


def _pipeline_status(raw: dict | None) -> dict | None:
    """``status.json`` (None when absent); ``headline`` is the bold top line when the pipeline was
    interrupted or failed."""
    if raw is None:
        return None
    stages = raw.get("completed_stages")
    stages = [str(s) for s in stages] if isinstance(stages, list) else []
    out = {"status": str(raw.get("status") or "unknown"), "completed_stages": stages,
           "reason": str(raw["reason"]) if raw.get("reason") else None, "headline": None}
    done = ", ".join(stages) or "none"
    why = f" ({out['reason']})" if out["reason"] else ""
    if out["status"] == "interrupted":
        out["headline"] = (f"**Interrupted: this run stopped before it finished{why}; completed stages: "
                           f"{done}. Figures of the stages that did not complete are missing below.**")
    elif out["status"] == "failed":
        out["headline"] = f"**Failed: the pipeline failed{why}; completed stages: {done}.**"
    return out


def _eval_rows(methods: dict[str, dict], notes: list[str]) -> list[dict]:
    """The lm-eval table rows, discovered from the eval keys: ``<task>/<metric>`` (tasks in
    EVAL_TASK_ORDER first, then sorted; metrics in EVAL_METRIC_NAMES order, then sorted), then the
    run-level keys (checkpoint tokens, truncated requests, eval time). Each row carries the
    per-method ``stderr`` (from ``<key>_stderr``) and, for accuracies, the task's ``chance``."""
    evals = {m: methods[m]["eval"] for m in METHODS}
    ran = {m: methods[m]["eval_status"] == "ok" for m in METHODS}
    keys = set().union(*(e.keys() for e in evals.values()))
    run_keys = {k for k, *_ in EVAL_RUN_KEYS}
    metric_keys = [k for k in keys if "/" in k and not k.endswith("_stderr") and not k.endswith("/chance")]
    known = list(EVAL_METRIC_NAMES)

    def order(k: str) -> tuple:
        task, metric = k.split("/", 1)
        t = EVAL_TASK_ORDER.index(task) if task in EVAL_TASK_ORDER else len(EVAL_TASK_ORDER)
        mi = known.index(metric) if metric in known else len(known)
        return (t, task, mi, metric)

    rows: list[dict] = []

    def add(key: str, label: str, unit: str, fmt: str, chance: float | None = None) -> None:
        row = {"key": key, "label": label, "unit": unit, "fmt": fmt, "group": "eval",
               "stderr": {}, "chance": chance}
        for m in METHODS:
            row[m] = evals[m].get(key) if ran[m] else NOT_RUN
            row["stderr"][m] = evals[m].get(f"{key}_stderr") if ran[m] else None
        rows.append(row)

    for k in sorted(metric_keys, key=order):
        task, metric = k.split("/", 1)
        label, unit, fmt = EVAL_METRIC_NAMES.get(metric, (metric, "", "{:.4f}"))
        chance = None
        if metric in CHANCE_METRICS:
            found = {m: evals[m][f"{task}/chance"] for m in METHODS if f"{task}/chance" in evals[m]}
            chance = found.get("diloco", found.get("dp"))
            if len(set(found.values())) > 1:
                notes.append(f"{task}: chance accuracy differs between the methods' evals "
                             f"({found}); the table shows DiLoCo's.")
        add(k, f"{task}: {label}", unit, fmt, chance)
    for k, label, unit, fmt in EVAL_RUN_KEYS:
        if k in keys:
            add(k, label, unit, fmt)
    for k in sorted(keys - run_keys - set(metric_keys)):
        if "/" not in k and not k.endswith("_stderr"):
            add(k, k, "", "{:.4f}")
    return rows


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
        "interrupted": bool(summary.get("interrupted")) if summary is not None else None,
        "summary_file": str(summary_path.relative_to(run_dir)),
        "eval_status": "ok" if raw_eval is not None else NOT_RUN,
        "eval": _eval_metrics(raw_eval) if raw_eval is not None else {},
        "curve": curve,
        "hyperparameters": {},
    }
    for field in SUMMARY_FIELDS:
        out[field] = _num(summary.get(field)) if summary is not None else None
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
        hp = summary.get("hyperparameters")
        out["hyperparameters"] = _flatten(hp) if isinstance(hp, dict) else {}
        # tokens/s from tokens and wall time when the summary leaves it out.
        if out["tokens_per_s"] is None and out["tokens"] and out["wall_s"]:
            out["tokens_per_s"] = out["tokens"] / out["wall_s"]
    return out, summary


def _comparison(methods: dict[str, dict], merges: dict, byte_figs: dict, eval_rows: list[dict]) -> list[dict]:
    """Rows of the side-by-side tables (value per method; None = not recorded, "not run"), each
    with a ``group``: "training" (the comparison table), "eval" (:func:`_eval_rows`) and "bytes"
    (read from ``byte_figs``, the one computation of every byte figure)."""

    rows: list[dict] = []

    def add(key: str, label: str, unit: str, fmt: str, values: dict | None = None) -> None:
        row = {"key": key, "label": label, "unit": unit, "fmt": fmt, "group": "training"}
        for m in METHODS:
            info = methods[m]
            if values is not None:
                row[m] = values[m]
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
    add("merges", "merges (DiLoCo)", "merges", "int", {
        "diloco": merges["count"] if merges["count"] is not None or methods["diloco"]["status"] == "ok" else NOT_RUN,
        "dp": None if methods["dp"]["status"] == "ok" else NOT_RUN,
    })
    add("params", "parameters", "", "int")
    add("flops_per_token", "training FLOPs per token", "FLOPs", "{:.4g}")
    rows += eval_rows

    d, p = byte_figs["diloco"], byte_figs["dp"]

    def val(fig: dict, key: str) -> Any:
        return fig.get(key) if fig["status"] == "ok" else NOT_RUN

    no_syncer = "n/a (no syncer)"
    both = "learners (DiLoCo) / ring model (DP)"
    for key, label, by, dk, pk in (
        ("bytes_sent", "bytes sent, all learners/workers (DiLoCo: learner→syncer submission payloads; "
         "DP: ring all-reduce sends)", both, "sent", "sent"),
        ("bytes_received", "bytes received, all learners/workers (DiLoCo: syncer→learner pulled "
         "fragments; DP: ring all-reduce receives)", both, "received", "received"),
        ("bytes_total", "bytes sent + received, all learners/workers (DP: the all-reduce bytes)", both,
         "total", "total"),
        ("bytes_sent_per_worker", "bytes sent per learner/worker (all ÷ M)", both, "sent_per_learner",
         "sent_per_worker"),
        ("bytes_received_per_worker", "bytes received per learner/worker (all ÷ M)", both,
         "received_per_learner", "received_per_worker"),
        ("bytes_merged_in", "merge-log bytes_in: submission bytes merged", "syncer", "merged_in", None),
        ("bytes_published_out", "merge-log bytes_out: published, fragment bytes × M per merge", "syncer",
         "published_out", None),
    ):
        rows.append({"key": key, "label": label, "unit": "", "fmt": "bytes", "group": "bytes",
                     "counted_by": by, "diloco": val(d, dk), "dp": val(p, pk) if pk else no_syncer})
    for r in rows[-2:]:  # merge-log totals some records lack: "not recorded", never a partial sum
        fig_key = "merged_in" if r["key"] == "bytes_merged_in" else "published_out"
        if d["status"] == "ok" and d[fig_key] is None and d[f"{fig_key}_recorded"]:
            r["diloco"] = f"not recorded (in {d[f'{fig_key}_recorded']} of {d['merge_records']} merge records)"
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
    metrics, params, flops_per_token, hyperparameters, curve summary), ``comparison`` (the rows of
    the side-by-side tables, ``group`` "training", "eval" or "bytes"), ``loss_gap`` (DiLoCo's final
    held-out loss relative to DP's, in %), ``bytes`` (every byte figure, computed once: see
    :func:`_byte_figures`), ``manifest``, ``ledger`` (tokens per learner), ``work_lost`` (None for
    runs whose summary has none), ``pipeline`` (``status.json``, or None), ``chaos`` (scheduled
    failures and whether each fired), ``merges`` (counts, stale contributions), ``learners``,
    ``failures`` (downtime [s] and merges while down), ``plots`` (file names relative to
    ``report/``, or None when not drawn) and ``notes``.

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
    status = _read_json(run_dir / "status.json")

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

    ledger = _ledger(summaries["diloco"], _fragments(config, summaries["diloco"]))
    work_lost = _work_lost(summaries["diloco"], ledger)
    if work_lost and ledger["status"] == "ok" and work_lost["dropped_tokens"] is not None:
        diff = work_lost["dropped_tokens"] - (ledger["total"].get("dropped") or 0)
        if abs(diff) > (ledger["tolerance"] or 1) * max(len(ledger["rows"]), 1):
            notes.append(f"work_lost.dropped_tokens {int(work_lost['dropped_tokens']):,} differs from the "
                         f"ledger's total dropped {ledger['total'].get('dropped') or 0:,} by {int(diff):+,} tokens.")
    merge_stats = _merge_stats(merges, summaries["diloco"], notes)
    byte_figs = _byte_figures(config, summaries, merges, notes)
    eval_rows = _eval_rows(methods, notes)

    run_name = (config or {}).get("name") or run_dir.name
    report: dict[str, Any] = {
        "schema": 2,
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
        "pipeline": _pipeline_status(status),
        "work_lost": work_lost,
        "comparison": _comparison(methods, merge_stats, byte_figs, eval_rows),
        "bytes": byte_figs,
        "loss_gap": loss_gap,
        "hyperparameters": hyper,
        "manifest": {
            "status": "ok" if manifest is not None else NOT_RUN,
            "items": _manifest_items(manifest) if manifest is not None else [],
        },
        "ledger": ledger,
        "chaos": _chaos(config, events, failures),
        "merges": merge_stats,
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


def publish_report_artifacts(report: dict, run_dir: Path) -> None:
    """See :func:`evals.report_artifacts.publish_report_artifacts` (the only Prefect import here)."""
    from evals.report_artifacts import publish_report_artifacts as publish

    publish(report, run_dir)


def artifact_key(prefix: str, name: str) -> str:
    """See :func:`evals.report_artifacts.artifact_key`."""
    from evals.report_artifacts import artifact_key as key

    return key(prefix, name)
