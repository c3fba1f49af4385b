"""Resilience under a chaos schedule: per-method timelines, goodput, uptime, the goodput simulator's
prediction for the same knobs, and held-out loss at equal wall time and tokens. Pure: dicts and lists
in and out (no I/O, no Prefect, no JAX); every function accepts a run in progress (``now``: the end of
the span on the method's clock). Definitions, states and clocks: docs/report.md ("Resilience").
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from configs.chaos import ChaosPlan, ChaosSchedule
from configs.faults import CorruptEvent, PresenceEvent
from reports.common import lid, num
from reports.learners import Own, learner_events, learner_failures, syncer_restarts
from run.records import (
    Corrupt,
    DPEvent,
    DPLine,
    Failure,
    LearnersLine,
    Merge,
    Presence,
    Slowdown,
    Start,
    StateEvent,
    StepLine,
    Summary,
    TrainRow,
    Wait,
    parse,
)

if TYPE_CHECKING:
    from configs.schema import ExperimentConfig

STATES = ("running", "straggling", "waiting", "recomputing", "down", "absent")
USEFUL = ("running", "straggling")
STALL_FACTOR = 4.0  # a gap between advances > this × the median gap is a stall
SIM_FAILURES_PER_RUN = 4000  # the simulator's horizon: this many expected interruptions of the cluster
SIM_SEEDS = 10

Interval = dict  # {"state", "start", "end"} (+ "why"), seconds since the method's span start


# --- intervals -----------------------------------------------------------------------------------


def _iv(state: str, a: float, b: float, why: str | None = None) -> Interval:
    return {"state": state, "start": a, "end": b} | ({} if why is None else {"why": why})


def merge_adjacent(intervals: list[Interval]) -> list[Interval]:
    """Sorted, without empty intervals, touching intervals of the same state (and ``why``) joined."""
    out: list[Interval] = []
    for iv in sorted((x for x in intervals if x["end"] > x["start"]), key=lambda x: x["start"]):
        if (
            out
            and out[-1]["state"] == iv["state"]
            and out[-1].get("why") == iv.get("why")
            and abs(out[-1]["end"] - iv["start"]) < 1e-12
        ):
            out[-1]["end"] = iv["end"]
        else:
            out.append(dict(iv))
    return out


def overlay(
    intervals: list[Interval],
    a: float,
    b: float,
    state: str,
    why: str | None = None,
    replace: tuple[str, ...] | None = None,
) -> list[Interval]:
    """``intervals`` with [a, b) set to ``state`` where their state is in ``replace`` (None: any)."""
    if b <= a:
        return intervals
    out: list[Interval] = []
    for iv in intervals:  # the parts before a and after b stay (merge_adjacent drops the empty ones)
        if iv["end"] <= a or iv["start"] >= b or (replace is not None and iv["state"] not in replace):
            out.append(iv)
        else:
            out += [{**iv, "end": a}, _iv(state, max(iv["start"], a), min(iv["end"], b), why), {**iv, "start": b}]
    return merge_adjacent(out)


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of ``intervals`` inside [lo, hi)."""
    return [
        {**iv, "start": max(iv["start"], lo), "end": min(iv["end"], hi)}
        for iv in intervals
        if iv["end"] > lo and iv["start"] < hi
    ]


def state_seconds(intervals: list[Interval], why: bool = False) -> dict[str, float]:
    """Seconds per state (every state of :data:`STATES`, 0 when absent); ``why``: also ``<state>/<why>``."""
    out = {s: 0.0 for s in STATES}
    for iv in intervals:
        d = iv["end"] - iv["start"]
        out[iv["state"]] = out.get(iv["state"], 0.0) + d
        if why and iv.get("why"):
            k = f"{iv['state']}/{iv['why']}"
            out[k] = out.get(k, 0.0) + d
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


# --- Decoupled DiLoCo ----------------------------------------------------------------------------

# each state event as a timeline state: a retry restarting is still down after its failure
AS_INTERVAL = {
    "up": ("running", None),
    "down": ("down", "failure"),
    "restarting": ("down", "failure"),
    "done": ("waiting", "done"),
}


def diloco_span(events: list[dict] | None, now: float | None = None) -> dict | None:
    """The training span on the run clock (s): from the first learner ``up`` state event to ``now``, else
    to the last learner event (a ``wait`` counts to its end); None before any learner was up."""
    per = learner_events(events)
    ups = [e.t for evs in per.values() for e in evs if isinstance(e, StateEvent) and e.state == "up"]
    if not ups:
        return None
    t0 = min(ups)
    ends = [e.t + (e.wait_s if isinstance(e, Wait) else 0.0) for evs in per.values() for e in evs]
    t1 = max(float(now) if now is not None else max(ends), t0)
    return {"start_s": t0, "end_s": t1, "length_s": t1 - t0, "clock": "run clock (s)"}


def learner_timeline(evs: list[Own], t0: float, t1: float, scavenged: bool) -> tuple[list[Interval], dict]:
    """One learner's intervals on the run clock from its events (docs/report.md, :data:`AS_INTERVAL`) and
    its allocation ``{"start_s", "end_s"}`` (None when a scavenged learner has not joined yet)."""
    was_up = any(isinstance(e, StateEvent) and e.state == "up" for e in evs)
    joined = next((e.t for e in evs if isinstance(e, Presence) and e.event == "join"), None)
    state = ("absent", None) if scavenged and (joined is not None or not was_up) else ("down", "start-up")
    out, since, left = [], t0, None
    for e in evs:
        new = state
        if isinstance(e, Presence) and e.event == "join" and state[0] == "absent" and left is None:
            new = ("down", "start-up")
        elif isinstance(e, Slowdown) and state[0] in USEFUL:
            new = ("straggling" if e.factor > 1.0 else "running", None)
        elif isinstance(e, StateEvent) and left is None:
            left = e.t if e.state == "done" and e.reason == "left" else None
            new = ("absent", None) if left is not None else AS_INTERVAL[e.state]
        if new != state:
            t = min(max(e.t, t0), t1)
            out.append(_iv(state[0], since, t, state[1]))
            state, since = new, t
    out.append(_iv(state[0], since, t1, state[1]))
    out = merge_adjacent(clip(out, t0, t1))
    for w in (e for e in evs if isinstance(e, Wait)):
        out = overlay(out, w.t, w.t + w.wait_s, "waiting", "merge", replace=USEFUL)
    start = joined if scavenged and joined is not None else t0 if not scavenged or was_up else None
    return out, None if start is None else {"start_s": start, "end_s": left if scavenged and left is not None else t1}


def lost_work(evs: list[Own], intervals: list[Interval], resume_every_steps: int | None = None) -> list[dict]:
    """Work thrown away by each of a learner's failures (docs/report.md, "Lost work"): per failure
    ``lost_steps`` (its step − the step its next ``start`` resumed from, or from its last resume point
    every ``resume_every_steps``), ``s_per_step`` and ``lost_s`` = their product (seconds)."""
    starts = [e for e in evs if isinstance(e, Start)]
    useful, out = [iv for iv in intervals if iv["state"] in USEFUL], []
    for f in (e for e in evs if isinstance(e, Failure)):
        att, s_f = f.attempt, f.step or 0
        begun = [s for s in starts if s.t <= f.t and (att is None or s.attempt == att)]
        b = (begun or [s for s in starts if s.t <= f.t] or [None])[-1]
        nxt = next((s for s in starts if s.t > f.t and (att is None or (s.attempt or 0) > att)), None)
        rewound = s_f - s_f % resume_every_steps if resume_every_steps else s_f  # to its last resume point
        resumed = (nxt.step or 0) if nxt is not None else rewound
        taken = s_f - (b.step or 0) if b is not None else 0
        busy = sum(max(0.0, min(iv["end"], f.t) - max(iv["start"], b.t)) for iv in useful) if b is not None else 0.0
        out.append(
            {
                "attempt": att,
                "failed_at_s": f.t,
                "failed_at_step": s_f,
                "resumed_from_step": resumed if nxt is not None else None,
                "lost_steps": max(0, s_f - resumed),
                "steps_taken": taken,
                "busy_s": busy,
                "restarted": nxt is not None,
            }
        )
    steps_total = sum(max(r["steps_taken"], 0) for r in out)
    mean_sps = sum(iv["end"] - iv["start"] for iv in useful) / steps_total if steps_total else None
    logged = [e for e in evs if isinstance(e, StepLine) and e.step is not None]
    paces = [
        (b.t - a.t) / (b.step - a.step)
        for a, b in zip(logged, logged[1:])
        if b.step > a.step and (a.attempt is None or b.attempt is None or a.attempt == b.attempt)
    ]
    pace = statistics.median(paces) if paces else None
    for r in out:
        sps = pace if pace is not None else (r["busy_s"] / r["steps_taken"] if r["steps_taken"] > 0 else mean_sps)
        r["s_per_step"] = sps
        r["lost_s"] = r["lost_steps"] * sps if sps is not None else 0.0
    return out


def _attempts(evs: list[Own]) -> list[dict]:
    """Per ``start``: its ``attempt``, ``from_step`` and the inner ``steps`` it took (recomputed included)."""
    out: list[dict] = []
    for e in evs:
        s = getattr(e, "step", None)
        if isinstance(e, Start):
            out.append({"attempt": e.attempt, "from_step": s or 0, "steps": 0})
        elif s is not None and out:
            out[-1]["steps"] = max(out[-1]["steps"], int(s - out[-1]["from_step"]))
    return out


def state_intervals(states: list[StateEvent], end: float) -> list[tuple[str, float, float]]:
    """(state, start, end) from each state event to the next (the last: to ``end``); a repeat continues."""
    out: list[tuple[str, float, float]] = []
    for e, nxt in zip(states, [*states[1:], None]):
        b = nxt.t if nxt is not None else max(end, e.t)
        if out and out[-1][0] == e.state:
            out[-1] = (e.state, out[-1][1], b)
        else:
            out.append((e.state, e.t, b))
    return out


def diloco_resilience(
    events: list[dict] | None,
    merges: list[dict] | None = None,
    schedule: ChaosSchedule | None = None,
    now: float | None = None,
    resume_every_steps: int | None = None,
) -> dict | None:
    """Decoupled DiLoCo's timelines and goodput from its learners' state events (docs/report.md); None
    before any learner was up. ``now``: the run clock's present, for a run in progress. Returns ``span``
    (:func:`diloco_span`), ``learners`` (per learner: seconds per state, ``lost_work_s``, ``useful_s``,
    ``goodput``, failures, restarts, ``window`` [join, leave] in span seconds, ``lost``: :func:`lost_work`),
    ``global`` (Σ useful / Σ allocated), ``timelines`` (learner → intervals in seconds since the span
    start) and ``uptime`` (:func:`state_uptime`, with the merges' :func:`uptime` as ``cadence``)."""
    span = diloco_span(events, now)
    if span is None:
        return None
    t0, t1 = span["start_s"], span["end_s"]
    per, windows = learner_events(events), {p.learner for p in (schedule.presence if schedule else [])}
    failures = learner_failures(events or [], merges or [])
    for m in range(schedule.learners if schedule else 0):  # scheduled, nothing logged yet
        per.setdefault(m, [])
    rows, timelines = [], {}
    for m, evs in per.items():
        scav = m in windows or any(isinstance(e, Presence) for e in evs)
        ivs, alloc = learner_timeline(evs, t0, t1, scav)
        timelines[str(m)] = _since(ivs, t0)
        inside = clip(ivs, alloc["start_s"], alloc["end_s"]) if alloc else []
        secs, lost = state_seconds(inside, why=True), lost_work(evs, ivs, resume_every_steps)
        allocated = (alloc["end_s"] - alloc["start_s"]) if alloc else 0.0
        busy = secs["running"] + secs["straggling"]
        lost_s = min(sum(r["lost_s"] for r in lost), busy)
        attempts = _attempts(evs)
        trained = {x["attempt"] for x in attempts if x["steps"] > 0}
        # restarts after which the learner trained (a restart as the budget ran out has nothing to merge)
        restarted = [f for f in failures if f["learner"] == m and f["restart_attempt"] in trained]
        states = [e for e in evs if isinstance(e, StateEvent)]
        rows.append(
            {
                "learner": m,
                "scavenged": scav,
                "window": [alloc["start_s"] - t0, alloc["end_s"] - t0] if alloc else None,
                "allocated_s": allocated,
                **{f"{s}_s": secs[s] for s in STATES if s != "absent"},
                "absent_s": state_seconds(ivs)["absent"],  # outside its window
                "down_startup_s": secs.get("down/start-up", 0.0),
                "restarting_s": sum(b - a for s, a, b in state_intervals(states, t1) if s == "restarting"),
                "waiting_done_s": secs.get("waiting/done", 0.0),
                "lost_work_s": lost_s,
                "useful_s": busy - lost_s,
                "goodput": _ratio(busy - lost_s, allocated),
                "steps_taken": sum(a["steps"] for a in attempts),  # recomputed steps included
                "s_per_step": _ratio(busy, sum(a["steps"] for a in attempts)),
                "failures": sum(1 for f in failures if f["learner"] == m),
                "restarts": max(0, sum(1 for e in states if e.state == "up") - 1),
                "merged_again_after_restart": all(f["merged_again_after_restart"] for f in restarted)
                if restarted
                else None,
                "lost": lost,
            }
        )
    merge_times = [m.merged_at_s - t0 for m in parse(Merge, merges) if m.merged_at_s is not None]
    return {
        "span": span,
        "learners": rows,
        "timelines": timelines,
        "global": _global(rows, sum(r["allocated_s"] for r in rows), "restarting_s", "lost_work_s"),
        "uptime": {
            **state_uptime(timelines, span["length_s"], syncer_outages(events, t0)),
            "cadence": uptime(merge_times, 0.0, span["length_s"]),
        },
    }


# --- data-parallel baseline ----------------------------------------------------------------------


def _dp_rows(train: list[dict] | None) -> list[tuple[int, float]]:
    """(step, t) of DP's ``train.jsonl`` rows, in time order."""
    return sorted(((r.step, r.t) for r in parse(TrainRow, train) if r.t is not None), key=lambda x: x[1])


def _factor_at(factors: list[tuple[float, float]], t: float) -> float:
    return next((f for ft, f in reversed(factors) if ft <= t), 1.0)


def dp_step_time(train: list[dict] | None, events: list[DPEvent] = ()) -> float | None:
    """DP's step time (s): the median Δt / Δstep over consecutive ``train.jsonl`` rows with no DP event
    between them and no slowdown in force (else over all pairs); None with fewer than two rows."""
    rows = _dp_rows(train)
    factors = [(e.t, e.factor) for e in events if e.event == "slowdown"]
    pairs = [(t1, t2, (t2 - t1) / (s2 - s1)) for (s1, t1), (s2, t2) in zip(rows, rows[1:]) if s2 > s1 and t2 > t1]
    clean = [x for a, b, x in pairs if not any(a < e.t <= b for e in events) and _factor_at(factors, a) == 1.0]
    pick = clean or [x for _, _, x in pairs]
    return statistics.median(pick) if pick else None


def dp_span(train: list[dict] | None, lines: list, now: float | None = None) -> dict | None:
    """DP's training span on its own clock: from the job's first ``up`` state event to ``now``, else to
    its last ``train.jsonl`` row or event; None without state events."""
    ups = [e.t for e in lines if isinstance(e, StateEvent) and e.state == "up"]
    if not ups:
        return None
    end = float(now) if now is not None else max([t for _, t in _dp_rows(train)] + [e.t for e in lines])
    return {"start_s": min(ups), "end_s": end, "length_s": end - min(ups), "clock": "DP clock (s)"}


_RESTORED = "restored_at_s restored_step lost_steps restore_s down_s recomputed_until_s recompute_s"


def _recomputed_until(
    rows: list[tuple[int, float]], t_r: float, back: int, high: int, nxt: DPEvent | None, limit: float, step_s
) -> float:
    """When the job, restored at ``t_r`` to step ``back``, was back at its high-water step ``high``."""
    if back >= high:
        return t_r
    past = next(((s, t) for s, t in rows if t_r < t <= limit and s > high), None)
    if past is not None:
        t_c = past[1] - (past[0] - high) * step_s if step_s else past[1]
    elif nxt is not None and (nxt.step or 0) > high and step_s:
        t_c = limit - ((nxt.step or 0) - high) * step_s
    elif nxt is not None:
        t_c = limit  # interrupted before it was back at the high-water mark
    else:
        t_c = min(limit, t_r + (high - back) * step_s) if step_s else limit
    return min(max(t_c, t_r), limit)


def _restores(events: list[DPEvent], rows: list[tuple[int, float]], step_s: float | None, end: float) -> list[dict]:
    """Each DP failure with its restore and the recomputation after it (docs/report.md)."""
    fails = [e for e in events if e.event == "failure"]
    high, out = 0, []
    for i, f in enumerate(fails):
        high = max([high, f.step or 0] + [s for s, t in rows if t <= f.t])
        nxt = fails[i + 1] if i + 1 < len(fails) else None
        limit = nxt.t if nxt is not None else end
        restore = next((e for e in events if e.event == "restore" and f.t <= e.t <= limit), None)
        rec = {
            "replica": f.replica,
            "failed_at_s": f.t,
            "step_at_failure": f.step,
            "high_water_step": high,
            "restart_delay_s": f.restart_delay_s,
            **dict.fromkeys(_RESTORED.split()),  # None until restored
        }
        if restore is None:
            rec["down_s"] = limit - f.t
        else:
            t_c = _recomputed_until(rows, restore.t, restore.step or 0, high, nxt, limit, step_s)
            rec.update(
                restored_at_s=restore.t,
                restored_step=restore.step or 0,
                lost_steps=restore.lost_steps,
                restore_s=restore.restore_s,
                down_s=restore.t - f.t,
                recomputed_until_s=t_c,
                recompute_s=t_c - restore.t,
            )
        out.append(rec)
    return out


def _outages(lines: list, end: float) -> list[tuple[float, float, float]]:
    """(start, end, restarting seconds) of each stretch from a ``down`` state event to the next ``up``."""
    out: list[list[float]] = []
    for s, a, b in state_intervals(sorted((e for e in lines if isinstance(e, StateEvent)), key=lambda e: e.t), end):
        if s not in ("down", "restarting"):
            continue
        if not (out and out[-1][1] == a):
            out.append([a, a, 0.0])
        out[-1][1:] = [b, out[-1][2] + (b - a if s == "restarting" else 0.0)]
    return [tuple(x) for x in out]


def _stalls(outages: list, fails: list[DPEvent], W: int) -> list[tuple[float, float, int]]:
    """(start, end, row) of each stall: an outage split at each failure met meanwhile (its replica down)."""
    out, prev = [], -math.inf
    for a, b, _ in outages:
        inside = [f for f in fails if (a <= f.t or (f.while_down and prev <= f.t)) and f.t < b]
        cuts = [max(f.t, a) for f in inside] + [b]
        out += [(x, y, _row(f.replica, W)) for f, x, y in zip(inside, cuts, cuts[1:]) if y > x]
        prev = b
    return out


def _row(replica: Any, workers: int) -> int:
    r = num(replica)
    return int(r) % workers if r is not None else 0


def _episode_factor(schedule: ChaosSchedule | None, row: int, workers: int, t: float) -> float:
    """The step-time factor of DP replica ``row`` at ``t`` by the schedule's ``slowdowns``."""
    f = 1.0
    for e in schedule.slowdowns if schedule else []:
        if _row(e.learner, workers) == row and e.from_s <= t and (e.to_s is None or t < e.to_s):
            f = max(f, e.factor)
    return f


def _dp_timelines(
    span: dict,
    factors: list[tuple[float, float]],
    stalls: list[tuple[float, float, int]],
    recomputes: list[tuple[float, float]],
    schedule: ChaosSchedule | None,
    W: int,
) -> tuple[dict[int, list[Interval]], float]:
    """DP's rows (replica → intervals) and the slowdown seconds the schedule does not attribute."""
    end, slows = span["end_s"], schedule.slowdowns if schedule else []
    # Elementary pieces between every change of state, so that each slowdown share lies in its piece.
    cuts = {0.0, end, span["start_s"]} | {t for t, _ in factors} | {t for x in (*stalls, *recomputes) for t in x[:2]}
    cuts = sorted(
        t
        for t in cuts | {t for e in slows for t in (e.from_s, e.to_s)}
        if t is not None and span["start_s"] <= t <= end
    )
    rows: dict[int, list[Interval]] = {r: [] for r in range(W)}
    unattributed = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid, f = (a + b) / 2, _factor_at(factors, (a + b) / 2)
        stall = next((x for x in stalls if x[0] <= mid < x[1]), None)
        if stall is not None:  # the whole job is down: the failed replica down, the others waiting
            for r in rows:
                rows[r].append(_iv("down", a, b, "failure") if r == stall[2] else _iv("waiting", a, b, "stall"))
            continue
        recomputing = any(x0 <= mid < x1 for x0, x1 in recomputes)
        if recomputing or f <= 1.0:
            for r in rows:
                rows[r].append(_iv("recomputing" if recomputing else "running", a, b))
            continue
        g = {r: _episode_factor(schedule, r, W, mid) for r in rows}
        if max(g.values()) < f:  # the schedule does not say who: row 0 is the slowed one
            g[0] = f
            unattributed += b - a
        for r in rows:
            gr = min(g[r], f)
            if gr >= f:
                rows[r].append(_iv("straggling", a, b))
            else:
                cut = a + (b - a) * gr / f
                rows[r] += [
                    _iv("straggling" if gr > 1.0 else "running", a, cut),
                    _iv("waiting", cut, b, "slowest replica"),
                ]
    for r in rows:
        rows[r] = merge_adjacent(rows[r])
    return rows, unattributed


def _dp_replica(r: int, ivs: list[Interval], span: dict, restores: list[dict], W: int) -> dict:
    """Replica ``r``'s row of DP's goodput table: seconds per state, useful seconds, failures."""
    secs = state_seconds(ivs, why=True)
    useful = secs["running"] + secs["straggling"]
    return {
        "replica": r,
        "allocated_s": span["length_s"],
        **{f"{s}_s": secs[s] for s in STATES},
        "waiting_stall_s": secs.get("waiting/stall", 0.0),
        "waiting_slowest_s": secs.get("waiting/slowest replica", 0.0),
        "lost_work_s": secs["recomputing"],
        "useful_s": useful,
        "goodput": _ratio(useful, span["length_s"]),
        "failures": sum(1 for x in restores if _row(x["replica"], W) == r),
    }


def dp_resilience(
    events: list[dict] | None,
    train: list[dict] | None,
    workers: int | None,
    schedule: ChaosSchedule | None = None,
    now: float | None = None,
) -> dict | None:
    """DP's timelines (one row per replica) and goodput from its job's state events (docs/report.md); None
    without them. ``now``: DP's clock at present, for a run in progress. Returns ``span`` (:func:`dp_span`),
    ``step_s`` (:func:`dp_step_time`), ``restores`` (per failure), ``replicas`` (goodput rows), ``global``
    (Σ useful / (W × span)), ``timelines`` (row → intervals) and ``uptime`` (with the steps' cadence)."""
    lines = parse(DPLine, events)
    span = dp_span(train, lines, now)
    if span is None:
        return None
    events = sorted((e for e in lines if isinstance(e, DPEvent)), key=lambda e: e.t)
    W = max(int(workers or 1), 1)
    step_s = dp_step_time(train, events)
    restores = _restores(events, _dp_rows(train), step_s, span["end_s"])
    factors = [(e.t, e.factor) for e in events if e.event == "slowdown"]  # the job's pace over time
    outages = _outages(lines, span["end_s"])
    stalls = _stalls(outages, [e for e in events if e.event == "failure"], W)
    recomputes = [
        (x["restored_at_s"], x["recomputed_until_s"]) for x in restores if x["recomputed_until_s"] is not None
    ]
    rows, unattributed = _dp_timelines(span, factors, stalls, recomputes, schedule, W)
    table = [_dp_replica(r, ivs, span, restores, W) for r, ivs in rows.items()]
    advances = [t for _, t in _dp_rows(train)]
    return {
        "span": span,
        "workers": W,
        "step_s": step_s,
        "restores": restores,
        "replicas": table,
        "timelines": {str(r): ivs for r, ivs in rows.items()},
        "slowdown_unattributed_s": unattributed,
        "checkpoints": sum(1 for e in events if e.event == "checkpoint"),
        "checkpoint_s": sum(e.save_s or 0.0 for e in events if e.event == "checkpoint"),
        "global": {
            **_global(table, W * span["length_s"]),
            "failures": len(restores),
            "lost_steps": sum(x["lost_steps"] or 0 for x in restores),
            "recompute_s": sum(x["recompute_s"] or 0.0 for x in restores),
            "stall_s": sum(b - a for a, b, _ in outages),  # Σ down → up, by the state events
            "restarting_s": sum(r for _, _, r in outages),
        },
        # up while the job computes new steps: a replica running or straggling (a stall leaves none, and
        # recomputing is not up); a slowdown's waiting replicas do not matter, the slowed one computes
        "uptime": {
            **state_uptime({str(r): _since(ivs, span["start_s"]) for r, ivs in rows.items()}, span["length_s"]),
            "cadence": uptime(advances, span["start_s"], span["end_s"]),
        },
    }


def _global(rows: list[dict], allocated: float, *more: str) -> dict:
    """A goodput table's ``global`` row: Σ useful / ``allocated``, Σ seconds per state and Σ ``more``."""
    useful = sum(r["useful_s"] for r in rows)
    return {"allocated_s": allocated, "useful_s": useful, "goodput": _ratio(useful, allocated)} | {
        k: sum(r[k] for r in rows) for k in (*(f"{s}_s" for s in STATES), *more)
    }


def _since(intervals: list[Interval], t0: float) -> list[Interval]:
    return [{**iv, "start": iv["start"] - t0, "end": iv["end"] - t0} for iv in intervals]


# --- uptime --------------------------------------------------------------------------------------


def state_uptime(
    timelines: dict[str, list[Interval]],
    length_s: float,
    down: list[tuple[float, float]] = (),
    up_states: tuple[str, ...] = USEFUL,
) -> dict:
    """Share of [0, ``length_s``] in which a row of ``timelines`` was in ``up_states`` and no interval of
    ``down`` (e.g. the syncer's outages) covered it: the simulator's uptime (``sim.jobs.quorum_sweep``).
    Returns ``uptime`` (None for an empty span), ``up_s``, ``down_s`` and ``outages`` ([start, end], s)."""
    ivs = [iv for row in timelines.values() for iv in row if iv["state"] in up_states and iv["end"] > iv["start"]]
    ups = sorted((iv["start"], iv["end"]) for iv in ivs)
    merged: list[list[float]] = []
    for a, b in ups:  # the union of every row's up intervals
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    for da, db in sorted(down):  # cut the system's outages out of it
        cut = []
        for a, b in merged:
            cut += [[a, b]] if db <= a or da >= b else [x for x in ([a, da], [db, b]) if x[1] > x[0]]
        merged = cut
    merged = [[max(a, 0.0), min(b, length_s)] for a, b in merged if min(b, length_s) > max(a, 0.0)]
    up = sum(b - a for a, b in merged)
    bounds = [0.0] + [x for ab in merged for x in ab] + [length_s]
    outages = [[a, b] for a, b in zip(bounds[::2], bounds[1::2]) if b - a > 1e-9]
    return {"uptime": _ratio(up, length_s), "up_s": up, "down_s": length_s - up, "outages": outages}


def syncer_outages(events: list[dict] | None, t0: float) -> list[tuple[float, float]]:
    """The syncer's outages (s since ``t0``): each failure or kill to the next resume (else infinity)."""
    return [
        (r["failed_at_s"] - t0, math.inf if r["resumed_at_s"] is None else r["resumed_at_s"] - t0)
        for r in syncer_restarts(events)
    ]


def uptime(advances: list[float], start: float, end: float, factor: float = STALL_FACTOR) -> dict:
    """Share of the span in which the global model advanced (docs/report.md, "Merge cadence"); seconds.
    ``advances``: the times it advanced (merges; DP steps past the high-water mark). ``uptime`` = 1 −
    Σ (stall − median) / (end − first advance) (None with fewer than two advances; 0 with none),
    ``uptime_span`` the same over end − start; also ``stalls`` ([start, end] of gaps over ``factor`` ×
    the median), ``longest_stall_s``/``_at_s`` (the longest gap, stall or not) and ``startup_s``."""
    span = end - start
    ts = sorted(t for t in advances if start <= t <= end)
    out = dict.fromkeys(("uptime", "uptime_span", "stalled_s", "median_gap_s", "threshold_s")) | {"factor": factor}
    out |= {"stalls": [], **dict.fromkeys(("longest_stall_s", "longest_stall_at_s"))}
    out |= {"startup_s": ts[0] - start if ts else None, "advances": len(ts), "span_s": span}
    if span <= 0:
        return out
    gaps = list(zip(ts, ts[1:] + [end])) or [(start, end)]  # no advance: the whole span is one stall
    a, b = max(gaps, key=lambda g: g[1] - g[0])
    out["longest_stall_s"], out["longest_stall_at_s"] = b - a, a
    if not ts:
        out.update(uptime=0.0, uptime_span=0.0, stalled_s=span, stalls=[[start, end]])
        return out
    inner = [b - a for a, b in zip(ts, ts[1:])]
    if not inner:
        return out
    med = statistics.median(inner)
    thr = factor * med
    stalls = [(a, b) for a, b in gaps if b - a > thr]
    stalled = sum(b - a - med for a, b in stalls)
    lead = ts[0] - start
    lead_stall = lead - med if lead > thr else 0.0
    after = end - ts[0]
    out.update(
        uptime=max(0.0, 1.0 - stalled / after) if after > 0 else None,
        uptime_span=max(0.0, 1.0 - (stalled + lead_stall) / span),
        stalled_s=stalled,
        median_gap_s=med,
        threshold_s=thr,
        stalls=[[a, b] for a, b in stalls],
    )
    return out


# --- the goodput simulator's prediction ----------------------------------------------------------


def _plan(config: ExperimentConfig | None, schedule: ChaosSchedule | None) -> ChaosPlan | None:
    """The chaos plan the schedule was drawn from: ``chaos.schedule``, else the one a replay saved."""
    if config is not None and config.chaos.schedule is not None:
        return config.chaos.schedule
    saved = schedule.plan if schedule else None
    if not isinstance(saved, dict):
        return None
    try:
        return ChaosPlan.model_validate(saved)
    except ValidationError:
        return None


def simulator_knobs(
    config: ExperimentConfig | None,
    dp: dict | None,
    dp_summary: dict | None = None,
    schedule: ChaosSchedule | None = None,
) -> dict:
    """The goodput simulator's knobs (``sim.config.GoodputConfig`` fields) for this run's chaos, or
    ``{"status": why not}``: chips = learners = [M], quorum 1, the schedule's MTBF and restart-delay law,
    DP's measured step time, checkpoint interval and mean restore seconds (docs/report.md, "The
    simulator's prediction")."""
    if config is None:
        return {"status": "no prediction (no config.json)"}
    plan = _plan(config, schedule)
    if plan is None:
        why = "chaos.replay: a replayed schedule carries no mtbf_s" if config.chaos.replay else "no chaos.schedule"
        return {"status": f"no prediction ({why})"}
    mtbf = plan.mtbf_s
    if mtbf is None:
        return {"status": "no prediction (chaos.schedule.mtbf_s unset: no failures drawn)"}
    M = config.diloco.learners
    step_s = (dp or {}).get("step_s")
    if not step_s:
        return {"status": "no prediction (no measured DP step time: DP did not run or logged < 2 steps)"}
    notes = []
    summary = Summary.model_validate(dp_summary or {})
    ckpt = num((summary.chaos or {}).get("checkpoint_every_steps"))
    if not ckpt:
        ckpt = summary.steps or 1
        notes.append(
            f"DP took no checkpoints: checkpoint_every_steps = its {ckpt} steps (the closest valid "
            "setting: the simulator needs a positive interval)"
        )
    restores = [x["restore_s"] for x in (dp or {}).get("restores") or [] if x.get("restore_s") is not None]
    restart = sum(restores) / len(restores) if restores else 0.0
    if not restores:
        notes.append("DP restored nothing: restart_s = 0")
    delay = plan.restart_delay
    knobs = {
        "chips": [M],
        "slice_chips": 1,
        "learners": [M],
        "quorum": 1,
        "chip_mtbi_years": mtbf / (365.0 * 24 * 3600),
        "detect_s": 0.0,
        "recovery_a": delay.a,
        "recovery_c": delay.c,
        "recovery_scale_s": delay.scale_s,
        "step_s": float(step_s),
        "checkpoint_every_steps": int(ckpt),
        "restart_s": float(restart),
        "downscale_s": 0.0,
        "upscale_s": 0.0,
        "failures_per_run": SIM_FAILURES_PER_RUN,
        "seeds": SIM_SEEDS,
        "seed": plan.seed,
        "rule_of_thumb": False,
    }
    return {"status": "ok", "knobs": knobs, "systems": ["dp", f"diloco-{M}"], "mtbf_s": mtbf, "notes": notes}


def simulator_prediction(
    knobs: dict,
    predict: Callable[[dict, list[str]], dict] | None,
    diloco: dict | None = None,
    resume_every_steps: int | None = None,
) -> dict:
    """The simulator's goodput and uptime (fractions, with 95 % half-widths) for ``knobs``
    (:func:`simulator_knobs`) by ``predict(knobs, systems) -> {system: {"goodput", "goodput_ci", "uptime",
    "uptime_ci"}}`` (None: not computed), and ``diloco_rollback`` given ``resume_every_steps``."""
    out = {**knobs, "predicted": {}}
    if knobs.get("status") != "ok":
        return out
    if predict is None:
        out["status"] = "not computed (the report was built without the simulator; `ddiloco report RUN` runs it)"
        return out
    try:
        out["predicted"] = predict(knobs["knobs"], knobs["systems"])
        sps = [row["s_per_step"] for row in (diloco or {}).get("learners") or [] if row.get("s_per_step")]
        if resume_every_steps and sps:
            step = statistics.median(sps) * resume_every_steps
            system = knobs["systems"][1]
            rb = predict({**knobs["knobs"], "step_s": step}, [system])
            out["predicted"]["diloco_rollback"] = {**rb[system], "step_s": step}
    except ValueError as exc:  # the simulator's validators refused a knob
        first = str(exc).splitlines()
        out["status"] = f"the simulator refused these knobs ({first[0] if first else exc})"
    return out


# --- held-out loss at equal wall time and tokens -------------------------------------------------


def curve_points(rows: list[dict] | None, x_key: str, start_s: float = 0.0) -> list[tuple[float, float]]:
    """(x, held-out loss) of an eval curve: x = ``tokens``, or ``wall_s`` − ``start_s`` (seconds since
    the method's training start) for ``x_key`` "wall_s"; sorted by x, non-finite losses dropped."""
    pts = [(num(r.get(x_key)), num(r.get("val/loss"))) for r in rows or []]
    shift = start_s if x_key == "wall_s" else 0
    return sorted(
        ((x - shift, y) for x, y in pts if x is not None and y is not None and math.isfinite(y)), key=lambda p: p[0]
    )


def interpolate(points: list[tuple[float, float]], x: float | None) -> float | None:
    """The linear interpolation of ``points`` (sorted by x) at ``x``; None outside their range."""
    if x is None or not points or x < points[0][0] - 1e-9 or x > points[-1][0] + 1e-9:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1] if abs(x - points[-1][0]) <= 1e-9 else points[0][1]


def loss_comparison(curves: dict[str, dict], at_s: float | None = None, at_tokens: float | None = None) -> dict:
    """Held-out loss (nats/token) of each curve, interpolated linearly at equal wall time ``at_s``
    (default: the shorter method's end) and equal tokens ``at_tokens`` (default: the common final
    count). ``curves``: name → ``{"rows": eval rows, "start_s": the method's training start on the
    rows' clock}``. Returns ``at_s``, ``at_tokens`` and per curve ``final_s``, ``final_tokens``,
    ``final_loss``, ``loss_at_s``, ``loss_at_tokens`` (None outside its range)."""
    pts = {
        k: (curve_points(c.get("rows"), "wall_s", c.get("start_s") or 0.0), curve_points(c.get("rows"), "tokens"))
        for k, c in curves.items()
    }
    pts = {k: v for k, v in pts.items() if v[0] or v[1]}
    ends = [[v[i][-1][0] for v in pts.values() if v[i]] for i in (0, 1)]
    at_s = at_s if at_s is not None else min(ends[0], default=None)
    at_tokens = at_tokens if at_tokens is not None else min(ends[1], default=None)
    per = {}
    for k, (by_t, by_n) in pts.items():
        per[k] = {
            "final_s": by_t[-1][0] if by_t else None,
            "final_tokens": by_n[-1][0] if by_n else None,
            "final_loss": (by_n or by_t)[-1][1],
            "loss_at_s": interpolate(by_t, at_s),
            "loss_at_tokens": interpolate(by_n, at_tokens),
        }
    return {"at_s": at_s, "at_tokens": at_tokens, "curves": per}


# --- the schedule's events -----------------------------------------------------------------------

_TIMED = re.compile(r"at ([0-9.]+) s of training")


def _took(x: Merge, learner: Any, c: Corrupt) -> bool:
    """Whether merge ``x`` took ``learner``'s submission ``c``: same fragment and local step, and where known
    the same base version (``version`` − 1 − ``stale``) and attempt (a retry resends from a newer base)."""
    if x.fragment != c.fragment:
        return False
    for i, (who, s) in enumerate(zip(x.contributors, x.local_steps or [])):
        if lid(who) != learner or s != c.step:
            continue
        if x.attempts is not None and c.attempt is not None and i < len(x.attempts) and x.attempts[i] != c.attempt:
            continue
        behind = x.stale[i] if i < len(x.stale) and not isinstance(x.stale[i], bool) else None
        if c.base_version is None or x.version is None or behind is None or x.version - 1 - behind == c.base_version:
            return True
    return False


def _slowed(evs: list) -> int:
    return sum(1 for e in evs if isinstance(e, Slowdown | DPEvent) and e.event == "slowdown" and e.factor > 1.0)


def schedule_counts(
    schedule: ChaosSchedule | None,
    diloco: dict | None,
    events: list[dict] | None,
    merges: list[dict] | None,
    dp: dict | None,
    dp_events: list[dict] | None,
) -> dict:
    """The schedule's events, drawn and met by each method (docs/report.md, "The schedule's events"):
    ``failures`` and ``slowdowns`` (``drawn``, ``<method>_in_span``, ``<method>_fired``; slowdowns also
    ``by_kind``), ``scavenged`` (per window, span seconds) and ``corruptions`` (per scheduled one)."""
    per = learner_events(events)
    t0, d_end = ((diloco or {}).get("span") or {}).get("start_s"), ((diloco or {}).get("span") or {}).get("end_s")
    p_end = ((dp or {}).get("span") or {}).get("end_s")
    own = [e for evs in per.values() for e in evs]
    dp_evs = [e for e in parse(DPLine, dp_events) if isinstance(e, DPEvent)]
    starts = {m: [e.origin for e in evs if isinstance(e, Start) and e.origin is not None] for m, evs in per.items()}
    origins = {m: o[0] for m, o in starts.items() if o}
    fallback = min(origins.values()) if origins else t0

    def in_diloco(m: Any, at: float | None) -> bool | None:
        o = origins.get(lid(m), fallback)
        return None if o is None or d_end is None or at is None else o + at < d_end

    def counts(drawn: list, at: str, fired_d: int, fired_p: int) -> dict:
        return {
            "drawn": len(drawn),
            "diloco_in_span": sum(1 for x in drawn if in_diloco(x.learner, getattr(x, at))),
            "diloco_fired": fired_d if events is not None else None,
            "dp_in_span": sum(1 for x in drawn if p_end is not None and getattr(x, at) < p_end) if dp else None,
            "dp_fired": fired_p if dp else None,
        }

    fails, slows = (schedule.failures, schedule.slowdowns) if schedule else ([], [])
    fired = sum(1 for e in own if isinstance(e, Failure) and _TIMED.search(e.reason or ""))
    kinds = {k: sum(1 for s in slows if (s.cause or "straggler") == k) for k in ("straggler", "heterogeneity")}
    return {
        "failures": counts(fails, "at_s", fired, sum(1 for e in dp_evs if e.event == "failure")),
        "slowdowns": {**counts(slows, "from_s", _slowed(own), _slowed(dp_evs)), "by_kind": kinds},
        "scavenged": [_scavenged(p, per, t0) for p in schedule.presence] if schedule else [],
        "corruptions": _corruptions(schedule.corruptions if schedule else [], per, events, merges, t0),
    }


def _scavenged(p: PresenceEvent, per: dict[Any, list], t0: float | None) -> dict:
    """One scheduled presence window with the learner's ``join``/``leave`` (seconds since ``t0``)."""
    at = [
        next((e.t - t0 for e in per.get(p.learner, []) if e.event == k and t0 is not None), None)
        for k in ("join", "leave")
    ]
    return {"learner": p.learner, "join_s": p.join_s, "leave_s": p.leave_s, "joined_at_s": at[0], "left_at_s": at[1]}


def _corruptions(
    scheduled: list[CorruptEvent],
    per: dict[Any, list],
    events: list[dict] | None,
    merges: list[dict] | None,
    t0: float | None,
) -> list[dict]:
    """Per scheduled corruption (by time): whether it was sent, dropped (and why), merged, resent."""
    dropped = [e for e in parse(LearnersLine, events) if e.event == "dropped"]
    took = None if merges is None else parse(Merge, merges)
    out, used = [], set()
    fate = ("sent_at_s", "fragment", "step", "dropped", "reason", "merged", "resent_by_a_later_attempt")
    for c in scheduled:
        m, mine, kinds = c.learner, per.get(c.learner, []), (None, c.corruption)
        ev = next((e for e in mine if isinstance(e, Corrupt) and id(e) not in used and e.kind in kinds), None)
        out.append({"learner": m, "at_s": c.at_s, "kind": c.corruption, "sent": ev is not None} | dict.fromkeys(fate))
        if ev is None:
            continue
        used.add(id(ev))
        drop = [d for d in dropped if lid(d.learner) == m and d.fragment == ev.fragment and (d.t or 0.0) >= ev.t - 1e-6]
        drop = next((d for d in drop if ev.base_version is None or d.base_version in (None, ev.base_version)), None)
        # A later attempt that resumed before that step sends the same (fragment, local step) again,
        # possibly from the same base version (nothing merged meanwhile): a merge after its start is
        # that clean copy's.
        resent = [e.t for e in mine if isinstance(e, Start) and e.t > ev.t and (e.step or 0) < (ev.step or 0)]
        hits = [x for x in took or [] if _took(x, m, ev) and (x.merged_at_s or 0.0) > ev.t]
        if all(x.attempts is not None for x in hits):  # merges name each contributor's attempt: exact
            merged = bool(hits)
        else:  # an older run: a merge after a later attempt's start is taken as that clean copy's
            merged = any(not any(t_r < x.merged_at_s for t_r in resent) for x in hits)
        reason = drop.reason if drop else None
        out[-1].update(sent_at_s=ev.t - t0 if t0 is not None else None, fragment=ev.fragment, step=ev.step)
        out[-1].update(dropped=drop is not None, reason=reason, merged=merged if took is not None else None)
        out[-1]["resent_by_a_later_attempt"] = bool(resent)
    return out


# --- everything ----------------------------------------------------------------------------------


def diloco_training_start(events: list[dict] | None, summary: dict | None) -> float:
    """A DiLoCo run's training start on the run clock: its span's start, else the summary's ``startup_s``, else 0."""
    span = diloco_span(events)
    return span["start_s"] if span is not None else Summary.model_validate(summary or {}).startup_s or 0.0


def _curves(methods: dict[str, dict | None]) -> dict[str, dict]:
    """:func:`loss_comparison`'s curves: per method with an eval curve, its rows and training start."""
    return {
        m: {
            "rows": r["curve"],
            "start_s": diloco_training_start(r.get("events"), r.get("summary")) if m == "diloco" else 0.0,
        }
        for m, r in methods.items()
        if r and r.get("curve")
    }


def resilience_figures(
    config: ExperimentConfig | None,
    schedule: ChaosSchedule | None,
    diloco: dict | None,
    dp: dict | None,
    reference: dict | None = None,
    predict: Callable | None = None,
    diloco_now: float | None = None,
    dp_now: float | None = None,
) -> dict:
    """The whole Resilience section, once. ``diloco``/``dp``: the method's records as dicts (``events``
    (DiLoCo: learners.jsonl; DP: its events.jsonl), ``merges``, ``train``, ``curve`` (eval.jsonl),
    ``summary``), None when it did not run. ``reference``: ``{"run_dir", "diloco", "dp"}`` of a run
    without chaos. ``predict``: see :func:`simulator_prediction`. ``diloco_now``, ``dp_now``: the present
    on each method's clock, for a run in progress. Returns ``diloco`` (:func:`diloco_resilience`),
    ``dp`` (:func:`dp_resilience`), ``simulator``, ``loss`` (this run's curves and the reference's at this
    run's equal time and tokens, and the reference's own ``reference_pair``), ``schedule``
    (:func:`schedule_counts`) and ``summary`` (the headline figures)."""
    resume = config.diloco.resume_every_steps if config is not None else None
    resume = int(resume) if resume else None
    workers = config.dp.workers if config is not None else None
    dil, dpr = diloco or {}, dp or {}
    d = diloco_resilience(dil.get("events"), dil.get("merges"), schedule, diloco_now, resume) if diloco else None
    if dp and workers is None:
        workers = num(Summary.model_validate(dp.get("summary") or {}).hyperparameters.get("simulated workers"))
    p = dp_resilience(dp.get("events"), dp.get("train"), int(workers or 1), schedule, dp_now) if dp else None
    knobs = simulator_knobs(config, p, dpr.get("summary"), schedule)
    sim = simulator_prediction(knobs, predict, d, resume)

    loss = loss_comparison(_curves({"diloco": diloco, "dp": dp}))
    ref_out = None
    if reference:
        ref_curves = _curves({m: reference.get(m) for m in ("diloco", "dp")})
        ref_out = {
            "run_dir": reference.get("run_dir"),
            "methods": list(ref_curves),
            "at_this_runs_points": loss_comparison(ref_curves, loss["at_s"], loss["at_tokens"]) if ref_curves else None,
            "reference_pair": loss_comparison(ref_curves) if ref_curves else None,
        }
    loss["reference"] = ref_out
    counts = schedule_counts(schedule, d, dil.get("events"), dil.get("merges"), p, dpr.get("events"))
    pred = sim.get("predicted") or {}
    M = (knobs.get("knobs") or {}).get("learners", [None])[0]
    # the headline: each method's measured uptime and goodput, then the simulator's predicted goodputs
    measured = {"diloco": d or {}, "dp": p or {}}
    summary = {
        f"{m}_{k}": r.get(part, {}).get(k)
        for k, part in (("uptime", "uptime"), ("goodput", "global"))
        for m, r in measured.items()
    }
    predicted = (("diloco", f"diloco-{M}"), ("dp", "dp"), ("diloco_rollback", "diloco_rollback"))
    summary |= {f"predicted_{k}_goodput": (pred.get(system) or {}).get("goodput") for k, system in predicted}
    summary["learners"] = M
    return {
        "status": "ok",
        "diloco": d,
        "dp": p,
        "simulator": sim,
        "loss": loss,
        "schedule": counts,
        "summary": summary,
        "stall_factor": STALL_FACTOR,
    }
