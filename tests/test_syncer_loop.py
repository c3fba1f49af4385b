"""The syncer loop's object form (diloco.syncer_loop): fault hooks at merge boundaries, the hooks
bundle, and the final merges once the learners are done. Two fragments of 1–2 values, no waits."""

import numpy as np
import pytest

from diloco.exchange import InMemoryExchange, Submission
from diloco.faults import SyncerFaults
from diloco.grace import GraceWindow
from diloco.learner import InjectedFailure
from diloco.syncer import Syncer, SyncerSettings
from diloco.syncer_loop import SyncerHooks, SyncerLoop, run_syncer


def make_syncer():
    params = {"a": np.zeros(2, np.float32), "b": np.array([5.0], np.float32)}
    settings = SyncerSettings(num_learners=2, quorum=1, outer_lr=1.0, outer_momentum=0.0)
    return Syncer(params, [["a"], ["b"]], settings)


def test_faults_fire_only_at_their_merge_and_point_after_on_fail():
    reasons = []
    faults = SyncerFaults(fail_at=(2, "after_publish"), on_fail=reasons.append)
    for point in ("before_publish", "after_publish"):
        faults.at_merge(point, 1)
    faults.at_merge("before_publish", 2)
    assert reasons == []
    with pytest.raises(InjectedFailure, match=r"^syncer: injected failure at merge 2 \(after publish\)$"):
        faults.at_merge("after_publish", 2)
    assert reasons == ["syncer: injected failure at merge 2 (after publish)"]
    SyncerFaults().at_merge("before_publish", 1)  # the default injects nothing


def test_faults_without_a_journal_are_refused():
    s, exchange = make_syncer(), InMemoryExchange(2, token_budget=10**6)
    with pytest.raises(ValueError, match="needs a journal"):
        run_syncer(
            s,
            exchange,
            SyncerHooks(),
            eval_every_tokens=10**9,
            heartbeat_timeout_s=60.0,
            faults=SyncerFaults(fail_at=(1, "before_publish")),
        )
    assert s.num_merges == 0 and not exchange.is_closed()


def test_rounds_cut_short_by_the_end_are_merged_published_and_evaluated_in_fragment_order():
    # learners 0 and 1 are live; only learner 0 has sent, so both rounds wait out a 1000 s window
    # until the learners are done: the final merges publish each fragment and report it, in order,
    # without a grace window on the record (no journal), then Θ is evaluated at the tokens claimed
    s, exchange = make_syncer(), InMemoryExchange(2, token_budget=10**6)
    for m in (0, 1):
        exchange.heartbeat(m, status="running")
    exchange.submit(Submission(0, 0, {"a": np.array([1.0, 2.0], np.float32)}, 16, 2, 0, 2, sent_at=0.0))
    exchange.submit(Submission(0, 1, {"b": np.array([3.0], np.float32)}, 16, 2, 0, 2, sent_at=0.0))
    assert exchange.claim_tokens(16)
    exchange.mark_learners_done()
    log = []
    publish = exchange.publish
    exchange.publish = lambda p, v, params: (log.append(("publish", p, v)), publish(p, v, params))
    hooks = SyncerHooks(
        on_merge=lambda rec: log.append(("merge", rec["fragment"], rec["version"], "grace_s" in rec)),
        on_eval=lambda params, tokens: log.append(("eval", tokens, float(params["a"][1]), float(params["b"][0]))),
    )
    loop = SyncerLoop(s, exchange, hooks, eval_every_tokens=8, heartbeat_timeout_s=60.0, poll_s=0.0)
    loop.grace = GraceWindow(fixed_s=1000.0)
    result = loop.run()
    assert log == [
        ("publish", 0, 1),
        ("merge", 0, 1, False),
        ("publish", 1, 1),
        ("merge", 1, 1, False),
        ("eval", 16, 2.0, 3.0),  # outer lr 1, no momentum: Θ moved to learner 0's copy
    ]
    assert result.merges == 2 and exchange.versions() == [1, 1] and exchange.is_closed()
    assert loop.windows == {} and loop.state == {"next_eval": 8}  # at the end: no cadence evaluation
