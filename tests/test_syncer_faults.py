"""Syncer faults, by hand: merges that overflow float32, zero-token submissions, reordered delivery.

Every case uses 1–3 learners, tensors of 1–2 values and token counts that add up in one's head;
tokens are 8 per inner step, so a submission's steps are tokens // 8.
"""

import jax
import numpy as np
import pytest

from diloco.exchange import InMemoryExchange, Submission
from diloco.merge import rda
from diloco.syncer import Syncer, SyncerSettings
from diloco.syncer_loop import SyncerHooks, run_syncer

BIG = float(np.float32(3e38))  # finite in float32 (max 3.4e38); BIG² is not


def make(num_learners=2, quorum=1, merge="token_weighted", lr=0.7, momentum=0.9, a=(0.0, 0.0)):
    """Two fragments: "a" (2 values, the one under test) and "b" (1 value, 5.0)."""
    params = {"a": np.array(a, np.float32), "b": np.array([5.0], np.float32)}
    return Syncer(
        params,
        [["a"], ["b"]],
        SyncerSettings(num_learners=num_learners, quorum=quorum, merge=merge, outer_lr=lr, outer_momentum=momentum),
    )


def sub(m, values, tokens, base, step, attempt=1, fragment=0):
    name = "ab"[fragment]
    return Submission(m, fragment, {name: np.array(values, np.float32)}, tokens, tokens // 8, base, step, attempt)


def ledger(s):
    """learner → (submitted, merged, dropped, pending) tokens; asserts the ledger identity."""
    pending = s.pending_tokens()
    out = {m: (e.submitted, e.merged, e.dropped, pending[m]) for m, e in s.ledger.items()}
    for m, (submitted, merged, dropped, pend) in out.items():
        assert submitted == merged + dropped + pend, (m, out[m])
    return out


def snapshot(s, p):
    return s.global_params[p]["ab"[p]].tobytes(), [np.asarray(x).tobytes() for x in jax.tree.leaves(s.opt_states[p])]


# -- norms and RDA without overflow ---------------------------------------------------------------
def test_l2_norm_scales_before_squaring():
    from diloco.merge import l2_norm

    assert l2_norm(np.array([BIG, 0.0], np.float32)) == BIG
    assert l2_norm(np.full((2, 2), BIG, np.float32)) == 2 * BIG  # √4 · BIG, beyond float32 but finite
    assert l2_norm(np.array([3.0, 4.0], np.float32)) == 5.0
    assert l2_norm(np.zeros(3, np.float32)) == 0.0
    assert l2_norm(np.array([np.inf, 1.0])) == np.inf and np.isnan(l2_norm(np.array([np.nan, 1.0])))


def test_rda_of_huge_outer_gradients_has_the_right_finite_norm():
    out = rda([np.array([BIG, 0], np.float32), np.array([0, BIG], np.float32)], np.array([0.5, 0.5]))
    # mean norm BIG, direction (1, 1)/√2 → BIG/√2 each (2.12e38), norm BIG: fits in float32
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [BIG / np.sqrt(2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out.astype(np.float64)), BIG, rtol=1e-6)
    v = np.array([2e38, -2e38], np.float32)  # ‖v‖² overflows float32; one learner: RDA(v) = v
    np.testing.assert_allclose(rda([v], np.array([1.0])), v, rtol=1e-6)
    # norms 4.24e38 each, mean direction (1, 0): the merged value itself is beyond float32 → inf
    out = rda([np.array([BIG, BIG], np.float32), np.array([BIG, -BIG], np.float32)], np.array([0.5, 0.5]))
    assert out[0] == np.inf and out[1] == 0.0


def test_merge_record_outer_grad_norm_does_not_overflow():
    s = make(lr=0.1, momentum=0.0)
    s.receive(sub(0, [-BIG, 0.0], 64, 0, 8), 0.0)
    (rec,) = s.poll(0.0, live={0})
    # Δ = 0 − (−BIG) = [BIG, 0]; Θ = 0 − 0.1·Δ
    assert rec["outer_grad_norm"] == BIG
    np.testing.assert_allclose(s.global_params[0]["a"], [-0.1 * BIG, 0.0], rtol=1e-6)


# -- a merge that would publish NaN or inf is refused ----------------------------------------------
def _run_syncer_once(s, subs):
    """One pass of the real syncer loop (learners already done); returns (records, result, exchange)."""
    exchange = InMemoryExchange(s.num_fragments, token_budget=10**6)
    for p in range(s.num_fragments):
        exchange.publish(p, s.versions[p], s.global_params[p])
    for x in subs:
        exchange.submit(x)
    records = []
    exchange.mark_learners_done()
    result = run_syncer(
        s, exchange, SyncerHooks(on_merge=records.append), eval_every_tokens=10**9, heartbeat_timeout_s=1.0
    )
    assert exchange.is_closed()  # the loop ends the run: learners stop at their next step boundary
    return records, result, exchange


@pytest.mark.parametrize("rule, outer_grad", [("token_weighted", 0.5), ("rda", 1 / np.sqrt(2))])
def test_huge_finite_submissions_publish_finite_params(rule, outer_grad):
    s = make(quorum=2, merge=rule)
    x = float(np.float32(1e38))
    records, result, exchange = _run_syncer_once(s, [sub(0, [x, 0], 64, 0, 8), sub(1, [0, x], 64, 0, 8)])
    # weights ½, ½; v = −[x, 0], −[0, x]. token_weighted: Δ = −x/2·(1, 1); rda: Δ = −x/√2·(1, 1)
    # (mean norm x, direction (1, 1)/√2). Nesterov from a zero buffer: Θ = −0.7·1.9·Δ = 1.33·|Δ|.
    (rec,) = records
    assert rec["version"] == 1 and result.merges == 1
    np.testing.assert_allclose(rec["outer_grad_norm"], outer_grad * x * np.sqrt(2), rtol=1e-6)
    version, published = exchange.latest(0)
    assert version == 1 and np.isfinite(published["a"]).all()
    np.testing.assert_allclose(published["a"], [1.33 * outer_grad * x] * 2, rtol=1e-6)


def test_overflowing_outer_step_is_refused_and_changes_nothing():
    s = make(quorum=2)
    s.receive(sub(0, [-1, -1], 64, 0, 8), 0.0)
    s.receive(sub(1, [-1, -1], 64, 0, 8), 0.0)
    s.poll(1.0, live={0, 1})  # Δ = (1, 1), buffer (1, 1), Θ = −0.7·1.9 = −1.33
    np.testing.assert_allclose(s.global_params[0]["a"], [-1.33, -1.33], rtol=1e-6)
    before = snapshot(s, 0)
    s.receive(sub(0, [BIG, BIG], 64, 1, 16), 2.0)
    s.receive(sub(1, [BIG, BIG], 32, 1, 12), 2.0)
    # Δ = −1.33 − BIG ≈ −BIG (finite), but the step −0.7·(Δ + 0.9·(0.9 + Δ)) ≈ 1.33·BIG overflows
    assert s.poll(2.0, live={0, 1}) == []
    assert snapshot(s, 0) == before and s.versions == [1, 0] and s.num_merges == 1
    assert s.pending[0] == {} and s.quorum_at[0] is None
    assert ledger(s) == {0: (128, 64, 64, 0), 1: (96, 64, 32, 0)}
    assert s.ledger[0].drop_reasons == {"bad-merge": 64} and s.ledger[1].drop_reasons == {"bad-merge": 32}
    assert s.events[-1] == {
        "event": "merge-refused",
        "fragment": 0,
        "contributors": [0, 1],
        "tokens": [64, 32],
        "reason": "non-finite fragment after the outer step",
        "t": 2.0,
    }
    # The next sound merge starts from the untouched Θ and buffer: Δ = −1.33 − (−2.33) = 1,
    # buffer 0.9·1 + 1 = 1.9, Θ = −1.33 − 0.7·(1 + 0.9·1.9) = −3.227. Learner 1's counter went
    # 32 → 48 since v1: 16 new tokens.
    s.receive(sub(1, [-2.33, -2.33], 48, 1, 14), 3.0)
    (rec,) = s.flush(3.0)
    assert rec["version"] == 2 and s.versions == [2, 0]
    np.testing.assert_allclose(s.global_params[0]["a"], [-3.227, -3.227], rtol=1e-5)
    assert ledger(s)[1] == (112, 80, 32, 0)


@pytest.mark.parametrize("rule", ["mean", "token_weighted", "rda"])
def test_non_finite_outer_gradient_is_refused(rule):
    s = make(merge=rule, a=(-BIG, 0.0))
    before = snapshot(s, 0)
    s.receive(sub(0, [BIG, 0], 64, 0, 8), 0.0)  # finite, but Θ − θ = −2·BIG is beyond float32
    assert s.poll(0.0, live={0}) == [] and s.flush(0.0) == []
    assert snapshot(s, 0) == before and s.versions == [0, 0] and s.num_merges == 0
    assert ledger(s)[0] == (64, 0, 64, 0) and s.ledger[0].drop_reasons == {"bad-merge": 64}
    assert s.events[-1]["reason"] == "non-finite outer gradient"


def test_run_syncer_publishes_only_adopted_merges():
    s = make(a=(-BIG, 0.0))
    records, result, exchange = _run_syncer_once(s, [sub(0, [BIG, 0], 64, 0, 8), sub(0, [4.0], 64, 0, 8, fragment=1)])
    # fragment 0 refused; fragment 1: Δ = 5 − 4 = 1, Θ = 5 − 0.7·1.9 = 3.67
    assert [r["fragment"] for r in records] == [1] and result.merges == 1
    assert exchange.versions() == [0, 1]
    assert exchange.latest(0)[1]["a"][0] == np.float32(-BIG)
    np.testing.assert_allclose(exchange.latest(1)[1]["b"], [3.67], rtol=1e-6)
    assert [e["event"] for e in result.events] == ["dropped", "merge-refused"]


# -- zero tokens ----------------------------------------------------------------------------------
def test_zero_token_submission_is_not_queued_and_casts_no_vote():
    s = make(quorum=2)
    assert not s.receive(Submission(0, 0, {"a": np.ones(2, np.float32)}, 0, 0, 0, 1), 0.0)
    assert s.events[-1] == {
        "event": "dropped",
        "learner": 0,
        "fragment": 0,
        "reason": "empty",
        "tokens": 0,
        "base_version": 0,
        "t": 0.0,
    }
    assert s.pending[0] == {}
    assert s.receive(sub(1, [2, 2], 64, 0, 8), 0.1)
    assert s.quorum_at[0] is None and s.poll(0.1, live={0, 1}) == []  # one vote of K = 2
    (rec,) = s.flush(0.2)
    assert rec["contributors"] == [1] and rec["weights"] == [1.0]
    assert ledger(s) == {0: (0, 0, 0, 0), 1: (64, 64, 0, 0)} and s.ledger[0].drop_reasons == {"empty": 0}


# -- reordered delivery: the later (attempt, local_step) wins --------------------------------------
def test_older_copy_arriving_second_does_not_replace_the_newer():
    s = make(quorum=2, lr=1.0, momentum=0.0)
    assert s.receive(sub(0, [2, 2], 128, 0, 16), 0.0)
    assert not s.receive(sub(0, [1, 1], 64, 0, 8), 0.1)  # sent at step 8, delivered after step 16's
    assert s.events[-1]["reason"] == "out-of-order" and s.events[-1]["tokens"] == 0
    assert s.pending[0][0].local_step == 16
    assert ledger(s)[0] == (128, 0, 0, 128) and s.ledger[0].drop_reasons == {"out-of-order": 0}
    s.receive(sub(1, [0, 0], 128, 0, 16), 0.2)
    (rec,) = s.poll(0.2, live={0, 1})
    # weights ½, ½ (128²/16 each); Δ = ½·(0 − 2) + ½·0 = −1; Θ = 0 − Δ = 1 (step 8's copy: 0.5)
    assert rec["local_steps"] == [16, 16]
    np.testing.assert_allclose(s.global_params[0]["a"], [1.0, 1.0])
    # the late copy left the token count alone: 192 at step 24 (v1 not received) is 64 new tokens
    s.receive(sub(0, [3, 3], 192, 0, 24), 0.3)
    assert ledger(s)[0] == (192, 128, 0, 64)


def test_older_copy_arriving_after_the_newer_was_merged():
    s = make(lr=1.0, momentum=0.0)
    s.receive(sub(0, [2, 2], 128, 0, 16), 0.0)
    s.poll(0.0, live={0})  # one learner: Θ = its copy (2, 2), version 1
    assert not s.receive(sub(0, [1, 1], 64, 0, 8), 0.1)  # would be only 1 version stale
    assert s.pending[0] == {} and s.poll(0.1, live={0}) == [] and s.versions == [1, 0]
    np.testing.assert_allclose(s.global_params[0]["a"], [2.0, 2.0])
    assert ledger(s)[0] == (128, 128, 0, 0) and s.ledger[0].drop_reasons == {"out-of-order": 0}


def test_late_copy_of_an_older_base_counts_its_lost_work():
    s = make(num_learners=3, quorum=2, lr=1.0, momentum=0.0)
    s.receive(sub(0, [1, 1], 64, 0, 8), 0.0)
    s.receive(sub(1, [1, 1], 64, 0, 8), 0.0)
    s.poll(0.0, live={0, 1, 2})  # v1
    s.receive(sub(0, [1, 1], 16, 1, 26), 1.0)  # after receipt of v1: 16 tokens since
    # learner 0's step-16 copy of v0 arrives late: 128 tokens since v0, 64 of them already merged
    # with its step-8 copy; the other 64 are lost
    assert not s.receive(sub(0, [9, 9], 128, 0, 16), 1.1)
    assert s.pending[0][0].local_step == 26
    # learner 2's only v0 copy arrives after its v1 copy: all 96 tokens lost
    s.receive(sub(2, [1, 1], 8, 1, 13), 1.2)
    assert not s.receive(sub(2, [7, 7], 96, 0, 12), 1.3)
    assert ledger(s) == {0: (144, 64, 64, 16), 1: (64, 64, 0, 0), 2: (104, 0, 96, 8)}
    (rec,) = s.poll(1.3, live={0, 1, 2})
    assert rec["version"] == 2 and rec["contributors"] == [0, 2] and rec["local_steps"] == [26, 13]
    assert ledger(s) == {0: (144, 80, 64, 0), 1: (64, 64, 0, 0), 2: (104, 8, 96, 0)}
    assert s.ledger[0].drop_reasons == {"out-of-order": 64} and s.ledger[2].drop_reasons == {"out-of-order": 96}


def test_new_attempt_wins_over_the_previous_attempts_copies():
    s = make(quorum=2)
    s.receive(sub(0, [1, 1], 64, 0, 8, attempt=1), 0.0)
    # restarted at step 10 (its last heartbeat), counters from zero: 16 tokens by step 12. Its
    # work is not in the pending attempt-1 copy, whose 64 tokens are lost ("superseded").
    assert s.receive(sub(0, [2, 2], 16, 0, 12, attempt=2), 1.0)
    assert ledger(s)[0] == (80, 0, 64, 16)
    # attempt 1's step-12 copy, in flight when it failed, arrives last: 96 − 64 = 32 new, lost
    assert not s.receive(sub(0, [5, 5], 96, 0, 12, attempt=1), 1.1)
    assert s.pending[0][0].attempt == 2
    assert ledger(s)[0] == (112, 0, 96, 16)
    assert s.ledger[0].drop_reasons == {"superseded": 64, "out-of-order": 32}


# -- a restarted learner's re-trained steps: each (learner, fragment, local step) merged once ------
def _books(s, m=0):
    """learner m → (submitted, merged, recomputed, dropped, pending) tokens; asserts the identity
    submitted = merged + recomputed + dropped + pending."""
    e, pend = s.ledger[m], s.pending_tokens()[m]
    out = (e.submitted, e.merged, e.recomputed, e.dropped, pend)
    assert out[0] == sum(out[1:]), out
    return out


def test_retrained_steps_after_a_restart_are_merged_once():
    """Attempt 1 is merged up to local step 10, then killed at step 12 (11–12 never sent). Attempt 2
    resumes at its step-5 resume point, pulls v2 (counters from zero) and sends at 10 and 15: the
    step-10 copy re-trained steps 6–10, already merged, and is dropped as recomputed (40 tokens);
    the step-15 copy (80 tokens since v2, steps 6–15) is merged with its 5 new steps fresh."""
    s = make(lr=1.0, momentum=0.0)
    s.receive(sub(0, [1, 1], 40, 0, 5), 0.0)
    (r1,) = s.poll(0.0, live={0})
    s.receive(sub(0, [2, 2], 40, 1, 10), 1.0)  # received v1 at step 5: 5 steps since
    (r2,) = s.poll(1.0, live={0})
    assert (r1["local_steps"], r2["local_steps"]) == ([5], [10]) and s.versions == [2, 0]
    assert _books(s) == (80, 80, 0, 0, 0)
    # attempt 2, resumed at step 5 with v2: its step-10 copy holds steps 6–10 again
    assert not s.receive(sub(0, [3, 3], 40, 2, 10, attempt=2), 2.0)
    assert s.events[-1] == {
        "event": "dropped",
        "learner": 0,
        "fragment": 0,
        "reason": "recomputed",
        "tokens": 40,
        "base_version": 2,
        "t": 2.0,
    }
    assert s.pending[0] == {} and s.poll(2.0, live={0}) == [] and s.versions == [2, 0]
    np.testing.assert_allclose(s.global_params[0]["a"], [2.0, 2.0])  # not merged
    assert _books(s) == (120, 80, 40, 0, 0)
    # its step-15 copy: steps 6–15 of the same base, 80 tokens; 6–10 counted above, 11–15 new
    assert s.receive(sub(0, [4, 4], 80, 2, 15, attempt=2), 3.0)
    assert _books(s) == (160, 80, 40, 0, 40)
    (r3,) = s.poll(3.0, live={0})
    assert r3["local_steps"] == [15] and r3["attempts"] == [2] and r3["tokens"] == [80]
    np.testing.assert_allclose(s.global_params[0]["a"], [4.0, 4.0])
    assert _books(s) == (160, 120, 40, 0, 0)
    assert s.ledger[0].drop_reasons == {}  # recomputed work is not a drop: its own column
    merged = [
        (c, rec["fragment"], ls) for rec in (r1, r2, r3) for c, ls in zip(rec["contributors"], rec["local_steps"])
    ]
    assert len(merged) == len(set(merged)) == 3


def test_a_copy_straddling_the_merged_step_counts_only_its_new_steps_fresh():
    """Attempt 1 merged at step 8; attempt 2 resumed at step 4 never sent its step-8 copy (lost in
    flight) and sends at 12: 64 tokens for steps 5–12, of which 5–8 (32) re-trained merged work. A
    later copy of an older attempt arriving then is out of order, and a pending copy of attempt 1
    not yet merged is superseded, not recomputed (its steps were never merged)."""
    s = make(num_learners=2, quorum=2, lr=1.0, momentum=0.0)
    s.receive(sub(0, [1, 1], 64, 0, 8), 0.0)
    s.receive(sub(1, [1, 1], 64, 0, 8), 0.0)
    s.poll(0.0, live={0, 1})  # v1 holds both learners' steps 1–8
    s.receive(sub(1, [2, 2], 32, 1, 12), 0.5)  # learner 1 goes on: pending, attempt 1, steps 9–12
    assert s.receive(sub(0, [2, 2], 64, 1, 12, attempt=2), 1.0)
    assert _books(s, 0) == (128, 64, 32, 0, 32)
    assert not s.receive(sub(0, [9, 9], 96, 0, 12, attempt=1), 1.1)  # attempt 1's, in flight when killed
    assert s.events[-1]["reason"] == "out-of-order" and _books(s, 0) == (160, 64, 32, 32, 32)
    # learner 1 restarts at step 10 before its step-12 copy merged: nothing of it merged, so its
    # re-trained steps are fresh and the pending attempt-1 copy is lost (superseded)
    assert s.receive(sub(1, [3, 3], 16, 1, 12, attempt=2), 1.2)
    assert _books(s, 1) == (112, 64, 0, 32, 16) and s.ledger[1].drop_reasons == {"superseded": 32}
    (rec,) = s.poll(1.2, live={0, 1})
    assert rec["contributors"] == [0, 1] and rec["local_steps"] == [12, 12]
    assert _books(s, 0) == (160, 96, 32, 32, 0) and _books(s, 1) == (112, 80, 0, 32, 0)


def test_merged_steps_survive_a_syncer_restart():
    """The record of merged local steps is part of the syncer's saved state: a syncer restored from
    it still drops a restarted learner's re-trained copy as recomputed."""
    s = make(lr=1.0, momentum=0.0)
    s.receive(sub(0, [1, 1], 80, 0, 10), 0.0)
    s.poll(0.0, live={0})
    arrays, meta = s.state_dict()
    assert meta["merged_steps"] == {"0,0": 10}
    back = make(lr=1.0, momentum=0.0)
    back.load_state_dict(arrays, meta, fetch=lambda key: None)
    assert back.state_dict()[1] == meta
    assert not back.receive(sub(0, [3, 3], 40, 1, 10, attempt=2), 1.0)
    assert back.events[-1]["reason"] == "recomputed" and _books(back) == (120, 80, 40, 0, 0)
