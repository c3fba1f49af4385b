"""The run directory's record types (run/records.py): every record the writers wrote in a real tiny
run reads as its type, and the state events of a run with an injected learner failure (and of a DP
job with a failure) come in the order up, down, restarting, up, done."""

import shutil

import pytest

from configs.chaos import ChaosSchedule
from configs.schema import ExperimentConfig
from run.layout import RunLayout
from run.metrics import read_jsonl
from run.records import (
    DPEvent,
    DPLine,
    EvalRow,
    LearnersLine,
    Merge,
    Other,
    Start,
    StateEvent,
    Summary,
    TrainRow,
    parse,
)

pytestmark = pytest.mark.slow  # one DiLoCo and one DP run, about a minute
FAILING = 1  # the learner that fails at its local step 6, once


@pytest.fixture(scope="module")
def tiny_run(prefect_harness, small_cfg, small_data, tmp_path_factory):
    """One DiLoCo run (3 learners, learner 1 fails at its step 6 and is retried) and, in the same
    run directory, one DP job failing at 2 s of its (simulated) clock: ``(layout, dp summary)``."""
    from flows.pretrain import pretrain_diloco
    from run.clock import SimulatedClock
    from training.dp import train_dp

    run_dir = tmp_path_factory.mktemp("records") / "run"
    shutil.copytree(small_data, run_dir)
    base = small_cfg.model_dump()
    diloco = ExperimentConfig.model_validate(
        {
            **base,
            "diloco": {**base["diloco"], "retry_delay_s": 0.0, "learner_retries": 2},
            "chaos": {"events": [{"kind": "fail", "learner": FAILING, "at_step": 6}]},
        }
    )
    pretrain_diloco(config=diloco, run_dir=str(run_dir), progress_every_s=1.0)
    sched = ChaosSchedule.model_validate(
        {"learners": 3, "failures": [{"learner": 1, "at_s": 2.0, "restart_delay_s": 0.5}]}
    )
    path = run_dir.parent / "chaos.json"
    path.write_text(sched.dumps())
    dp = ExperimentConfig.model_validate(
        {**base, "chaos": {"replay": str(path)}, "dp": {**base["dp"], "checkpoint_every_steps": 5}}
    )
    summary = train_dp(dp, run_dir, clock=SimulatedClock(0.1))
    return RunLayout(run_dir), summary


def _states(records: list, who=None) -> list[str]:
    return [r.state for r in records if isinstance(r, StateEvent) and r.learner == who]


def test_every_record_of_a_real_run_reads_as_its_type(tiny_run):
    layout, dp_summary = tiny_run
    metrics = {name: read_jsonl(layout.metrics("pretrain", "diloco", name)) for name in ("learners", "merges", "eval")}
    learners = parse(LearnersLine, metrics["learners"])
    kinds = {type(r).__name__ for r in learners}
    assert {"Start", "StepLine", "Failure", "Stop", "StateEvent"} <= kinds
    # only lines no report reads are left untyped
    assert {r.event for r in learners if isinstance(r, Other)} <= {"resume_point", "liveness", "quarantined"}
    merges = parse(Merge, metrics["merges"])
    assert merges and all(m.merged_at_s >= 0 and len(m.contributors) == len(m.stale) for m in merges)
    curve = parse(EvalRow, metrics["eval"])
    assert curve[0].tokens == 0 and all(r.val_loss > 0 for r in curve)
    diloco = Summary.model_validate_json(layout.summary("pretrain", "diloco").read_text())
    assert diloco.tokens == curve[-1].tokens and diloco.merges == len(merges)
    assert set(diloco.ledger) == {"0", "1", "2"}

    events = parse(DPLine, read_jsonl(layout.metrics("pretrain", "dp", "events")))
    assert [e.event for e in events if isinstance(e, DPEvent)][:2] == ["start", "checkpoint"]
    train = parse(TrainRow, read_jsonl(layout.metrics("pretrain", "dp", "train")))
    assert train and all(r.loss > 0 and r.t is not None for r in train)
    assert parse(EvalRow, read_jsonl(layout.metrics("pretrain", "dp", "eval")))[-1].step == dp_summary["steps"]
    dp = Summary.model_validate(dp_summary)
    assert dp.chaos["failures"] == 1 and dp.restarts[0]["generation"] == 1


def test_state_events_follow_every_transition(tiny_run):
    layout, _ = tiny_run
    learners = parse(LearnersLine, read_jsonl(layout.metrics("pretrain", "diloco", "learners")))
    assert _states(learners, FAILING) == ["up", "down", "restarting", "up", "done"]
    for m in (0, 2):
        assert _states(learners, m) == ["up", "done"]
    mine = [r for r in learners if getattr(r, "learner", None) == FAILING]
    states = [r for r in mine if isinstance(r, StateEvent)]
    starts = [r for r in mine if isinstance(r, Start)]
    # up at each start's very time, down at the failure's, the retry restarting before its start
    assert [s.t for s in states if s.state == "up"] == [s.t for s in starts]
    down = next(s for s in states if s.state == "down")
    assert down.attempt == 1 and "injected failure at local step 6" in down.reason
    assert [s.attempt for s in states] == [1, 1, 2, 2, 2] and all(s.host for s in states)
    assert [s.t for s in states] == sorted(s.t for s in states)

    dp = parse(DPLine, read_jsonl(layout.metrics("pretrain", "dp", "events")))
    job = [e for e in dp if isinstance(e, StateEvent)]
    assert [(e.state, e.generation) for e in job] == [("up", 0), ("down", 0), ("restarting", 1), ("up", 1), ("done", 1)]
    fail = next(e for e in dp if isinstance(e, DPEvent) and e.event == "failure")
    restore = next(e for e in dp if isinstance(e, DPEvent) and e.event == "restore")
    assert job[1].t == fail.t and job[3].t == restore.t and job[2].t >= fail.t + 0.5
