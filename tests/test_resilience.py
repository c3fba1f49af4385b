"""Goodput, uptime and the Resilience section (reports/resilience.py), on hand-made event lists with
answers you can add up, a hand-made run directory, and one real tiny pipeline run under a chaos
schedule.

Hand-made cases (seconds):
- one learner, span 0–10, down from a failure at 4 s to its restart at 6 s → goodput 8 / 10 = 80 %;
  restarted from step 30 after failing at step 40 at 0.1 s a step → 1 s of lost work → 70 %;
- a wait of 1.5 s → waiting 1.5, goodput 85 %;
- a scavenged learner joining at 3 s and leaving at 7 s of a 10 s span → allocated 4 s, absent 6 s;
- DP, W = 2, 0.1 s a step: replica 1 fails at 2.5 s (step 25), the job is back at 5.5 s restored to
  step 20: down (replica 1) / waiting (replica 0) 3 s, recomputing 5 steps = 0.5 s;
- DP, W = 4, replica 2 twice as slow from 2 s to 6 s → it straggles 4 s, the three others wait
  (1 − 1/2) × 4 = 2 s each;
- merges every 0.1 s with one 2 s gap over a 10 s span → stall 2 − 0.1 = 1.9 s, uptime 81 %.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from configs.chaos import ChaosSchedule
from configs.faults import CorruptEvent, FailEvent, PresenceEvent, SlowdownEvent
from reports import build_report
from reports.resilience import (
    diloco_resilience,
    dp_resilience,
    interpolate,
    loss_comparison,
    schedule_counts,
    simulator_knobs,
    state_uptime,
    syncer_outages,
    uptime,
)
from run.layout import RunLayout
from tests.conftest import squash


def _state(m: int | None, state: str, t: float, attempt: int | None = 1, **more) -> dict:
    """A state event (run.records.StateEvent) of learner ``m`` (None: the DP job)."""
    who = {} if m is None else {"learner": m, "attempt": attempt}
    return {"event": "state", "state": state, **who, "t": t, **more}


def _row(res: dict, m: int) -> dict:
    return next(r for r in res["learners"] if r["learner"] == m)


def _secs(ivs: list[dict], state: str) -> float:
    return sum(iv["end"] - iv["start"] for iv in ivs if iv["state"] == state)


# --- DiLoCo ----------------------------------------------------------------------------------------


def test_a_learner_down_two_of_ten_seconds_has_80_percent_goodput():
    events = [
        {"event": "start", "learner": 0, "attempt": 1, "step": 0, "t": 0.0},
        {"event": "step", "learner": 0, "step": 40, "t": 4.0},
        {"event": "failure", "learner": 0, "attempt": 1, "step": 40, "t": 4.0, "reason": "InjectedFailure('x')"},
        {"source": "syncer", "event": "liveness", "learner": 0, "alive": False, "t": 4.0},
        {"event": "start", "learner": 0, "attempt": 2, "step": 40, "t": 6.0},
        {"event": "stop", "learner": 0, "attempt": 2, "step": 80, "t": 10.0},
        _state(0, "up", 0.0),
        _state(0, "down", 4.0),
        _state(0, "restarting", 5.0, 2),
        _state(0, "up", 6.0, 2),
        _state(0, "done", 10.0, 2),
    ]
    res = diloco_resilience(events, [{"merged_at_s": 8.0, "fragment": 0, "contributors": [0]}])
    r = _row(res, 0)
    assert res["span"] == {"start_s": 0.0, "end_s": 10.0, "length_s": 10.0, "clock": "run clock (s)"}
    assert (r["allocated_s"], r["down_s"], r["running_s"], r["lost_work_s"]) == (10.0, 2.0, 8.0, 0.0)
    assert r["restarting_s"] == 1.0 and r["goodput"] == pytest.approx(0.8)
    assert (r["failures"], r["restarts"], r["merged_again_after_restart"]) == (1, 1, True)
    assert res["timelines"]["0"] == [
        {"state": "running", "start": 0.0, "end": 4.0},
        {"state": "down", "start": 4.0, "end": 6.0, "why": "failure"},
        {"state": "running", "start": 6.0, "end": 10.0},
    ]
    # Restarted from its resume point at step 30: 10 steps taken again, at attempt 1's 4 s / 40 steps.
    events[4] = {**events[4], "step": 30}
    r = _row(diloco_resilience(events), 0)
    assert r["lost"][0]["lost_steps"] == 10 and r["lost"][0]["s_per_step"] == pytest.approx(0.1)
    assert r["lost_work_s"] == pytest.approx(1.0) and r["goodput"] == pytest.approx(0.7)
    assert r["merged_again_after_restart"] is False  # no merge lists it after the restart


def test_a_wait_is_not_useful_and_a_slowed_learner_is():
    events = [
        {"event": "start", "learner": 0, "attempt": 1, "step": 0, "t": 0.0},
        {
            "event": "wait",
            "learner": 0,
            "attempt": 1,
            "step": 8,
            "fragment": 1,
            "wait_s": 1.5,
            "t": 2.0,
            "timed_out": False,
        },
        {"event": "slowdown", "learner": 0, "attempt": 1, "factor": 2.0, "step": 20, "t": 5.0},
        {"event": "slowdown", "learner": 0, "attempt": 1, "factor": 1.0, "step": 25, "t": 7.0},
        {"event": "stop", "learner": 0, "attempt": 1, "step": 50, "t": 10.0},
        _state(0, "up", 0.0),
        _state(0, "done", 10.0),
    ]
    r = _row(diloco_resilience(events), 0)
    assert (r["waiting_s"], r["straggling_s"], r["running_s"]) == pytest.approx((1.5, 2.0, 6.5))
    assert r["goodput"] == pytest.approx(0.85)


def test_a_scavenged_learner_is_allocated_only_its_window():
    events = [
        {"event": "start", "learner": 0, "attempt": 1, "step": 0, "t": 0.0},
        _state(0, "up", 0.0),
        {"event": "join", "learner": 1, "attempt": 1, "t": 3.0},
        {"event": "start", "learner": 1, "attempt": 1, "step": 0, "t": 3.0},
        {"event": "leave", "learner": 1, "attempt": 1, "step": 40, "t": 7.0},
        {"event": "stop", "learner": 1, "attempt": 1, "step": 40, "t": 7.0},
        {"event": "stop", "learner": 0, "attempt": 1, "step": 100, "t": 10.0},
        _state(1, "up", 3.0),
        _state(1, "done", 7.0, reason="left"),
        _state(0, "done", 10.0),
    ]
    sched = ChaosSchedule(learners=2, events=[PresenceEvent(learner=1, join_s=3.0, leave_s=7.0)])
    res = diloco_resilience(events, [], sched)
    r = _row(res, 1)
    assert r["scavenged"] and r["window"] == [3.0, 7.0]
    assert (r["allocated_s"], r["running_s"], r["absent_s"], r["down_s"]) == (4.0, 4.0, 6.0, 0.0)
    assert r["goodput"] == 1.0
    assert res["global"]["allocated_s"] == 14.0 and res["global"]["goodput"] == 1.0
    # Live, before it joined: nothing allocated yet, absent so far.
    live = diloco_resilience(events[:2], [], sched, now=2.0)
    assert _row(live, 1)["allocated_s"] == 0.0 and _row(live, 1)["goodput"] is None
    assert _row(live, 1)["absent_s"] == 2.0 and _row(live, 0)["running_s"] == 2.0


def test_a_run_in_progress_ends_at_now():
    events = [
        {"event": "start", "learner": 0, "attempt": 1, "step": 0, "t": 1.0},
        {"event": "failure", "learner": 0, "attempt": 1, "step": 12, "t": 3.0, "reason": "x"},
        _state(0, "up", 1.0),
        _state(0, "down", 3.0),
    ]
    res = diloco_resilience(events, now=5.0, resume_every_steps=10)
    r = _row(res, 0)
    assert res["span"]["length_s"] == 4.0 and r["down_s"] == 2.0  # still down at now
    assert r["lost"][0]["lost_steps"] == 2  # back to its last resume point, step 10, at best


def test_corrupted_submissions_dropped_and_never_merged():
    events = [
        {"event": "start", "learner": 0, "attempt": 1, "step": 0, "t": 0.0, "origin": 0.0},
        {"event": "corrupt", "learner": 0, "fragment": 1, "kind": "nan", "step": 3, "base_version": 2, "t": 1.0},
        {
            "event": "dropped",
            "learner": 0,
            "fragment": 1,
            "reason": "non-finite",
            "base_version": 2,
            "t": 1.1,
            "source": "syncer",
        },
        {"event": "stop", "learner": 0, "attempt": 1, "step": 9, "t": 4.0},
        _state(0, "up", 0.0),
        _state(0, "done", 4.0),
    ]
    # A retried attempt sending the same local step again from a newer base (version 5 − 1 − 0 = 4) is
    # another submission.
    merges = [
        {"fragment": 1, "version": 3, "contributors": [0], "local_steps": [7], "stale": [0], "merged_at_s": 2.0},
        {"fragment": 1, "version": 5, "contributors": [0], "local_steps": [3], "stale": [0], "merged_at_s": 2.5},
    ]
    sched = ChaosSchedule(
        learners=1,
        events=[
            FailEvent(learner=0, at_s=9.0, restart_delay_s=1.0),
            CorruptEvent(learner=0, at_s=0.5, corruption="nan"),
        ],
    )
    counts = schedule_counts(sched, diloco_resilience(events, merges), events, merges, None, None)
    assert counts["corruptions"] == [
        {
            "learner": 0,
            "at_s": 0.5,
            "kind": "nan",
            "sent": True,
            "sent_at_s": 1.0,
            "fragment": 1,
            "step": 3,
            "dropped": True,
            "reason": "non-finite",
            "merged": False,
            "resent_by_a_later_attempt": False,
        }
    ]
    assert counts["failures"]["drawn"] == 1 and counts["failures"]["diloco_in_span"] == 0
    merges.append(
        {"fragment": 1, "version": 6, "contributors": [0], "local_steps": [3], "stale": [3], "merged_at_s": 3.0}
    )  # base 6 − 1 − 3 = 2: the corrupted one
    counts = schedule_counts(sched, diloco_resilience(events, merges), events, merges, None, None)
    assert counts["corruptions"][0]["merged"] is True
    # The learner failed and a retry from step 0 sent local step 3 again from the same base before
    # that merge: the merge is the clean copy's.
    events[3:3] = [
        {"event": "failure", "learner": 0, "attempt": 1, "step": 3, "t": 1.2, "reason": "x"},
        {"event": "start", "learner": 0, "attempt": 2, "step": 0, "t": 1.5},
    ]
    counts = schedule_counts(sched, diloco_resilience(events, merges), events, merges, None, None)
    assert counts["corruptions"][0]["merged"] is False and counts["corruptions"][0]["resent_by_a_later_attempt"]


# --- DP --------------------------------------------------------------------------------------------


def test_dp_failure_stall_and_recomputation():
    train = [{"step": s, "t": s / 10} for s in (10, 20)] + [{"step": s, "t": 5.5 + (s - 20) / 10} for s in (30, 40, 50)]
    events = [
        {"event": "failure", "replica": 1, "step": 25, "t": 2.5, "at_s": 2.5, "restart_delay_s": 2.9},
        {"event": "restore", "step": 20, "lost_steps": 5, "t": 5.5, "restore_s": 0.1, "down_s": 3.0},
        *(_state(None, s, t) for s, t in (("up", 0.0), ("down", 2.5), ("restarting", 5.4), ("up", 5.5))),
    ]
    res = dp_resilience(events, train, workers=2)
    assert res["step_s"] == pytest.approx(0.1) and res["span"]["length_s"] == pytest.approx(8.5)
    (x,) = res["restores"]
    assert (x["down_s"], x["lost_steps"], x["high_water_step"]) == (3.0, 5, 25)
    assert x["recompute_s"] == pytest.approx(0.5)
    r0, r1 = res["replicas"]
    assert r1["down_s"] == pytest.approx(3.0) and r1["waiting_s"] == 0.0 and r1["failures"] == 1
    assert r0["waiting_s"] == pytest.approx(3.0) and r0["down_s"] == 0.0
    for r in (r0, r1):
        assert r["recomputing_s"] == pytest.approx(0.5)
        assert r["goodput"] == pytest.approx(5.0 / 8.5)
    assert res["global"]["goodput"] == pytest.approx(5.0 / 8.5)


def test_dp_slowdown_the_other_replicas_wait_for_the_slowest():
    train = [{"step": s, "t": s / 10} for s in range(10, 101, 10)]
    events = [
        {"event": "slowdown", "factor": 2.0, "step": 20, "t": 2.0},
        {"event": "slowdown", "factor": 1.0, "step": 40, "t": 6.0},
        _state(None, "up", 0.0),
    ]
    sched = ChaosSchedule(learners=4, events=[SlowdownEvent(learner=2, factor=2.0, from_s=2.0, to_s=6.0)])
    res = dp_resilience(events, train, workers=4, schedule=sched)
    by = {r["replica"]: r for r in res["replicas"]}
    assert by[2]["straggling_s"] == pytest.approx(4.0) and by[2]["goodput"] == pytest.approx(1.0)
    for r in (0, 1, 3):
        assert by[r]["waiting_s"] == pytest.approx(2.0)  # (1 − 1/f) of the 4 s
        assert by[r]["goodput"] == pytest.approx(0.8)
    assert res["global"]["goodput"] == pytest.approx((10 + 3 * 8) / 40)
    assert res["slowdown_unattributed_s"] == 0.0
    # Without the schedule the slowed replica is unknown: row 0 is drawn as the slowed one.
    res = dp_resilience(events, train, workers=4)
    assert res["replicas"][0]["straggling_s"] == pytest.approx(4.0)
    assert res["slowdown_unattributed_s"] == pytest.approx(4.0)
    # A failure during a slowdown: the waiting share is counted outside the stall only.
    events = [
        {"event": "slowdown", "factor": 2.0, "step": 1, "t": 0.0},
        {"event": "failure", "replica": 0, "step": 40, "t": 4.0, "at_s": 4.0, "restart_delay_s": 2.0},
        {"event": "restore", "step": 40, "lost_steps": 0, "t": 6.0, "restore_s": 0.0, "down_s": 2.0},
        *(_state(None, s, t) for s, t in (("up", 0.0), ("down", 4.0), ("up", 6.0))),
    ]
    sched = ChaosSchedule(learners=2, events=[SlowdownEvent(learner=1, factor=2.0, cause="heterogeneity")])
    r0, r1 = dp_resilience(events, train, workers=2, schedule=sched)["replicas"]
    assert (r0["running_s"], r0["waiting_s"], r0["down_s"]) == pytest.approx((4.0, 4.0, 2.0))
    assert (r1["straggling_s"], r1["waiting_s"], r1["goodput"]) == pytest.approx((8.0, 2.0, 0.8))


# --- uptime, loss, the simulator -------------------------------------------------------------------


def test_state_uptime_is_the_share_with_a_learner_computing_and_the_syncer_up():
    """Learner 0 runs 0–4 s and 6–10 s, learner 1 runs 3–5 s: nothing computes 5–6 s (1 s); the syncer
    is down 8–8.5 s: uptime (10 − 1.5) / 10."""
    tl = {
        "0": [
            {"state": "running", "start": 0.0, "end": 4.0},
            {"state": "down", "start": 4.0, "end": 6.0},
            {"state": "running", "start": 6.0, "end": 10.0},
        ],
        "1": [
            {"state": "absent", "start": 0.0, "end": 3.0},
            {"state": "straggling", "start": 3.0, "end": 5.0},
            {"state": "waiting", "start": 5.0, "end": 10.0},
        ],
    }
    out = syncer_outages([{"event": "syncer-failure", "t": 18.0}, {"event": "syncer-resumed", "t": 18.5}], t0=10.0)
    assert out == [(8.0, 8.5)]
    up = state_uptime(tl, 10.0, out)
    assert up["uptime"] == pytest.approx(0.85) and up["outages"] == [[5.0, 6.0], [8.0, 8.5]]
    assert state_uptime(tl, 10.0)["uptime"] == pytest.approx(0.9)


def test_uptime_with_one_long_merge_gap():
    merges = [i / 10 for i in range(51)] + [7.0 + i / 10 for i in range(31)]
    up = uptime(merges, 0.0, 10.0)
    assert up["median_gap_s"] == pytest.approx(0.1) and up["threshold_s"] == pytest.approx(0.4)
    assert up["stalls"] == [[5.0, 7.0]] and up["stalled_s"] == pytest.approx(1.9)
    assert up["uptime"] == pytest.approx(0.81)
    assert (up["longest_stall_s"], up["longest_stall_at_s"]) == (pytest.approx(2.0), 5.0)
    late = uptime([2.0 + x for x in merges if x <= 5.0], 0.0, 7.0)  # a 2 s start-up, then every 0.1 s
    assert late["startup_s"] == 2.0 and late["uptime"] == 1.0  # the start-up is left out
    assert late["uptime_span"] == pytest.approx(1 - 1.9 / 7)  # counted, it is a stall like any other
    stuck = uptime(merges[:51], 0.0, 10.0)  # live: no merge since 5 s
    assert stuck["stalls"] == [[5.0, 10.0]] and stuck["uptime"] == pytest.approx(1 - 4.9 / 10)
    assert uptime([], 0.0, 5.0)["uptime"] == 0.0


def test_loss_at_equal_wall_time_and_tokens():
    diloco = [
        {"tokens": 0, "wall_s": 1.0, "val/loss": 6.0},
        {"tokens": 100, "wall_s": 5.0, "val/loss": 5.0},
        {"tokens": 200, "wall_s": 11.0, "val/loss": 4.0},
    ]
    dp = [
        {"tokens": 0, "wall_s": 0.0, "val/loss": 6.0},
        {"tokens": 50, "wall_s": 2.0, "val/loss": 5.0},
        {"tokens": 150, "wall_s": 4.0, "val/loss": 4.5},
    ]
    out = loss_comparison({"diloco": {"rows": diloco, "start_s": 1.0}, "dp": {"rows": dp, "start_s": 0.0}})
    assert (out["at_s"], out["at_tokens"]) == (4.0, 150)  # DP's end; the common final count
    assert out["curves"]["diloco"]["loss_at_s"] == pytest.approx(5.0)  # aligned at its own start: 4 s
    assert out["curves"]["dp"]["loss_at_s"] == 4.5
    assert out["curves"]["diloco"]["loss_at_tokens"] == pytest.approx(4.5)
    assert interpolate([(0.0, 1.0), (2.0, 3.0)], 1.5) == 2.5 and interpolate([(0.0, 1.0)], 2.0) is None


def test_the_simulators_validators_accept_the_knobs():
    from configs.load import stored_config
    from sim.config import SECONDS_PER_YEAR, GoodputConfig

    config = stored_config(
        {
            "diloco": {"learners": 4, "learner_retries": 20},
            "chaos": {"schedule": {"seed": 3, "mtbf_s": 8.0, "restart_delay": {"a": 2.0, "c": 1.5, "scale_s": 1.0}}},
        }
    )
    dp = {"step_s": 0.005, "restores": [{"restore_s": 0.1}, {"restore_s": 0.3}]}
    k = simulator_knobs(config, dp, {"chaos": {"checkpoint_every_steps": 50}, "steps": 192})
    assert k["status"] == "ok" and k["systems"] == ["dp", "diloco-4"]
    cfg = GoodputConfig(**k["knobs"])
    assert cfg.chip_mtbi_years * SECONDS_PER_YEAR == pytest.approx(8.0)
    assert (cfg.restart_s, cfg.checkpoint_every_steps, cfg.slice_chips, cfg.detect_s) == (pytest.approx(0.2), 50, 1, 0)
    no_ckpt = simulator_knobs(config, dp, {"chaos": {"checkpoint_every_steps": None}, "steps": 192})
    assert GoodputConfig(**no_ckpt["knobs"]).checkpoint_every_steps == 192 and no_ckpt["notes"]
    assert (
        simulator_knobs(stored_config({"diloco": {"learners": 4}}), dp)["status"] == "no prediction (no chaos.schedule)"
    )
    assert simulator_knobs(None, dp)["status"] == "no prediction (no config.json)"


# --- a hand-made run directory ---------------------------------------------------------------------


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _hand_made_run(root: Path, chaos: bool = True) -> Path:
    lay = RunLayout(root)
    root.mkdir(parents=True, exist_ok=True)
    lay.config.write_text(
        json.dumps(
            {
                "name": "hand",
                "diloco": {"learners": 1, "quorum": 1, "resume_every_steps": 10},
                "dp": {"workers": 2},
                "chaos": {},
            }
        )
    )
    for m in ("diloco", "dp"):
        lay.summary("pretrain", m).parent.mkdir(parents=True, exist_ok=True)
        lay.summary("pretrain", m).write_text(
            json.dumps({"method": m, "tokens": 200, "steps": 80, "wall_s": 10.0, "final_val_loss": 4.0})
        )
    _jsonl(
        lay.metrics("pretrain", "diloco", "learners"),
        [
            {"event": "start", "learner": 0, "attempt": 1, "step": 0, "t": 0.0, "origin": 0.0},
            {"event": "failure", "learner": 0, "attempt": 1, "step": 40, "t": 4.0, "reason": "x at 4 s of training"},
            {"event": "start", "learner": 0, "attempt": 2, "step": 40, "t": 6.0, "origin": 0.0},
            {"event": "stop", "learner": 0, "attempt": 2, "step": 80, "t": 10.0},
            *(
                _state(0, s, t, a)
                for s, t, a in (
                    ("up", 0.0, 1),
                    ("down", 4.0, 1),
                    ("restarting", 5.5, 2),
                    ("up", 6.0, 2),
                    ("done", 10.0, 2),
                )
            ),
        ],
    )
    _jsonl(
        lay.metrics("pretrain", "diloco", "merges"),
        [
            {"fragment": 0, "version": i + 1, "contributors": [0], "local_steps": [i], "merged_at_s": 0.5 + i}
            for i in range(10)
        ],
    )
    curve = [{"tokens": 0, "wall_s": 0.0, "val/loss": 6.0}, {"tokens": 200, "wall_s": 10.0, "val/loss": 4.0}]
    _jsonl(lay.metrics("pretrain", "diloco", "eval"), curve)
    _jsonl(lay.metrics("pretrain", "dp", "eval"), curve)
    _jsonl(lay.metrics("pretrain", "dp", "train"), [{"step": s, "t": s / 10} for s in range(10, 101, 10)])
    if chaos:
        lay.chaos_schedule.write_text(
            json.dumps(
                {"learners": 1, "failures": [{"learner": 0, "at_s": 4.0, "restart_delay_s": 2.0, "how": "raise"}]}
            )
        )
        _jsonl(lay.metrics("pretrain", "dp", "events"), [{"event": "start", "t": 0.0}, _state(None, "up", 0.0)])
    return root


def test_the_resilience_section_of_a_hand_made_run(tmp_path: Path):
    run = _hand_made_run(tmp_path / "run")
    report = build_report(run)
    res = report["stages"]["pretrain"]["resilience"]
    assert res["diloco"]["global"]["goodput"] == pytest.approx(0.8)
    assert res["dp"]["global"]["goodput"] == pytest.approx(1.0)
    assert res["schedule"]["failures"] == {
        "drawn": 1,
        "diloco_in_span": 1,
        "diloco_fired": 1,
        "dp_in_span": 1,
        "dp_fired": 0,
    }
    assert res["simulator"]["status"].startswith("no prediction")  # config.json has no chaos.schedule
    plots = report["stages"]["pretrain"]["plots"]
    assert plots["resilience_timeline"] == "pretrain_resilience_timeline.png"
    assert plots["resilience_loss"] == "pretrain_resilience_loss.png"
    assert (RunLayout(run).report / plots["resilience_timeline"]).is_file()
    md = squash(RunLayout(run).report_md.read_text())
    assert "### Resilience" in md and "DiLoCo uptime" in md and "| 0 | 10.00 | 8.00 | 0.00 | 0.00 | 2.00 | 0.50 |" in md
    assert json.loads((RunLayout(run).report / "report.json").read_text()) == report
    # Without a schedule or DP events: no section, no figures.
    plain = build_report(_hand_made_run(tmp_path / "plain", chaos=False))
    assert "resilience" not in plain["stages"]["pretrain"]
    assert "resilience_timeline" not in plain["stages"]["pretrain"]["plots"]


def test_a_reference_run(tmp_path: Path):
    from reports import ReportInputError

    run, ref = _hand_made_run(tmp_path / "run"), _hand_made_run(tmp_path / "ref", chaos=False)
    report = build_report(run, reference=ref)
    loss = report["stages"]["pretrain"]["resilience"]["loss"]
    assert loss["reference"]["run_dir"] == str(ref)
    assert loss["reference"]["at_this_runs_points"]["curves"]["dp"]["loss_at_s"] == pytest.approx(4.0)
    assert "reference (no chaos)" in RunLayout(run).report_md.read_text()
    with pytest.raises(ReportInputError):
        build_report(run, reference=tmp_path / "missing")
    # From config.json, a vanished reference is a note, not an error.
    cfg = json.loads(RunLayout(run).config.read_text())
    RunLayout(run).config.write_text(json.dumps({**cfg, "chaos": {"reference_run": str(tmp_path / "missing")}}))
    report = build_report(run)
    assert report["stages"]["pretrain"]["resilience"]["loss"]["reference"] is None
    assert any("chaos.reference_run" in n for n in report["stages"]["pretrain"]["notes"])


# --- a real tiny run under a chaos schedule --------------------------------------------------------

# Seed 2 draws failures of learners 0 and 1 at 0.52 s and 1.04 s of training (the tiny run trains for
# about 3 s), at most 4 per learner over the 6 s horizon (learner_retries 6), and a straggler episode
# of learner 1 from 0.14 s.
CHAOS = {
    "seed": 2,
    "horizon_s": 6,
    "mtbf_s": 4,
    "restart_delay": {"scale_s": 0.5},
    "straggler_every_s": 3,
    "straggler_s": 1.0,
    "corrupt": [{"learner": 1, "at_s": 0.5, "corruption": "nan"}],
}


@pytest.fixture(scope="session")
def chaos_run(prefect_harness, small_cfg, small_data, tmp_path_factory):
    """The tiny pipeline on the small corpus once, under a seeded chaos schedule (failures, stragglers,
    one corrupted submission), evaluation and fine-tuning off."""
    from configs.schema import ExperimentConfig
    from flows.pipeline import pipeline

    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "diloco": {**small_cfg.diloco.model_dump(), "learner_retries": 6, "retry_delay_s": 0},
            "eval": {**small_cfg.eval.model_dump(), "enabled": False},
            "finetune": {**small_cfg.finetune.model_dump(), "enabled": False},
            "chaos": {**small_cfg.chaos.model_dump(), "schedule": CHAOS},
        }
    )
    run = tmp_path_factory.mktemp("chaos") / "run"
    shutil.copytree(small_data / "data", run / "data")
    pipeline(config=cfg, run_dir=str(run))
    return run


@pytest.mark.slow
def test_a_real_chaos_run(chaos_run: Path):
    from sim.study import simulate_goodput

    lay = RunLayout(chaos_run)
    report = build_report(chaos_run, predict=simulate_goodput)
    res = report["stages"]["pretrain"]["resilience"]
    md = squash(lay.report_md.read_text())
    assert "### Resilience" in md and "**Resilience:**" in md
    assert (lay.report / "pretrain_resilience_timeline.png").is_file()
    assert (lay.report / "pretrain_resilience_loss.png").is_file()
    d, p = res["diloco"], res["dp"]
    assert 0.0 < d["global"]["goodput"] <= 1.0 and 0.0 < p["global"]["goodput"] <= 1.0
    events = [json.loads(x) for x in lay.metrics("pretrain", "diloco", "learners").read_text().splitlines()]
    for r in d["learners"]:
        if r["allocated_s"] > 0:  # 0 % is possible: every step of every attempt thrown away
            assert 0.0 <= r["goodput"] <= 1.0
        # Down = the start-up before its first start + each failure (kill) → next start gap.
        mine = sorted(
            (e for e in events if e.get("learner") == r["learner"] and e.get("source") != "syncer"),
            key=lambda e: e["t"],
        )
        starts = [e for e in mine if e["event"] == "start"]
        gaps = sum(
            next((s["t"] for s in starts if s["t"] > f["t"]), d["span"]["end_s"]) - f["t"]
            for f in mine
            if f["event"] in ("failure", "kill")
        )
        startup = starts[0]["t"] - d["span"]["start_s"]
        assert r["down_s"] == pytest.approx(gaps + startup, abs=1e-9)
        assert r["failures"] == sum(1 for e in mine if e["event"] in ("failure", "kill"))
        ivs = d["timelines"][str(r["learner"])]
        assert sum(iv["end"] - iv["start"] for iv in ivs) == pytest.approx(d["span"]["length_s"])
        assert r["down_s"] == pytest.approx(_secs(ivs, "down"))
    assert sum(r["failures"] for r in d["learners"]) >= 1  # the schedule fired
    for r in p["replicas"]:
        assert sum(
            r[f"{s}_s"] for s in ("running", "straggling", "waiting", "recomputing", "down", "absent")
        ) == pytest.approx(p["span"]["length_s"])
    (c,) = res["schedule"]["corruptions"]
    assert c["sent"] and c["dropped"] and c["merged"] is False
    pred = res["simulator"]["predicted"]
    cfg = json.loads(lay.config.read_text())
    M = cfg["diloco"]["learners"]
    assert 0.0 < pred["dp"]["goodput"] < pred[f"diloco-{M}"]["goodput"] <= 1.0
    assert res["summary"]["predicted_diloco_goodput"] == pred[f"diloco-{M}"]["goodput"]
    # The command line: --reference (this run as its own reference: the same curves).
    from typer.testing import CliRunner

    from flows.cli import app

    out = CliRunner().invoke(app, ["report", str(chaos_run), "--reference", str(chaos_run)])
    assert out.exit_code == 0, out.output
    again = json.loads((lay.report / "report.json").read_text())["stages"]["pretrain"]["resilience"]["loss"]
    ours, theirs = again["curves"], again["reference"]["at_this_runs_points"]["curves"]
    assert {m: c["loss_at_tokens"] for m, c in ours.items()} == {m: c["loss_at_tokens"] for m, c in theirs.items()}
    assert CliRunner().invoke(app, ["report", str(chaos_run), "--reference", str(chaos_run / "nope")]).exit_code == 2
