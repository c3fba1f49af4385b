"""A syncer that survives (diloco/syncer_journal.py): its state round-trips bit-identically, a syncer
killed between a merge's journal entry and its publish is restarted from checkpoint + journal and
ends exactly where an uninterrupted one does (published versions 1..n per fragment, each once), and
a stale syncer is fenced out of every write.

Two learners, two fragments ("a": 4×8, "b": 16 values), quorum K = M = 2 and no grace window: a
fragment merges exactly when both learners' copies of a round are pending, so the merge decisions,
and hence Θ, do not depend on timing.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import jax
import numpy as np
import pytest

from diloco.exchange.base import Submission
from diloco.exchange.fsspec import FsspecExchange, StaleSyncerError
from diloco.faults import SyncerFaults
from diloco.learner import InjectedFailure
from diloco.syncer import Syncer, SyncerSettings
from diloco.syncer_journal import SyncerJournal, journal_chain
from diloco.syncer_loop import SyncerHooks, run_syncer
from tests.conftest import S3_BUCKET
from training.checkpoint import OrbaxSyncerStore

M, ROUNDS = 2, 5
SETTINGS = SyncerSettings(num_learners=M, quorum=M, grace_s=0.0, outer_lr=0.7, outer_momentum=0.9)


def exchange_url_on(store: str, request, tmp_path) -> str:
    if store == "memory":
        return f"memory://syncer-{uuid.uuid4().hex}"
    if store == "s3":  # a local S3-compatible server (moto), credentials from the environment
        request.getfixturevalue("s3_env")
        return f"s3://{S3_BUCKET}/syncer-{uuid.uuid4().hex}"
    return str(tmp_path / "exchange")


@pytest.fixture(params=["memory", "local", "s3"])
def url(request, tmp_path):
    return exchange_url_on(request.param, request, tmp_path)


def theta0():
    return [{"a": np.zeros((4, 8), np.float32)}, {"b": np.zeros(16, np.float32)}]


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


def drive(url, on_round=lambda r: None, timeout_s=60.0):
    """The learners' side: submit a round, wait until the syncer has published it, next round."""
    ex = FsspecExchange.open(url, poll_s=0.001)
    for r in range(1, ROUNDS + 1):
        on_round(r)
        for s in round_subs(r):
            ex.submit(s)
        deadline = time.monotonic() + timeout_s
        while True:
            ex.refresh()
            if min(ex.versions()) >= r:
                break
            assert time.monotonic() < deadline, f"round {r} was never published: {ex.versions()}"
            time.sleep(0.002)
    ex.mark_learners_done()


class Recorder:
    """Wraps an exchange's publish: every (fragment, version, generation) actually published."""

    def __init__(self):
        self.published: list[tuple[int, int, int]] = []

    def wrap(self, ex):
        publish = ex.publish

        def recorded(p, v, params):
            publish(p, v, params)
            self.published.append((p, v, ex._generation))

        ex.publish = recorded
        return ex


def syncer_for(ex):
    params = {}
    for p in (0, 1):
        params.update(ex.origin(p))
    return Syncer(params, [["a"], ["b"]], SETTINGS)


def run_attempt(url, store_dir, recorder, fail_at=None, every_s=0.0, clock=time.monotonic, records=None):
    """One syncer attempt: take office, recover, loop to the end (or the injected failure)."""
    ex = recorder.wrap(FsspecExchange.open(url, poll_s=0.001))
    ex.take_office()
    syncer = syncer_for(ex)
    journal = SyncerJournal(ex, OrbaxSyncerStore(store_dir), every_s, clock=clock)
    out = {"syncer": syncer, "journal": journal, "exchange": ex, "records": [] if records is None else records}
    try:
        run_syncer(
            syncer,
            ex,
            SyncerHooks(on_merge=out["records"].append),
            eval_every_tokens=10**9,
            heartbeat_timeout_s=1.0,
            poll_s=0.001,
            journal=journal,
            faults=SyncerFaults(fail_at=fail_at),
        )
    except InjectedFailure as exc:
        out["failure"] = exc
    return out


def make_exchange(url):
    return FsspecExchange.create(
        url, initial=theta0(), num_learners=M, token_budget=10**6, grant_tokens=10**5, poll_s=0.001
    )


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
            back_arrays, back_meta, objects.__getitem__
        )


# -- (b) killed between journal and publish, restarted from checkpoint + journal ------------------
def reference_run(url, tmp_path):
    make_exchange(url)
    t = threading.Thread(target=drive, args=(url,))
    t.start()
    ref = run_attempt(url, tmp_path / "ref-state", Recorder())
    t.join()
    return ref


@pytest.mark.parametrize(
    "store, when, damaged",
    [
        (store, when, damaged)
        for store in ("memory", "local")
        for when, damaged in (("before_publish", False), ("after_publish", False), ("before_publish", True))
    ]
    + [("s3", "after_publish", False)],  # (moto's server takes ~6 s a case: one case on S3)
)
def test_a_killed_syncer_resumes_without_losing_or_repeating_a_merge(store, request, tmp_path, when, damaged):
    """Killed right after merge 6's journal entry (before or after its publish); with ``damaged``
    the newest checkpoint also loses bytes of a file, so the restart falls back to the older one
    and replays a longer journal (what the two-checkpoint garbage collection keeps possible)."""
    url = exchange_url_on(store, request, tmp_path)
    ref = reference_run(url + "-ref" if "://" in url else str(tmp_path / "ref-exchange"), tmp_path)

    make_exchange(url)
    fake = {"t": 0.0}  # the checkpoint cadence's clock: the driver moves it at rounds 2 and 3
    store = OrbaxSyncerStore(tmp_path / "state")

    def on_round(r):  # a checkpoint before rounds 2 and 3 are submitted
        if r in (2, 3):
            fake["t"] += 100.0
            deadline = time.monotonic() + 30
            while len(store.steps()) < r - 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)

    recorder = Recorder()
    records = []
    driver = threading.Thread(target=drive, args=(url, on_round))
    driver.start()
    # merge 6 is fragment 1's round-3 merge: killed after its journal entry, before (or after) its publish
    first = run_attempt(
        url, tmp_path / "state", recorder, fail_at=(6, when), every_s=50.0, clock=lambda: fake["t"], records=records
    )
    assert isinstance(first.get("failure"), InjectedFailure)
    crashed_at = time.perf_counter()
    assert len(store.steps()) == 2  # the checkpoints of rounds 2 and 3
    if damaged:
        newest = store.path / str(store.steps()[-1])
        victim = next(
            f
            for f in sorted(newest.rglob("*"))
            if f.is_file() and f.stat().st_size > 16 and f.name != "_integrity.json"
        )
        victim.write_bytes(victim.read_bytes()[:-8])
    second = run_attempt(url, tmp_path / "state", recorder, every_s=50.0, clock=lambda: fake["t"], records=records)
    driver.join()
    rec = second["journal"].recovery
    assert rec["checkpoint_seq"] is not None and rec["replayed"] >= 1  # a checkpoint, then journal entries
    assert len(rec["skipped_checkpoints"]) == int(damaged)
    assert rec["republished"] == (1 if when == "before_publish" else 0)
    assert rec["recover_s"] < time.perf_counter() - crashed_at < 10

    # every version of every fragment published exactly once, in order, none lost
    for p in (0, 1):
        assert [v for q, v, _ in recorder.published if q == p] == list(range(1, ROUNDS + 1))
    # fragment 1: v1, v2 by generation 1; v3 (merge 6) journaled by generation 1 and published by
    # generation 2 when the kill came before its publish; v4, v5 by generation 2
    gens = [g for q, v, g in recorder.published if q == 1]
    assert gens == [1, 1, 2 if when == "before_publish" else 1, 2, 2]
    merged = {(r["fragment"], r["version"]) for r in records}
    assert merged == {(p, v) for p in (0, 1) for v in range(1, ROUNDS + 1)}
    replayed = {(r["fragment"], r["version"]) for r in records if r.get("replayed")}
    assert (1, 3) in replayed and all(v <= 3 for _, v in replayed)

    # the same Θ, outer momentum, versions and ledger as the uninterrupted run, bit for bit
    s, r = second["syncer"], ref["syncer"]
    assert s.versions == r.versions == [ROUNDS, ROUNDS] and s.num_merges == r.num_merges == 2 * ROUNDS
    assert all(np.array_equal(x, y) for x, y in zip(leaves(s), leaves(r)))
    assert ledger_of(s) == ledger_of(r)
    assert s.ledger[1].drop_reasons == {"out-of-order": 0} and s.ledger[0].drop_reasons == {"empty": 0}
    reader = FsspecExchange.open(url)
    for p in (0, 1):
        version, params = reader.latest(p)
        assert version == ROUNDS and all(np.array_equal(params[k], s.global_params[p][k]) for k in params)

    # garbage: the run is over, so the final checkpoint covers everything: no journal entry and no
    # submission is left (during the run they are kept until two checkpoints cover them)
    chain, outside = journal_chain(reader.journal())
    assert outside == [] and chain == []
    assert reader._ls(reader._p("inbox")) == []


# -- (c) fencing --------------------------------------------------------------------------------------
def test_a_stale_syncer_is_fenced_out_of_every_write(url, tmp_path):
    """Syncer A (generation 1) merges round 1; syncer B takes office, resumes from A's journal and
    finishes the run; A, still alive, fails on its next write and never publishes again."""
    make_exchange(url)
    recorder = Recorder()
    a_ex = recorder.wrap(FsspecExchange.open(url, poll_s=0.001))
    a_ex.take_office()
    learner = FsspecExchange.open(url, poll_s=0.001)
    a, a_journal = syncer_for(a_ex), SyncerJournal(a_ex, OrbaxSyncerStore(tmp_path / "state"), 0.0)
    a_journal.recover(a, {}, lambda rec: None)
    for sub in round_subs(1):
        learner.submit(sub)
    for sub in a_ex.drain():
        a.receive(sub, 0.0)
        a_journal.note_received(sub, 0.0)
    for p in (0, 1):
        rec = a.merge(p, 0.1)
        a_journal.note_merge(a, p, rec, 0.1, {})
        a_ex.publish(p, a.versions[p], a.global_params[p])
    for sub in round_subs(2):
        learner.submit(sub)
    assert len(a_ex.drain()) == 6  # A holds round 2's objects, not yet journaled

    b_ex = recorder.wrap(FsspecExchange.open(url, poll_s=0.001))
    assert b_ex.take_office() == 2
    with pytest.raises(StaleSyncerError, match="generation 2 has taken office"):
        a_ex.publish(0, 2, {"a": np.full((4, 8), 9, np.float32)})
    with pytest.raises(StaleSyncerError):
        a_journal.note_merge(a, 0, None, 0.2, {})
    with pytest.raises(StaleSyncerError):
        a_journal.maybe_checkpoint(a, {}, 0.2, force=True)
    with pytest.raises(StaleSyncerError):
        a_ex.discard(["000000000000-l000-f000-a001-s000000001-00000000.safetensors"])
    with pytest.raises(StaleSyncerError):
        run_syncer(a, a_ex, SyncerHooks(), eval_every_tokens=10**9, heartbeat_timeout_s=1.0, journal=a_journal)
    assert FsspecExchange.open(url).versions() == [1, 1]  # A's attempts left the published versions alone

    b = syncer_for(b_ex)
    learner.mark_learners_done()
    run_syncer(
        b,
        b_ex,
        SyncerHooks(),
        eval_every_tokens=10**9,
        heartbeat_timeout_s=1.0,
        poll_s=0.001,
        journal=SyncerJournal(b_ex, OrbaxSyncerStore(tmp_path / "state"), 0.0),
    )
    # B replayed A's two merges (already published), then merged round 2 from the inbox itself
    assert recorder.published == [(0, 1, 1), (1, 1, 1), (0, 2, 2), (1, 2, 2)]
    np.testing.assert_array_equal(b.global_params[0]["a"], FsspecExchange.open(url).latest(0)[1]["a"])
    assert ledger_of(b)[0][1] == 2 * 2 * 64  # learner 0: two rounds of two fragments merged


def test_journal_chain_ignores_what_a_stale_syncer_slipped_in():
    e = lambda seq, gen: (f"{seq:010d}-g{gen:06d}.json", {"seq": seq, "generation": gen})  # noqa: E731
    # generation 2 wrote 1..3 over generation 1's 3; generation 1 (stale) slipped in 4 afterwards
    chain, outside = journal_chain([e(1, 1), e(2, 1), e(3, 1), e(3, 2), e(4, 1)])
    assert [(x["seq"], x["generation"]) for x in chain] == [(1, 1), (2, 1), (3, 2)]
    assert outside == ["0000000003-g000001.json", "0000000004-g000001.json"]
    chain, outside = journal_chain([e(5, 1), e(7, 1)])  # a gap ends the chain
    assert [x["seq"] for x in chain] == [5] and outside == ["0000000007-g000001.json"]


def test_a_lost_office_or_a_journal_that_does_not_replay_is_not_retried():
    from diloco.syncer_journal import JournalMismatchError
    from training.decoupled.syncer import syncer_retryable

    assert syncer_retryable(InjectedFailure("syncer: injected failure at merge 4 (before publish)"))
    assert syncer_retryable(OSError("disk full"))
    assert not syncer_retryable(StaleSyncerError("generation 3 has taken office"))
    assert not syncer_retryable(JournalMismatchError("journal entry 7: fragment 1 v3 has sha256 …"))
