"""Analyses of a learners-and-syncer method's records (DiLoCo): merges, learner events and failures,
the scheduled chaos events, the token ledger and the lost work. Pure: dicts in, dicts out.

Times are seconds since the method's training start (the records' ``t`` and ``merged_at_s``);
token counts are BPE tokens. Record fields are docs/contracts.md's ("Metrics", "Summaries").
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import TYPE_CHECKING, Any

from reports.common import NOT_RUN, format_value, lid, num, sort_key
from run.records import (
    Corrupt,
    Failure,
    LearnersLine,
    Merge,
    Presence,
    Slowdown,
    Start,
    StateEvent,
    StepLine,
    Stop,
    Summary,
    SyncerEvent,
    Wait,
    parse,
)

if TYPE_CHECKING:
    from configs.schema import ExperimentConfig

INJECTED = "InjectedFailure"  # diloco.learner's exception for a scheduled (chaos) failure
LEDGER_COLUMNS = ("processed", "submitted", "not_submitted", "merged", "recomputed", "dropped", "pending")


Own = StateEvent | Start | StepLine | Failure | Stop | Wait | Slowdown | Presence | Corrupt


def learner_events(events: list[dict] | None) -> dict[Any, list[Own]]:
    """Each learner's own events (``run.records``; not the syncer's or the exchange's), in time order
    (stable: ties keep file order), learners in id order."""
    per: dict[Any, list] = {}
    for e in parse(LearnersLine, events):
        if isinstance(e, Own) and e.learner is not None:
            per.setdefault(lid(e.learner), []).append(e)
    for evs in per.values():
        evs.sort(key=lambda e: e.t)
    return dict(sorted(per.items(), key=lambda kv: sort_key(kv[0])))


def learner_failures(events: list[dict], merges: list[dict]) -> list[dict]:
    """Each ``failure`` and ``kill`` event with its downtime (until the learner's next ``up`` state
    event of a later attempt; in a log from before state events, its next ``start``) and the merges
    during it (docs/report.md, "Learners and syncer"); seconds since training start, in time order."""
    timed = [(m.merged_at_s, {lid(c) for c in m.contributors}, str(m.fragment)) for m in parse(Merge, merges)]
    timed = [x for x in timed if x[0] is not None]
    out = []
    for who, evs in learner_events(events).items():
        states = [e for e in evs if isinstance(e, StateEvent)]
        # a log from before state events: each start is the moment its up state records (same t)
        ups = [e for e in states if e.state == "up"] if states else [e for e in evs if isinstance(e, Start)]
        for f in (e for e in evs if isinstance(e, Failure)):
            back = next((u for u in ups if u.t >= f.t and (u.attempt or math.inf) > (f.attempt or 0)), None)
            end = back.t if back is not None else math.inf
            during = [(w, p) for t, w, p in timed if f.t <= t < end]
            after = sorted(t for t, w, _ in timed if back is not None and t >= back.t and who in w)
            out.append(
                {
                    "learner": who,
                    "attempt": f.attempt,
                    "failed_at_s": f.t,
                    "failed_at_step": f.step,
                    "reason": f.reason,
                    "restarted_at_s": back.t if back else None,
                    "restart_attempt": back.attempt if back else None,
                    "restart_event": "start" if back else None,
                    "downtime_s": (back.t - f.t) if back else None,
                    "merges_while_down": len(during),
                    "merges_while_down_by_fragment": dict(sorted(Counter(p for _, p in during).items())),
                    "merges_while_down_with_learner": sum(who in w for w, _ in during),
                    "merged_again_after_restart": bool(after),
                    "first_merge_with_learner_after_restart_s": after[0] if after else None,
                }
            )
    return sorted(out, key=lambda r: r["failed_at_s"])


def _stale_versions(x: Any) -> int:
    """A merge record's ``stale`` entry as versions behind (``True`` from older logs counts as 1)."""
    v = num(int(x) if isinstance(x, bool) else x)
    return int(v) if v is not None and math.isfinite(v) else 0


def merge_stats(
    merges: list[dict] | None,
    summary: dict | None,
    notes: list[str],
    log_file: str,
    summary_file: str,
    who: str = "DiLoCo",
) -> dict:
    """The merge figures, once, from the merge log (``log_file``), else the summary's ``merges``
    (status "from summary"; a count that disagrees with the log is a note): ``count``,
    ``by_fragment``, ``contributions``, ``stale_contributions``, ``max_stale_versions``, ``first_s`` /
    ``last_s`` (seconds); docs/report.md ("Learners and syncer")."""
    n = Summary.model_validate(summary or {}).merges
    if merges is not None:
        status, count, source = "ok", len(merges), log_file
        if n is not None and n != len(merges):
            notes.append(
                f"{who} summary says {n} merges but the merge log has {len(merges)} "
                "lines; the report counts the merge log."
            )
    else:
        status, count, source = (
            ("from summary", n, f"{summary_file} (merges)") if n is not None else (NOT_RUN, None, None)
        )
    typed = parse(Merge, merges)
    contributors = [len(m.contributors) for m in typed]
    stale = [_stale_versions(x) for m in typed for x in m.stale]
    times = [m.merged_at_s for m in typed if m.merged_at_s is not None]
    return {
        "status": status,
        "count": count,
        "source": source,
        "by_fragment": dict(sorted(Counter(str(m.fragment) for m in typed).items(), key=lambda kv: sort_key(kv[0]))),
        "contributions": sum(contributors),
        "mean_contributors": sum(contributors) / len(contributors) if contributors else None,
        "stale_contributions": sum(1 for x in stale if x > 0),
        "max_stale_versions": max(stale) if stale else None,
        "first_s": min(times) if times else None,
        "last_s": max(times) if times else None,
    }


def learner_table(events: list[dict]) -> list[dict]:
    """Per learner: starts (attempts begun), failures, submissions the syncer dropped, the last
    step seen in any event, and how its last attempt ended."""
    rows: dict[Any, dict] = {}
    for e in sorted(parse(LearnersLine, events), key=lambda e: e.t or 0.0):
        if getattr(e, "learner", None) is None:
            continue
        row = rows.setdefault(lid(e.learner), dict.fromkeys(("starts", "failures", "dropped_submissions"), 0))
        row["starts"] += isinstance(e, Start)
        row["failures"] += isinstance(e, Failure)
        # a re-trained copy of merged steps: its tokens are recomputed work, not dropped
        row["dropped_submissions"] += e.event == "dropped" and e.reason != "recomputed"
        if getattr(e, "step", None) is not None:
            row["last_step"] = e.step
        if isinstance(e, Stop | Failure):
            row["ended"] = e.event + (f" ({e.reason})" if e.reason else "")
    ordered = sorted(rows.items(), key=lambda kv: sort_key(kv[0]))
    return [{"learner": k, **r, "last_step": r.get("last_step"), "ended": r.get("ended")} for k, r in ordered]


def _int(x: Any) -> int | None:
    """A ledger count as a whole number of tokens (the syncer's per-fragment averages are rounded)."""
    v = num(x)
    return int(round(v)) if v is not None and math.isfinite(v) else None


def ledger(summary: dict | None, fragments: int | None = None) -> dict:
    """The token ledger per learner (whole tokens), a total row and merged % of processed, each row
    checked against processed = submitted + not_submitted and submitted = merged (+ recomputed) +
    dropped + pending within ±P tokens (``tolerance``, P = ``fragments``); docs/report.md ("Token
    ledger"). Returns ``status``, ``columns``, ``rows``, ``total``, ``fragments``, ``tolerance``,
    ``not_submitted_computed`` and ``identity_violations``."""
    raw = (summary or {}).get("ledger")
    if isinstance(raw, dict) and isinstance(raw.get("ledger"), dict):
        raw = raw["ledger"]
    status = NOT_RUN if summary is None else "ok" if isinstance(raw, dict) and raw else "not recorded"
    learners = {k: dict(v) for k, v in raw.items() if isinstance(v, dict)} if status == "ok" else {}
    computed = False
    for v in learners.values():
        if v.get("not_submitted") is None and None not in (num(v.get("processed")), num(v.get("submitted"))):
            v["not_submitted"] = num(v["processed"]) - num(v["submitted"])
            computed = True
    extra = sorted({c for v in learners.values() for c in v} - set(LEDGER_COLUMNS))
    columns = [c for c in LEDGER_COLUMNS if any(c in v for v in learners.values())] + extra
    dicts = {c for c in columns if any(isinstance(v.get(c), dict) for v in learners.values())}
    rows = [
        {"learner": lid(k)}
        | {c: {str(i): _int(x) for i, x in (v.get(c) or {}).items()} if c in dicts else _int(v.get(c)) for c in columns}
        for k, v in sorted(learners.items(), key=lambda kv: sort_key(kv[0]))
    ]
    total: dict[str, Any] = {"learner": "total"}
    for c in columns:  # a dict column (e.g. drop reasons) sums per key, keys in first-seen order
        keys = dict.fromkeys(i for r in rows for i in r[c]) if c in dicts else None
        total[c] = (
            sum(r[c] or 0 for r in rows) if keys is None else {i: sum(r[c].get(i) or 0 for r in rows) for i in keys}
        )
    for r in [*rows, total]:
        p, mg = r.get("processed"), r.get("merged")
        r["merged_pct"] = 100.0 * mg / p if p and mg is not None else None
    tol, violations = fragments or 1, []
    for r in rows:
        recomputed = ("recomputed",) if r.get("recomputed") is not None else ()
        for lhs, parts in (
            ("processed", ("submitted", "not_submitted")),
            ("submitted", ("merged", *recomputed, "dropped", "pending")),
        ):
            vals = [r.get(c) for c in (lhs, *parts)]
            if None not in vals and abs(diff := vals[0] - sum(vals[1:])) > tol:
                violations.append(
                    {"learner": r["learner"], "identity": f"{lhs} = {' + '.join(parts)}", "difference": diff}
                )
    ok = status == "ok"
    return {
        "status": status,
        "columns": columns,
        "rows": rows,
        "total": total if ok else None,
        "fragments": fragments,
        "tolerance": tol if ok else None,
        "not_submitted_computed": computed,
        "identity_violations": violations,
    }


def _idle_attempt(events: list[dict], who: Any, attempt: Any) -> bool:
    """Did learner ``who``'s attempt ``attempt`` stop at the step it started from (budget spent)?"""
    mine = [e for e in learner_events(events).get(who, []) if e.attempt == attempt]
    start, stop = (next((e for e in mine if isinstance(e, k)), None) for k in (Start, Stop))
    return start is not None and stop is not None and stop.step == start.step


def chaos(config: ExperimentConfig | None, events: list[dict] | None, failures: list[dict]) -> dict:
    """The step-scheduled failures and the kills of config ``chaos.events`` (``fail`` at a step,
    ``kill``; a run configured before them reads its ``chaos.failures`` and ``chaos.kills`` as
    those events: ``configs.load.stored_config``) and whether each
    fired (docs/report.md, "Scheduled chaos events"): ``rows`` with ``fired`` (None without a learners
    log), ``fired_at_s`` and ``rejoined_at_s`` (None when it never started again), and
    ``unscheduled_failures``."""
    if config is None:
        return {"status": NOT_RUN + " (no config.json)", "rows": []}
    evs = config.chaos.events
    last_step = {
        m: max(steps)
        for m, own in learner_events(events).items()
        if (steps := [e.step for e in own if getattr(e, "step", None) is not None])
    }
    used: set[int] = set()
    rows, reasons = [], [str(f["reason"] or "") for f in failures]
    for e in [e for e in evs if e.kind == "fail" and e.at_step is not None] + [e for e in evs if e.kind == "kill"]:
        who, at, at_s = lid(e.learner), num(e.at_step), num(e.at_s) if e.kind == "kill" else None
        # a failure reason that names this event: the injected failure at that local step, or the chaos SIGKILL
        if e.kind == "kill":
            when = f"at local step {format_value(at)}" if at is not None else f"at {format_value(at_s)} s"
            event, needs = f"learner {who}'s process SIGKILLed {when}", ""
            pattern = rf"SIGKILL at local step {int(at)}(?!\d)" if at is not None else rf"SIGKILL at {float(at_s):g} s"
        else:
            event, needs = f"learner {who} fails at local step {format_value(at)}", INJECTED
            pattern = rf"at local step {int(at)}(?!\d)"
        kind = "kill" if e.kind == "kill" else "failure"
        row = {"learner": who, "at_step": at, "at_s": at_s, "kind": kind, "event": event}
        row |= dict.fromkeys(("fired", "fired_at_s", "failed_attempt", "rejoined_at_s", "rejoin_attempt", "note"))
        if events is not None and (at is not None or at_s is not None):
            named = [i for i, r in enumerate(reasons) if needs in r and re.search(pattern, r) and i not in used]
            hit = next((i for i in named if failures[i]["learner"] == who), None)
            row["fired"] = hit is not None
            if hit is not None:
                used.add(hit)
                f = failures[hit]
                row["fired_at_s"], row["failed_attempt"] = f["failed_at_s"], f["attempt"]
                if f.get("restart_event") == "start":
                    row["rejoined_at_s"], row["rejoin_attempt"] = f["restarted_at_s"], f["restart_attempt"]
                    if _idle_attempt(events, who, f["restart_attempt"]):
                        row["note"] = "it rejoined after the others had spent the budget: no step after the restart"
                else:
                    row["note"] = "no later attempt started"
            else:
                seen = last_step.get(who)
                row["note"] = (
                    f"learner {who}'s last logged step: {seen}"
                    if seen is not None
                    else f"no events of learner {who} logged"
                )
        rows.append(row)
    return {"status": "ok", "rows": rows, "unscheduled_failures": len(failures) - len(used)}


def work_lost(summary: dict | None, ledger_figures: dict, who: str = "DiLoCo") -> dict | None:
    """The lost work (summary ``work_lost``; None when the summary has none: older runs), with drop
    reasons as fractions of the processed tokens and ``headline``, the bold line at the top of
    report.md when status is not ok (``who`` names the method there)."""
    raw = (summary or {}).get("work_lost")
    if not isinstance(raw, dict):
        return None
    wl = {
        k: num(raw.get(k))
        for k in ("processed_tokens", "dropped_tokens", "dropped_fraction", "warn_above", "fail_above")
    }
    wl["status"] = str(raw.get("status") or "unknown")
    fallback = (ledger_figures.get("total") or {}).get("drop_reasons") if ledger_figures.get("status") == "ok" else None
    reasons = raw["reasons"] if isinstance(raw.get("reasons"), dict) else fallback
    reasons = {str(k): n for k, v in (reasons or {}).items() if (n := num(v))}
    processed = wl["processed_tokens"]
    wl["drop_reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    wl["drop_reason_fractions"] = {k: v / processed for k, v in wl["drop_reasons"].items()} if processed else {}
    wl["headline"] = None
    frac = wl["dropped_fraction"]
    if wl["status"] != "ok" and frac is not None:
        why = ", ".join(f"{k} {100 * x:.1f} %" for k, x in wl["drop_reason_fractions"].items())
        n = wl["dropped_tokens"]
        counts = f" ({int(n):,} of {int(processed):,})" if n is not None and processed is not None else ""
        warn = f"diloco.warn_dropped_fraction = {wl['warn_above']:g}" if wl["warn_above"] is not None else None
        fail = f"diloco.max_dropped_fraction = {wl['fail_above']:g}" if wl["fail_above"] is not None else None
        if wl["status"] == "failed":
            verdict = f"this run failed its {fail or 'diloco.max_dropped_fraction'} check" + (
                f" (warning above {warn})" if warn else ""
            )
        else:
            verdict = f"above {warn or 'diloco.warn_dropped_fraction'}" + (
                f"; the run fails above {fail}" if fail else ""
            )
        why = f" ({why})" if why else ""
        wl["headline"] = (
            f"**Warning: {100 * frac:.1f} % of {who}'s processed tokens{counts} were dropped{why}; {verdict}.**"
        )
    return wl


def syncer_restarts(events: list[dict]) -> list[dict]:
    """Each syncer failure (``syncer-failure``, ``syncer-kill``) with the next ``syncer-resumed`` event
    (docs/report.md, "Syncer restarts"); times in seconds since training start."""
    evs = sorted((e for e in parse(LearnersLine, events) if isinstance(e, SyncerEvent)), key=lambda e: e.t)
    out = []
    for i, e in enumerate(evs):
        if e.event == "syncer-resumed":
            continue
        back = next((r for r in evs[i + 1 :] if r.event == "syncer-resumed"), None)
        out.append(
            {
                "attempt": e.attempt,
                "how": "SIGKILL" if e.event == "syncer-kill" else "exception",
                "reason": e.reason,
                "failed_at_s": e.t,
                "merges_before": e.merges,
                "resumed_at_s": back.t if back else None,
                "downtime_s": (back.t - e.t) if back else None,
                **{k: getattr(back, k, None) for k in ("generation", "replayed", "republished")},
            }
        )
    return out


def syncer_sections(
    config: ExperimentConfig | None,
    summary: dict | None,
    merges: list[dict] | None,
    events: list[dict] | None,
    fragments: int | None,
    files: dict[str, str],
    notes: list[str],
    who: str = "DiLoCo",
) -> dict:
    """Every learner/syncer figure of one method: ``merges``, ``ledger``, ``work_lost``, ``chaos``,
    ``learners`` (per-learner table) and ``failures``; ``files`` names the sources (read.py)."""
    failures = learner_failures(events or [], merges or [])
    led = ledger(summary, fragments)
    lost = work_lost(summary, led, who)
    if lost and led["status"] == "ok" and lost["dropped_tokens"] is not None:
        diff = lost["dropped_tokens"] - (led["total"].get("dropped") or 0)
        if abs(diff) > (led["tolerance"] or 1) * max(len(led["rows"]), 1):
            notes.append(
                f"work_lost.dropped_tokens {int(lost['dropped_tokens']):,} differs from the "
                f"ledger's total dropped {led['total'].get('dropped') or 0:,} by {int(diff):+,} tokens."
            )
    return {
        "merges": merge_stats(merges, summary, notes, files["merges"], files["summary"], who),
        "ledger": led,
        "work_lost": lost,
        "chaos": chaos(config, events, failures),
        "learners": {"status": "ok" if events is not None else NOT_RUN, "rows": learner_table(events or [])},
        "failures": failures,
        "syncer_restarts": syncer_restarts(events or []),
    }
