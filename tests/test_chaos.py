"""The chaos engine (``configs.chaos``): seeded schedules that replay exactly, learners failing,
restarting after their delay, joining and leaving, waiting for overdue merges, submissions damaged
in flight and quarantined, DP stalled and rolled back by the same schedule, and one real Prefect run
of DiLoCo under a drawn schedule with its ledger balanced."""

import json
import shutil
import threading
import time

import numpy as np
import pytest
from pydantic import ValidationError

from configs.chaos import ChaosPlan, ChaosSchedule, draw_schedule, load_schedule
from configs.faults import FailEvent, PresenceEvent, SlowdownEvent
from configs.schema import ExperimentConfig
from diloco.exchange import InMemoryExchange
from diloco.faults import LearnerFaults, corrupt_payload
from diloco.fragments import balanced_fragments
from diloco.learner import InjectedFailure, run_learner
from diloco.pacing import FairTurns
from diloco.syncer import Syncer, SyncerSettings
from diloco.syncer_loop import liveness
from diloco.tensors import tensor_bytes, to_numpy
from diloco.wire import WireFormat
from run.layout import RunLayout
from run.metrics import read_jsonl
from tests.test_learner import B, L, _setup, tiny_trainer

PLAN = {
    "seed": 7,
    "horizon_s": 100.0,
    "mtbf_s": 20.0,
    "straggler_every_s": 30.0,
    "heterogeneity": [1.0, 1.0, 1.18, 1.18],
    "scavenged": [{"learner": 3, "join_s": 10.0, "leave_s": 60.0}],
    "corrupt": [{"learner": 1, "at_s": 5.0, "corruption": "nan"}],
}


# -- schedules ----------------------------------------------------------------------------------
def test_a_schedule_replays_identically_from_its_seed_and_its_file(tmp_path):
    plan = ChaosPlan.model_validate(PLAN)
    a, b = draw_schedule(plan, 4), draw_schedule(ChaosPlan.model_validate(PLAN), 4)
    assert a.dumps() == b.dumps() and a.failures  # the same seed, the same events, to the last digit
    assert draw_schedule(plan.model_copy(update={"seed": 8}), 4).failures != a.failures
    # independent streams: stragglers added or removed do not move a single failure
    calm = draw_schedule(plan.model_copy(update={"straggler_every_s": None}), 4)
    assert calm.failures == a.failures and len(calm.slowdowns) < len(a.slowdowns)
    # per learner a renewal process: each failure after the previous restart, inside the horizon
    for m in range(4):
        mine = a.learner_failures(m)
        assert all(y.at_s >= x.at_s + x.restart_delay_s for x, y in zip(mine, mine[1:]))
        assert all(0 < f.at_s < 100 and f.restart_delay_s > 0 for f in mine)
    assert all(10.0 <= f.at_s < 60.0 for f in a.learner_failures(3))  # the scavenged learner, in its window
    assert {(e.learner, e.factor) for e in a.slowdowns if e.cause == "heterogeneity"} == {(2, 1.18), (3, 1.18)}
    assert a.window(3) == (10.0, 60.0) and a.window(0) == (0.0, None)
    path = tmp_path / "chaos.json"
    path.write_text(a.dumps())
    assert load_schedule(path) == a
    # a run replaying the file gets exactly that schedule, for both methods
    cfg = ExperimentConfig.model_validate({"chaos": {"replay": str(path)}, "diloco": {"learner_retries": 9}})
    assert cfg.chaos_schedule() == a
    # the straggler count moves with the rate; the DP factor is the slowest replica's
    assert a.dp_factor(0.0) == 1.18


def test_an_earlier_runs_chaos_json_and_plan_read_as_the_same_events():
    """A chaos.json written before schedules held chaos.events' own events (lists failures, slowdowns,
    presence, corruptions), and a plan's corrupt entries spelled kind: nan, read as those events."""
    old = {
        "learners": 2,
        "failures": [{"learner": 1, "at_s": 3.0, "restart_delay_s": 1.0, "how": "sigkill"}],
        "slowdowns": [{"learner": 0, "factor": 1.18, "from_s": 0.0, "to_s": None, "kind": "heterogeneity"}],
        "presence": [{"learner": 1, "join_s": 1.0, "leave_s": None}],
        "corruptions": [{"learner": 0, "at_s": 2.0, "kind": "shape"}],
    }
    s = ChaosSchedule.model_validate(old)
    assert [e.kind for e in s.events] == ["kill", "slowdown", "presence", "corrupt"]
    assert (s.failures[0].how, s.failures[0].restart_delay_s) == ("sigkill", 1.0)
    assert (s.slowdowns[0].cause, s.corruptions[0].corruption, s.window(1)) == ("heterogeneity", "shape", (1.0, None))
    assert ChaosSchedule.loads(s.dumps()) == s
    plan = ChaosPlan.model_validate({"corrupt": [{"learner": 1, "at_s": 5.0, "kind": "nan"}]})
    assert plan.corrupt[0].corruption == "nan"


def test_drawn_replayed_and_written_schedules_speak_the_one_fault_language(tmp_path):
    """chaos.schedule, its replay and the same events written by hand in chaos.events give every
    learner the same typed faults (diloco.faults values); a config may mix both."""
    base = {"diloco": {"learners": 4, "quorum": 3, "learner_retries": 9}}
    drawn = ExperimentConfig.model_validate({**base, "chaos": {"schedule": PLAN}})
    path = tmp_path / "chaos.json"
    path.write_text(drawn.chaos_schedule().dumps())
    replayed = ExperimentConfig.model_validate({**base, "chaos": {"replay": str(path)}})
    events = [e.model_dump() for e in drawn.chaos_schedule().events]
    written = ExperimentConfig.model_validate({**base, "chaos": {"events": events}})
    kinds = {e["kind"] for e in events}
    assert kinds == {"fail", "slowdown", "corrupt", "presence"}, kinds  # (how auto on threads: raise)
    for m in range(4):
        faults = LearnerFaults.of(drawn.fault_events(), m)
        assert faults == LearnerFaults.of(replayed.fault_events(), m) == LearnerFaults.of(written.fault_events(), m)
    three = LearnerFaults.of(drawn.fault_events(), 3)
    assert (three.join_s, three.leave_s) == (10.0, 60.0)
    assert [c.at_s for c in LearnerFaults.of(drawn.fault_events(), 1).corruptions] == [5.0]
    assert all(f.restart_delay_s > 0 and f.at_s is not None for f in three.timed_failures)


def test_schedules_and_plans_refuse_what_cannot_happen(tmp_path):
    with pytest.raises(ValidationError, match="still down"):
        ChaosSchedule.model_validate(
            {
                "learners": 2,
                "failures": [
                    {"learner": 0, "at_s": 1.0, "restart_delay_s": 5.0},
                    {"learner": 0, "at_s": 3.0, "restart_delay_s": 1.0},
                ],
            }
        )
    with pytest.raises(ValidationError, match=r"events\[0\].learner \(2\) must be < the schedule's learners \(2\)"):
        ChaosSchedule.model_validate({"learners": 2, "failures": [{"learner": 2, "at_s": 1.0, "restart_delay_s": 1.0}]})
    with pytest.raises(ValidationError, match="a syncer_fail event has no place in a schedule"):
        ChaosSchedule.model_validate({"learners": 2, "events": [{"kind": "syncer_fail", "at_merge": 3}]})
    with pytest.raises(ValidationError, match="leaves"):
        ChaosPlan.model_validate({"scavenged": [{"learner": 0, "join_s": 5.0, "leave_s": 2.0}]})
    bad = tmp_path / "bad.json"
    bad.write_text('{"learners": "four"}')
    refusals = [
        ({"chaos": {"schedule": {"mtbf_s": 2.0, "horizon_s": 60.0}}}, "raise diloco.learner_retries to ≥"),
        (
            {
                "chaos": {"schedule": {"mtbf_s": 50.0, "horizon_s": 60.0, "how": "sigkill"}},
                "diloco": {"learner_retries": 20},
            },
            "SIGKILLs learners",
        ),
        ({"chaos": {"schedule": {"heterogeneity": [1.0, 1.18]}}}, "2 factors for 4 learners"),
        ({"chaos": {"replay": str(tmp_path / "none.json")}}, "no such file"),
        ({"chaos": {"replay": str(bad)}}, "chaos.replay: .* is not a chaos schedule"),
        ({"chaos": {"replay": str(tmp_path)}}, "chaos.replay: .* is a folder"),
        ({"chaos": {"schedule": {}, "replay": str(bad)}}, "keep one"),
        (
            {"chaos": {"schedule": {"scavenged": [{"learner": 5}]}}},
            r"chaos.schedule.scavenged\[0\].learner \(5\) must be < diloco.learners",
        ),
        (
            {"chaos": {"schedule": {"corrupt": [{"learner": 4, "at_s": 1.0}]}}},
            r"chaos.schedule.corrupt\[0\].learner \(4\)",
        ),
    ]
    for overrides, message in refusals:
        with pytest.raises(ValidationError, match=message):
            ExperimentConfig.model_validate(overrides)
    other = tmp_path / "two.json"
    other.write_text(draw_schedule(ChaosPlan(), 2).dumps())
    with pytest.raises(ValidationError, match="is for 2 learners, diloco.learners is 4"):
        ExperimentConfig.model_validate({"chaos": {"replay": str(other)}})
    sigkill = ExperimentConfig.model_validate(
        {
            "chaos": {"schedule": {"mtbf_s": 50.0, "horizon_s": 60.0}},
            "diloco": {"learner_retries": 20},
            "runtime": {"engine": "dask"},
        }
    )
    assert {f.how for f in sigkill.chaos_schedule().failures} == {"sigkill"}  # auto: the real kill where there is one


# -- submissions damaged in flight ------------------------------------------------------------------
@pytest.mark.parametrize("wire", ["float32", "bfloat16", "int8", "int4"])
def test_a_corrupted_submission_is_quarantined_never_merged(wire):
    from diloco.exchange import Submission

    rng = np.random.default_rng(0)
    theta0 = {"a": rng.normal(size=(6, 4)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    fmt = WireFormat(wire, 4 if wire.startswith("int") else None)
    syncer = Syncer(
        theta0, [["a", "b"]], SyncerSettings(num_learners=2, quorum=1, outer_lr=1.0, outer_momentum=0.0, wire=fmt.spec)
    )
    moved = {k: v + 0.01 for k, v in theta0.items()}
    payload = fmt.encode({k: moved[k] - theta0[k] for k in moved} if fmt.sends_delta else moved)
    for learner, kind, reason in ((0, "nan", "non-finite"), (1, "shape", "wrong-tensors")):
        bad = corrupt_payload(payload, kind)
        assert all(
            np.array_equal(
                payload[k],
                fmt.encode({k2: (moved[k2] - theta0[k2]) if fmt.sends_delta else moved[k2] for k2 in moved})[k],
            )
            for k in payload
        )  # the original intact
        sub = Submission(
            learner=learner,
            fragment=0,
            params=bad,
            tokens=64,
            steps=2,
            base_version=0,
            local_step=2,
            attempt=1,
            sent_at=0.0,
            wire=fmt.spec,
        )
        assert syncer.receive(sub, 0.0) is False
        assert syncer.ledger[learner].drop_reasons == {reason: 64}
    assert syncer.poll(10.0, live={0, 1}) == [] and syncer.versions == [0]  # nothing reached Θ
    np.testing.assert_array_equal(syncer.params()["a"], theta0["a"])


# -- the learner under a schedule ------------------------------------------------------------------
def _world(budget_steps: int, fragments: int = 2):
    trainer = tiny_trainer()
    theta0 = to_numpy(trainer.init_params())
    frags = balanced_fragments(tensor_bytes(theta0), fragments)
    exchange = InMemoryExchange(len(frags), token_budget=budget_steps * B * L)
    for p, names in enumerate(frags):
        exchange.publish(p, 0, {k: theta0[k] for k in names})
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, (B, L + 1), dtype=np.int32) for _ in range(8)]
    params = trainer.init_params()  # compiled here, so that a learner's first step takes milliseconds
    trainer.step(params, trainer.init_opt(params), batches[0])
    return trainer, exchange, batches, frags


def _slow(batches, delay_s=0.01):
    def next_batch(e, i):
        time.sleep(delay_s)
        return batches[i % len(batches)], e, i + 1

    return next_batch


@pytest.mark.slow
def test_a_timed_failure_fires_once_and_the_retry_waits_out_its_restart_delay():
    trainer, exchange, batches, frags = _world(budget_steps=40)
    events = []
    kw = dict(faults=LearnerFaults((FailEvent(learner=0, at_s=0.15, restart_delay_s=0.4),)), log=events.append)
    setup = _setup(trainer, exchange, batches, frags, **kw)
    setup.next_batch = _slow(batches)
    with pytest.raises(InjectedFailure, match="at 0.15 s of training"):
        run_learner(setup)
    assert exchange.learners()[0]["status"] == "down"
    retry = _setup(trainer, exchange, batches, frags, attempt=2, **kw)
    retry.next_batch = _slow(batches)
    out = run_learner(retry)
    starts = [e for e in events if e["event"] == "start"]
    origin = starts[0]["origin"]
    assert [e["origin"] for e in starts] == [origin, origin]  # one training clock over attempts
    fail = next(e for e in events if e["event"] == "failure")
    assert 0.15 <= fail["t"] - origin < 0.4
    assert starts[1]["t"] - fail["t"] >= 0.4  # down for the whole restart delay, from when it failed
    assert sum(e["event"] == "failure" for e in events) == 1 and out["steps"] > 0


def test_a_scavenged_learner_trains_only_inside_its_window_and_is_out_of_the_quorum_before():
    trainer, exchange, batches, frags = _world(budget_steps=10_000)
    events = []
    # the window opens 1 s into the learner's training clock: time enough, on a loaded machine, to
    # see its first heartbeat ("absent") before it joins
    setup = _setup(
        trainer,
        exchange,
        batches,
        frags,
        faults=LearnerFaults((PresenceEvent(learner=0, join_s=1.0, leave_s=1.3),)),
        log=events.append,
    )
    setup.next_batch = _slow(batches)
    seen = {}

    def watch():
        deadline = time.monotonic() + 30.0
        while (
            exchange.learners().get(0, {}).get("status") not in ("absent", "running", "done")
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        seen["before"] = liveness(exchange, 10.0)

    w = threading.Thread(target=watch)
    w.start()
    out = run_learner(setup)
    w.join()
    live, down = seen["before"]
    assert 0 not in live and down[0] == "absent"
    join = next(e for e in events if e["event"] == "join")
    leave = next(e for e in events if e["event"] == "leave")
    assert 1.0 <= join["train_t"] < 1.3 <= leave["train_t"] < 1.8
    assert 0 < out["steps"] < 10_000 and exchange.learners()[0]["status"] == "done"


class SlowMergeExchange(InMemoryExchange):
    """Publishes a new version of a fragment ``delay_s`` after each submission of it (a syncer that
    takes its time)."""

    def __init__(self, n, budget, delay_s):
        super().__init__(n, budget)
        self.delay_s = delay_s

    def submit(self, sub):
        super().submit(sub)
        v, theta = self.latest(sub.fragment)
        threading.Timer(self.delay_s, self.publish, (sub.fragment, v + 1, theta)).start()


def test_with_overlap_tau_a_learner_waits_for_an_overdue_merge_and_only_then():
    trainer = tiny_trainer()
    theta0 = to_numpy(trainer.init_params())
    frags = balanced_fragments(tensor_bytes(theta0), 2)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, (B, L + 1), dtype=np.int32) for _ in range(8)]
    for tau, expect_waits in ((1, True), (2, True), (None, False)):  # (τ = H = 2: waited for before it resends)
        exchange = SlowMergeExchange(len(frags), 12 * B * L, delay_s=0.05)
        for p, names in enumerate(frags):
            exchange.publish(p, 0, {k: theta0[k] for k in names})
        events = []
        out = run_learner(
            _setup(
                trainer,
                exchange,
                batches,
                frags,
                overlap_steps=tau,
                wait_timeout_s=5.0,
                turns=FairTurns(1),
                log=events.append,
            )
        )
        waits = [e for e in events if e["event"] == "wait"]
        assert out["steps"] == 12
        if expect_waits:  # every send (one fragment per step here) is waited for, about the merge delay
            # (each at most the merge delay, less the step taken meanwhile: a loaded machine shortens them)
            assert len(waits) >= 3 and not any(w["timed_out"] for w in waits)
            assert all(w["wait_s"] < 1.0 for w in waits) and sum(w["wait_s"] for w in waits) > 0.1
            assert out["waited_s"] == pytest.approx(sum(w["wait_s"] for w in waits))
        else:
            assert waits == [] and out["waited_s"] == 0.0


def test_a_wait_gives_up_when_the_merge_never_comes():
    trainer, exchange, batches, frags = _world(budget_steps=6)
    events = []
    out = run_learner(
        _setup(trainer, exchange, batches, frags, overlap_steps=1, wait_timeout_s=0.05, log=events.append)
    )
    waits = [e for e in events if e["event"] == "wait"]
    assert out["steps"] == 6 and waits and all(w["timed_out"] for w in waits)


# -- DP under the same schedule -----------------------------------------------------------------------
@pytest.mark.slow
def test_dp_stalls_rolls_back_and_ends_with_the_very_model_of_the_run_without_failures(small_cfg, small_data, tmp_path):
    """A failure at 3 s of training (and a second replica's at 3.2 s, while the job is down): the whole
    job (here in one process: it raises, and the job restarts in the process) stops until both are
    back (3.8 s), restores its
    last checkpoint (every 5 steps; none yet: the initial state) and recomputes the steps since on
    the same batches, so its held-out curve over tokens is the failure-free one to the last bit; a
    30× slowdown of one replica for the first 5 s slows every step after the compiling first. The
    schedule is read on a simulated clock (0.1 s a reading, sleeps without waiting), so the events
    land at the same steps on a loaded machine as on an idle one."""
    from run.clock import SimulatedClock
    from training.dp import train_dp

    sched = ChaosSchedule.model_validate(
        {
            "learners": 3,
            "failures": [
                {"learner": 1, "at_s": 3.0, "restart_delay_s": 0.5},
                {"learner": 0, "at_s": 3.2, "restart_delay_s": 0.6},
            ],
            "slowdowns": [{"learner": 2, "factor": 30.0, "from_s": 0.0, "to_s": 5.0}],
        }
    )
    path = tmp_path / "chaos.json"
    path.write_text(sched.dumps())
    runs = {}
    for name, chaos, extra in (("calm", {}, {}), ("chaos", {"replay": str(path)}, {"checkpoint_every_steps": 5})):
        run_dir = tmp_path / name
        shutil.copytree(small_data, run_dir)
        cfg = ExperimentConfig.model_validate(
            {**small_cfg.model_dump(), "chaos": chaos, "dp": {**small_cfg.dp.model_dump(), **extra}}
        )
        runs[name] = (train_dp(cfg, run_dir, clock=SimulatedClock(0.1)), RunLayout(run_dir))
    (calm, calm_layout), (hit, layout) = runs["calm"], runs["chaos"]
    events = read_jsonl(layout.metrics("pretrain", "dp", "events"))
    fail, again = (e for e in events if e["event"] == "failure")
    (restore,) = (e for e in events if e["event"] == "restore")
    # replica 0 fails while the job is down: the stall lasts until it is back too, one rollback
    assert again["replica"] == 0 and again["while_down"] and again["t"] < restore["t"]
    assert restore["t"] >= again["t"] + 0.6
    saved = [e["step"] for e in events if e["event"] == "checkpoint" and e["t"] < fail["t"]]
    assert fail["replica"] == 1 and fail["step"] >= 1 and fail["t"] >= 3.0
    assert restore["step"] == max(saved, default=0) and restore["lost_steps"] == fail["step"] - restore["step"]
    # down for the restart delay from the step boundary it met the failure at, then restored
    assert restore["t"] >= fail["t"] + 0.5 and hit["chaos"]["stall_s"] == pytest.approx(restore["down_s"])
    assert hit["chaos"] == {
        **hit["chaos"],
        "failures": 2,
        "lost_steps": restore["lost_steps"],
        "checkpoint_every_steps": 5,
    }
    # the pace as each start of the job met it: slowed (again after the restart), then back to full speed
    assert [e["factor"] for e in events if e["event"] == "slowdown"] == [30.0, 30.0, 1.0]
    # the recomputation, measured; none when the failure met the job right at a checkpoint (the slowdown
    # idles (f − 1) × each step's real compute, so on a loaded machine the failure can land on step 5)
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == (1 if restore["lost_steps"] else 0), (restore, recovered)
    back = recovered[0] if recovered else {"step": fail["step"], "t": restore["t"] + 1, "recompute_s": 0.0}
    assert back["step"] == fail["step"] and back["t"] > restore["t"]
    assert hit["restarts"] == [
        {
            "generation": 1,
            "failed_at_s": pytest.approx(fail["t"]),
            "restored_step": restore["step"],
            "lost_steps": restore["lost_steps"],
            "down_s": restore["down_s"],
            "recompute_s": back["recompute_s"],
        }
    ]
    assert json.loads(layout.chaos_schedule.read_text()) == json.loads(sched.dumps())  # saved for the record
    curve = [(r["tokens"], r["val/loss"]) for r in read_jsonl(layout.metrics("pretrain", "dp", "eval"))]
    assert curve == [(r["tokens"], r["val/loss"]) for r in read_jsonl(calm_layout.metrics("pretrain", "dp", "eval"))]
    assert hit["final_val_loss"] == calm["final_val_loss"] and hit["steps"] == calm["steps"]
    assert hit["chaos"]["stall_s"] >= 0.6 and calm["chaos"] is None
    # the whole val and test splits measured after training: the same model, the same figures
    assert hit["heldout"] == calm["heldout"] and calm["heldout"]["test"]["rows"] >= 8
    assert calm["heldout"]["val"]["rows"] % small_cfg.train.eval_batch_size == 0


# -- one real run -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_diloco_under_a_drawn_schedule_keeps_merging_and_balances_its_ledger(
    prefect_harness, small_cfg, small_data, tmp_path
):
    """Three learners under a seeded schedule (failures with restart delays, a scavenged learner, a
    NaN and a truncated submission) in real Prefect tasks: every failed learner is retried and
    merged again, the damaged submissions are dropped and never merged, the ledger balances, and
    the global model keeps advancing while learners are down."""
    from flows.pretrain import pretrain_diloco

    run_dir = tmp_path / "run"
    shutil.copytree(small_data, run_dir)
    layout = RunLayout(run_dir)
    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "diloco": {
                **small_cfg.diloco.model_dump(),
                "retry_delay_s": 0.0,
                "learner_retries": 8,
                "resume_every_steps": 25,
            },
            "train": {**small_cfg.train.model_dump(), "token_budget": 65536, "eval_every_tokens": 65536},
            "chaos": {
                "schedule": {
                    "seed": 1,
                    "horizon_s": 12.0,
                    "mtbf_s": 4.0,
                    "restart_delay": {"scale_s": 0.6},
                    "scavenged": [{"learner": 2, "join_s": 0.5, "leave_s": 30.0}],
                    "corrupt": [
                        {"learner": 1, "at_s": 0.2, "corruption": "nan"},
                        {"learner": 0, "at_s": 0.4, "corruption": "shape"},
                    ],
                }
            },
        }
    )
    summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=1.0)
    sched = ChaosSchedule.loads(layout.chaos_schedule.read_text())
    assert sched == cfg.chaos_schedule()
    events = read_jsonl(layout.metrics("pretrain", "diloco", "learners"))
    merges = read_jsonl(layout.metrics("pretrain", "diloco", "merges"))
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) >= 2, "the schedule must have fired several failures within the run"
    for f in failures:  # retried, merged again after its restart
        m = f["learner"]
        restart = next(
            e for e in events if e["event"] == "start" and e["learner"] == m and e["attempt"] == f["attempt"] + 1
        )
        # it fires at the first step boundary after its time and is down until its time + restart delay
        planned = next(x for x in sched.learner_failures(m) if f"failure at {x.at_s:g} s of training" in f["reason"])
        assert f["t"] - restart["origin"] >= planned.at_s
        # down for its restart delay from the moment it failed, unless the others spent the budget meanwhile
        took = next(
            (
                e["step"]
                for e in events
                if e["event"] in ("stop", "failure", "kill")
                and e["learner"] == m
                and e["attempt"] == restart["attempt"]
            ),
            None,
        )
        assert restart["t"] - f["t"] >= planned.restart_delay_s - 0.01 or took == restart["step"]
        if restart["t"] < merges[-1]["merged_at_s"] - 0.5:  # (not a restart in the run's last moments)
            assert any(f["t"] < r["merged_at_s"] < restart["t"] for r in merges), "merges go on while it is down"
        # merged again once it had trained two sync periods past the steps it had already sent: it
        # resumes from its last resume point, and steps trained again are recomputed, never merged
        # twice (on busy cores a restart can fail again, or meet a spent budget, before that)
        sent = max(
            e["step"]
            for e in events
            if e.get("learner") == m
            and e.get("attempt", restart["attempt"]) < restart["attempt"]  # (step events name none)
            and "step" in e
        )
        if took is not None and took - sent >= 2 * cfg.diloco.sync_every:
            assert any(m in r["contributors"] and r["merged_at_s"] > restart["t"] for r in merges)
    drops = [e for e in events if e["event"] == "dropped"]
    for c in (e for e in events if e["event"] == "corrupt"):
        assert any(
            d["learner"] == c["learner"]
            and d["fragment"] == c["fragment"]
            and d["reason"] in ("non-finite", "wrong-tensors")
            for d in drops
        )
    assert {c["kind"] for c in events if c["event"] == "corrupt"} == {"nan", "shape"}
    assert next(e for e in events if e["event"] == "join")["learner"] == 2
    assert summary["tokens"] == cfg.dp_steps * cfg.tokens_per_dp_step and np.isfinite(summary["final_val_loss"])
    P = cfg.diloco.fragments
    for v in summary["ledger"].values():
        assert v["processed"] == v["submitted"] + v["not_submitted"]
        assert abs(v["submitted"] - (v["merged"] + v["recomputed"] + v["dropped"] + v["pending"])) <= P
    reasons = {k for v in summary["ledger"].values() for k in v["drop_reasons"]}
    assert {"non-finite", "wrong-tensors"} <= reasons


@pytest.mark.slow
def test_a_slowed_learner_on_a_shared_host_steps_factor_times_less_often_than_its_peer():
    """Two learners taking turns on one host (one compute slot), learner 1 2× slower: it sits out one
    turn per step (passes it on unused), so it takes about half as many steps as learner 0 in the
    same time. (Idling outside the turns instead, the turns would fill the idle and both would step
    alike.)"""
    trainer, exchange, batches, frags = _world(budget_steps=120)
    turns = FairTurns(1)

    def slow_step(*args):  # a step of 15 ms inside the turn (the work outside it is small beside it)
        time.sleep(0.015)
        return trainer.step(*args)

    outs = {}

    def one(m, slowdowns):
        setup = _setup(trainer, exchange, batches, frags, turns=turns, faults=LearnerFaults(slowdowns))
        setup.learner, setup.step = m, slow_step
        outs[m] = run_learner(setup)

    threads = [
        threading.Thread(target=one, args=(0, ())),
        threading.Thread(target=one, args=(1, (SlowdownEvent(learner=1, factor=2.0),))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ratio = outs[0]["steps"] / outs[1]["steps"]
    # (about: a turn passed at once, its peer outside the queue, is idled instead; 1.45-2.2 measured)
    assert outs[0]["steps"] + outs[1]["steps"] == 120 and 1.3 < ratio < 2.8, outs


@pytest.mark.slow
def test_a_learner_waiting_to_join_or_restart_gives_up_once_the_others_spent_the_budget():
    """A scavenged learner whose window opens after the run's end, and a retry whose restart delay
    outlasts the run, stop waiting when no step of the budget is left: the run does not hang."""
    for kw in (
        dict(faults=LearnerFaults((PresenceEvent(learner=0, join_s=1000.0),))),
        dict(attempt=2, faults=LearnerFaults((FailEvent(learner=0, at_s=0.0, restart_delay_s=1000.0),))),
    ):
        trainer, exchange, batches, frags = _world(budget_steps=4)
        threading.Timer(0.2, exchange.claim_tokens, (4 * B * L,)).start()  # the others take it all
        events = []
        t0 = time.monotonic()
        out = run_learner(_setup(trainer, exchange, batches, frags, log=events.append, **kw))
        assert time.monotonic() - t0 < 5.0 and out["steps"] == 0
        assert not any(e["event"] == "join" for e in events) and exchange.learners()[0]["status"] == "done"
