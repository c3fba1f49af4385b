"""The grace window after quorum, by hand: the fixed window, and the adaptive one of the paper's
Eq. 3, grace = clamp(γ·(τ·t_step − t_quorum − t_sync), 0, cap), from measured times."""

import numpy as np
import pytest

from diloco.exchange import Submission
from diloco.grace import GraceWindow
from diloco.syncer import Syncer, SyncerSettings


def _warm(g: GraceWindow, step_s=0.1, latency_s=0.01, merge_s=0.005, learners=2, steps=6) -> GraceWindow:
    """Every learner submits at inner steps 0, 1, …: sent at step·step_s, received latency_s later."""
    for m in range(learners):
        for k in range(steps):
            g.observe_submission(m, 1, k, k * step_s, k * step_s + latency_s)
    g.observe_merge(merge_s)
    return g


def test_fixed_window_and_warm_up():
    assert _warm(GraceWindow("fixed", fixed_s=3.0)).seconds() == 3.0
    g = GraceWindow("adaptive", fixed_s=3.0, overlap_steps=4, min_samples=8)
    _warm(g, learners=1, steps=5)  # 4 step-time samples: still warming up
    assert g.seconds() == 3.0 and g.cap() is None
    assert _warm(GraceWindow("fixed", fixed_s=3.0)).cap() is None
    with pytest.raises(ValueError, match="grace mode 'eager' unknown"):
        GraceWindow("eager")
    with pytest.raises(ValueError, match="must be > 0"):
        GraceWindow("adaptive", gamma=0.0)


def test_adaptive_window_by_hand():
    # t_step 0.1 s (10 samples), latency 0.01 s → t_sync = 2·0.01 + 0.005 = 0.025 s
    g = _warm(GraceWindow("adaptive", fixed_s=3.0, gamma=0.5, overlap_steps=4, min_samples=8))
    est = g.estimates()
    assert est["t_step"] == pytest.approx(0.1) and est["t_sync"] == pytest.approx(0.025)
    # slack = 4·0.1 − 0.05 − 0.025 = 0.325; γ·slack = 0.1625, capped at one step (0.1)
    assert g.seconds(t_quorum=0.05) == pytest.approx(0.1) == g.cap()
    g.cap_s = 1.0
    assert g.seconds(t_quorum=0.05) == pytest.approx(0.1625) and g.cap() == 1.0
    assert g.seconds(t_quorum=0.5) == 0.0  # quorum took longer than the round may: no waiting
    g.observe_quorum(first_sent_at=1.0, quorum_at=1.2)  # without this round's own: the median
    assert g.seconds() == pytest.approx(0.5 * (0.4 - 0.2 - 0.025))


def test_step_times_ignore_retries_and_reordered_submissions():
    g = GraceWindow("adaptive", min_samples=1)
    g.observe_submission(0, 1, 10, 1.0, 1.0)
    g.observe_submission(0, 1, 8, 0.8, 1.1)  # delivered late: no sample, the newer one stays
    g.observe_submission(0, 2, 0, 5.0, 5.0)  # a retry starts over: no sample across attempts
    g.observe_submission(0, 2, 4, 5.4, 5.4)
    assert g.estimates()["t_step"] == pytest.approx(0.1)


def test_a_round_merges_once_its_own_window_has_passed():
    s = Syncer({"a": np.zeros(2, np.float32)}, [["a"]], SyncerSettings(num_learners=2, quorum=1, grace_s=5.0))
    s.receive(Submission(0, 0, {"a": np.ones(2, np.float32)}, 8, 1, 0, 1), now=1.0)
    assert not s.ready(0, 1.5, live={0, 1})  # the fixed 5 s window
    assert not s.ready(0, 1.05, live={0, 1}, grace_s=0.1) and s.ready(0, 1.1, live={0, 1}, grace_s=0.1)
    assert s.ready(0, 1.0, live={0}, grace_s=0.1)  # every live learner is in: no wait
    assert [r["fragment"] for r in s.poll(1.1, live={0, 1}, grace_s={0: 0.1})] == [0]
