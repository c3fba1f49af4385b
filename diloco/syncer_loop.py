"""The syncer loop: drain submissions, merge ready fragments, publish, evaluate Θ on a cadence.

No Prefect here (``tasks/pretrain.py`` wraps it). Cooperative: it polls the exchange, because
nothing can interrupt a running XLA call. The state machine it drives is ``diloco.syncer.Syncer``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from diloco.exchange.base import Exchange
from diloco.grace import GraceWindow
from diloco.learner import InjectedFailure
from diloco.syncer import Syncer
from diloco.syncer_journal import SyncerJournal


@dataclass
class SyncerLoopResult:
    merges: int
    wall_s: float
    events: list[dict] = field(default_factory=list)


def live_learners(exchange: Exchange, timeout_s: float) -> set[int]:
    """Learners running with a heartbeat in the last ``timeout_s`` seconds."""
    return liveness(exchange, timeout_s)[0]


def liveness(exchange: Exchange, timeout_s: float) -> tuple[set[int], dict[int, str]]:
    """The syncer's view of the learners from their heartbeats: (live, down).

    live: running with a heartbeat in the last ``timeout_s`` seconds. down: learner → why it is
    not alive, for learners that have reported: ``done``, ``down`` (failed, awaiting a retry or in
    its restart delay), ``absent`` (a scavenged learner before it joins) or
    ``silent <s> s`` (running or starting, but no heartbeat for longer than ``timeout_s``: a
    killed or hung process). A learner waiting at the start gate (``ready``) within the timeout is
    neither."""
    now, live, down = time.monotonic(), set(), {}
    for m, info in exchange.learners().items():
        status, silent = info.get("status"), now - info.get("last_seen", -1e9)
        if status in ("done", "down", "absent"):
            down[m] = status
        elif silent > timeout_s:
            down[m] = f"silent {silent:.1f} s"
        elif status == "running":
            live.add(m)
    return live, down


def run_syncer(
    syncer: Syncer,
    exchange: Exchange,
    on_merge: Callable[[dict], None],
    on_eval: Callable[[dict[str, np.ndarray], int], None],
    eval_every_tokens: int,
    heartbeat_timeout_s: float,
    poll_s: float = 0.002,
    on_event: Callable[[dict], None] | None = None,
    journal: SyncerJournal | None = None,
    fail_at: tuple[int, str] | None = None,
    on_recover: Callable[[dict], None] | None = None,
    on_fail: Callable[[str], None] | None = None,
    grace: GraceWindow | None = None,
) -> SyncerLoopResult:
    """Drain submissions, merge ready fragments, publish, and evaluate Θ every ``eval_every_tokens``.

    Each round also tops up the learners' token grants (``exchange.grant``; a no-op in process),
    deletes the submissions the syncer is done with (merged or dropped; ``exchange.discard``) and
    hands the exchange's own events (quarantined objects) and its own liveness events to
    ``on_event``: ``{"event": "liveness", "learner", "alive", "t", "reason"}`` whenever a learner
    that had reported turns alive or dead (:func:`liveness`; the dead are left out of the quorum,
    :meth:`Syncer.quorum`). Ends once
    ``exchange.learners_done()`` and the inbox is empty, after a final flush of everything still
    pending (quorum or not) and a final evaluation at the tokens actually spent.

    ``grace`` (a :class:`~diloco.grace.GraceWindow`): the grace window each round gets once it
    reaches quorum, from the submissions' step times, the round's time to quorum and the measured
    merge time (Eq. 3 when adaptive); each merge record carries the window it used (``grace_s``)
    and, once adaptive, the bound it was clamped to (``grace_cap_s``: one measured inner step).
    Without it every round gets ``syncer.settings.grace_s``.

    With a ``journal`` (the fsspec exchange: ``diloco.syncer_journal``) the syncer survives a
    crash: it first recovers (checkpoint + journal replay; replayed merges reach ``on_merge`` with
    ``"replayed": True``, and ``on_recover`` gets ``SyncerJournal.recover``'s summary), then
    writes a journal entry before every publish, checkpoints on the journal's cadence and at the
    end, and deletes submissions only once checkpoints cover them. ``fail_at = (n,
    "before_publish" | "after_publish")`` raises :class:`InjectedFailure` right after the n-th
    adopted merge (counted over the whole run) is journaled, or once it is published (chaos
    testing; with a journal only; ``on_fail(reason)``, when given, is called first, e.g. to
    SIGKILL the process instead). A stale syncer (a newer one took office) gets
    ``StaleSyncerError`` from its next journal entry, publish, grant, checkpoint or delete.
    """
    loop = {"next_eval": eval_every_tokens}  # the loop's own state (journaled and checkpointed)
    # fragment -> (this round's grace window, its cap: None while fixed) in seconds, set at quorum
    window: dict[int, tuple[float, float | None]] = {}
    held: set[str] = set()  # drained submission objects not yet merged or dropped (no journal)
    if journal is not None:
        info = journal.recover(syncer, loop, on_merge)
        if on_recover is not None:
            on_recover(info)

    def receive_all(now: float) -> None:
        for sub in exchange.drain():
            syncer.receive(sub, now)
            if grace is not None:
                grace.observe_submission(sub.learner, sub.attempt, sub.local_step, sub.sent_at, now)
            if journal is not None:
                journal.note_received(sub, now)
            elif sub.key is not None:
                held.add(sub.key)
        for ev in exchange.take_events():
            if on_event is not None:
                on_event(ev)

    def collect() -> None:
        if journal is not None:
            return  # objects are deleted once checkpoints cover them (SyncerJournal)
        pending = {s.key for frag in syncer.pending for s in frag.values()}
        done = held - pending
        if done:
            exchange.discard(sorted(done))
            held.difference_update(done)

    seen: dict[int, bool] = {}  # learner -> alive at the last look (liveness events on changes)

    def note_liveness(live: set[int], down: dict[int, str], now: float) -> None:
        for m in sorted(live | set(down)):
            alive = m in live
            if seen.get(m) != alive and (alive or m in seen):  # (a learner first seen ended: no event)
                ev = {"event": "liveness", "learner": m, "alive": alive, "t": now, "source": "syncer"}
                if not alive:
                    ev["reason"] = down[m]
                if on_event is not None:
                    on_event(ev)
            seen[m] = alive

    def open_windows() -> None:
        # a round that just reached quorum gets its grace window (Eq. 3 with its own t_quorum)
        if grace is None:
            return
        for p, at in enumerate(syncer.quorum_at):
            if at is not None and p not in window:
                first = min(s.sent_at for s in syncer.pending[p].values())
                window[p] = (grace.seconds(t_quorum=max(at - first, 0.0)), grace.cap())
                grace.observe_quorum(first, at)

    def closed(rec: dict | None, p: int, started: float) -> None:
        # the round of fragment p ended (merged or refused): note its window and the merge time
        used = window.pop(p, None)
        if grace is not None:
            grace.observe_merge(time.perf_counter() - started)
        if rec is not None and used is not None:
            rec["grace_s"] = round(used[0], 6)
            if used[1] is not None:  # an adaptive window: the bound it was clamped to (one measured step)
                rec["grace_cap_s"] = round(used[1], 6)

    def handle(records: list[dict]) -> None:
        # flush returns adopted merges only: a refused merge (non-finite result) publishes and
        # logs nothing here, learners keep the last sound Θ_p, and its "merge-refused" event goes
        # out with the syncer's events at the end.
        for rec in records:
            p = rec["fragment"]
            exchange.publish(p, syncer.versions[p], syncer.global_params[p])
            window.pop(p, None)
            on_merge(rec)

    def inject(point: str, rec: dict | None) -> None:
        if fail_at is not None and rec is not None and fail_at == (syncer.num_merges, point):
            reason = f"syncer: injected failure at merge {syncer.num_merges} ({point.replace('_', ' ')})"
            if on_fail is not None:
                on_fail(reason)
            raise InjectedFailure(reason)

    def merge_journaled(fragments: list[int], now: float) -> None:
        # one fragment at a time: merge, journal entry (durable), publish
        for p in fragments:
            started = time.perf_counter()
            rec = syncer.merge(p, now)
            journal.note_merge(syncer, p, rec, now, loop)
            inject("before_publish", rec)
            if rec is not None:
                exchange.publish(p, syncer.versions[p], syncer.global_params[p])
                inject("after_publish", rec)
            closed(rec, p, started)
            if rec is not None:
                on_merge(rec)

    while True:
        finished = exchange.learners_done()
        now = exchange.clock()  # the run's clock: seconds since training start
        receive_all(now)
        live, down = liveness(exchange, heartbeat_timeout_s)
        note_liveness(live, down, now)
        open_windows()
        due = [
            p
            for p in range(syncer.num_fragments)
            if syncer.ready(p, now, live, window[p][0] if p in window else None, set(down))
        ]
        if journal is None:
            for p in due:
                started = time.perf_counter()
                rec = syncer.merge(p, now)  # None: refused (Syncer.poll's rule), nothing published
                if rec is not None:
                    exchange.publish(p, syncer.versions[p], syncer.global_params[p])
                closed(rec, p, started)
                if rec is not None:
                    on_merge(rec)
        else:
            merge_journaled(due, now)
            journal.maybe_checkpoint(syncer, loop, now)
        collect()
        exchange.grant()
        claimed = exchange.claimed_tokens
        # (once the budget is spent, the final evaluation after the flush measures the end point)
        if claimed >= loop["next_eval"] and not finished and claimed < exchange.token_budget:
            on_eval(syncer.params(), claimed)
            while loop["next_eval"] <= claimed:
                loop["next_eval"] += eval_every_tokens
        if finished:
            exchange.refresh()  # the learners' last heartbeats, not a cached read
            now = exchange.clock()
            receive_all(now)
            if journal is None:
                handle(syncer.flush(now))
            else:
                merge_journaled([p for p in range(syncer.num_fragments) if syncer.pending[p]], now)
                journal.finish(syncer, loop, now)
            collect()
            on_eval(syncer.params(), exchange.claimed_tokens)
            break
        time.sleep(poll_s)
    exchange.close()
    return SyncerLoopResult(merges=syncer.num_merges, wall_s=exchange.clock(), events=list(syncer.events))
