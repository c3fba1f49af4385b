"""The syncer's state round-trips bit-identically (``Syncer.state_dict`` / ``load_state_dict``,
through the Orbax store of ``training.checkpoint``).

Two learners, two fragments ("a": 4×8, "b": 16 values), quorum K = M = 2 and no grace window.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from diloco.exchange.base import Submission
from diloco.syncer import Syncer, SyncerSettings
from training.checkpoint import OrbaxSyncerStore

M = 2
SETTINGS = SyncerSettings(num_learners=M, quorum=M, grace_s=0.0, outer_lr=0.7, outer_momentum=0.9)


def copy_of(m, p, r):
    """Learner m's copy of fragment p in round r: Θ₀ + a fixed random walk (deterministic)."""
    rng = np.random.default_rng(1000 * m + 100 * p + r)
    shape = (4, 8) if p == 0 else (16,)
    return {"ab"[p]: (0.1 * r + 0.05 * rng.standard_normal(shape)).astype(np.float32)}


def round_subs(r):
    """Round r: each learner's copy of each fragment at base version r − 1 (64·(m+1) tokens), plus
    learner 1's stale resend of round r − 1 (out of order: dropped) and an empty one from learner 0."""
    subs = [Submission(m, p, copy_of(m, p, r), 64 * (m + 1), 8, r - 1, 8 * r + m) for m in range(M) for p in (0, 1)]
    if r > 1:
        subs.append(Submission(1, 0, copy_of(1, 0, r - 1), 64 * 2, 8, r - 2, 8 * (r - 1)))
    subs.append(Submission(0, 1, copy_of(0, 1, r), 0, 0, r - 1, 8 * r + 5))
    return subs


def ledger_of(s):
    pending = s.pending_tokens()
    out = {m: (e.submitted, e.merged, e.dropped, pending[m]) for m, e in s.ledger.items()}
    for m, (submitted, merged, dropped, pend) in out.items():
        assert submitted == merged + dropped + pend, (m, out[m])
    return out


def leaves(s):
    return [np.asarray(x) for x in jax.tree.leaves((s.global_params, s.opt_states))]


# -- (a) the state machine's state round-trips -----------------------------------------------------
def test_state_dict_round_trip_is_bit_identical(tmp_path):
    store = OrbaxSyncerStore(tmp_path / "state")
    objects = {}

    def keyed(sub):
        sub.key = f"k{len(objects):03d}"
        objects[sub.key] = sub
        return sub

    s = Syncer({"a": np.zeros((4, 8), np.float32), "b": np.zeros(16, np.float32)}, [["a"], ["b"]], SETTINGS)
    for t, sub in enumerate(round_subs(1)):
        s.receive(keyed(sub), 0.1 * t)
    assert [r["version"] for r in s.poll(1.0, {0, 1})] == [1, 1]
    for t, sub in enumerate(round_subs(2)[:3]):  # fragment 0 complete, fragment 1 half: one pending
        s.receive(keyed(sub), 2.0 + 0.1 * t)
    arrays, meta = s.state_dict()
    store.save(7, arrays, meta)
    fresh = Syncer({"a": np.zeros((4, 8), np.float32), "b": np.zeros(16, np.float32)}, [["a"], ["b"]], SETTINGS)
    like, _ = fresh.state_dict()
    back_arrays, back_meta = store.load(7, like)
    fresh.load_state_dict(back_arrays, json.loads(json.dumps(back_meta)), objects.__getitem__)
    assert fresh.state_dict()[1] == meta
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(leaves(s), leaves(fresh)))
    # the same calls from here on give the same records and bit-identical state
    for x in (s, fresh):
        for t, sub in enumerate(round_subs(2)[3:] + round_subs(3)):
            x.receive(sub, 3.0 + 0.1 * t)
    assert s.flush(4.0) == fresh.flush(4.0)
    assert s.versions == fresh.versions == [2, 2]
    assert all(np.array_equal(x, y) for x, y in zip(leaves(s), leaves(fresh)))
    assert ledger_of(s) == ledger_of(fresh) and s.events == fresh.events
    with pytest.raises(ValueError, match="other settings"):
        Syncer(fresh.params(), [["a"], ["b"]], SyncerSettings(num_learners=M, quorum=1)).load_state_dict(
            back_arrays, back_meta, objects.__getitem__)
