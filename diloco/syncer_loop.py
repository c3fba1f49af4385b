"""The syncer loop: drain submissions, merge ready fragments, publish, evaluate Θ on a cadence.

No Prefect here (``tasks/pretrain.py`` wraps it). Cooperative: it polls the exchange, because
nothing can interrupt a running XLA call. The state machine it drives is ``diloco.syncer.Syncer``;
the loop itself is :class:`SyncerLoop` (its state in attributes, one method per step), which
reports through :class:`SyncerHooks` and takes injected faults at merge boundaries from
:class:`SyncerFaults`. :func:`run_syncer` builds and runs one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from diloco.exchange.base import Exchange
from diloco.faults import SyncerFaults
from diloco.grace import GraceWindow
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


def _ignore(*args) -> None:
    return None


@dataclass
class SyncerHooks:
    """What the syncer loop tells its caller. Every hook defaults to doing nothing.

    ``on_merge(record)``: an adopted merge, once published (``Syncer.merge``'s record; with
    ``"replayed": True`` when replayed from the journal; ``grace_s``/``grace_cap_s`` added when the
    round had a grace window). ``on_eval(params, tokens)``: evaluate Θ (flat name → float32 array)
    at ``tokens`` claimed. ``on_event(event)``: the exchange's events (quarantined objects) and the
    loop's liveness events. ``on_recover(summary)``: ``SyncerJournal.recover``'s summary (with a
    journal only).
    """

    on_merge: Callable[[dict], None] = _ignore
    on_eval: Callable[[dict[str, np.ndarray], int], None] = _ignore
    on_event: Callable[[dict], None] = _ignore
    on_recover: Callable[[dict], None] = _ignore


@dataclass
class SyncerLoop:
    """The syncer's loop: each round receives, notes liveness, opens grace windows, merges the
    ready fragments, collects, grants tokens and evaluates on the cadence; once the learners are
    done it merges everything still pending and evaluates at the end point. See :func:`run_syncer`.

    Settings: ``eval_every_tokens`` (tokens claimed between evaluations of Θ),
    ``heartbeat_timeout_s`` (seconds of silence after which a learner counts as down) and
    ``poll_s`` (seconds between rounds). Raises ``ValueError`` for ``faults`` without a journal.
    """

    syncer: Syncer
    exchange: Exchange
    hooks: SyncerHooks
    eval_every_tokens: int
    heartbeat_timeout_s: float
    poll_s: float = 0.002
    journal: SyncerJournal | None = None
    grace: GraceWindow | None = None
    faults: SyncerFaults = field(default_factory=SyncerFaults)
    # the loop's own state, journaled and checkpointed: {"next_eval": tokens of the next evaluation}
    state: dict = field(init=False)
    # fragment -> (its round's grace window, the window's cap: None while fixed), seconds; set at quorum
    windows: dict[int, tuple[float, float | None]] = field(init=False, default_factory=dict)
    # drained submission objects not merged or dropped yet (without a journal: deleted once done)
    held: set[str] = field(init=False, default_factory=set)
    # learner -> alive at the last look (liveness events on changes)
    seen: dict[int, bool] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.faults.fail_at is not None and self.journal is None:
            raise ValueError(f"syncer fault injection at {self.faults.fail_at} needs a journal (fsspec exchange)")
        self.state = {"next_eval": self.eval_every_tokens}

    def run(self) -> SyncerLoopResult:
        """Recover (with a journal), loop until the learners are done, finish; close the exchange."""
        if self.journal is not None:
            self.hooks.on_recover(self.journal.recover(self.syncer, self.state, self.hooks.on_merge))
        while True:
            finished = self.exchange.learners_done()
            now = self.exchange.clock()  # the run's clock: seconds since training start
            self.receive(now)
            live, down = liveness(self.exchange, self.heartbeat_timeout_s)
            self.note_liveness(live, down, now)
            self.open_windows()
            for p in self.due(now, live, set(down)):
                self.merge(p, now)
            if self.journal is not None:
                self.journal.maybe_checkpoint(self.syncer, self.state, now)
            self.collect()
            self.exchange.grant()
            if finished:
                self.finish()
                break
            self.evaluate_on_cadence()
            time.sleep(self.poll_s)
        self.exchange.close()
        return SyncerLoopResult(
            merges=self.syncer.num_merges, wall_s=self.exchange.clock(), events=list(self.syncer.events)
        )

    def receive(self, now: float) -> None:
        """Hand every submission in the inbox to the syncer, and the exchange's events to ``on_event``."""
        for sub in self.exchange.drain():
            self.syncer.receive(sub, now)
            if self.grace is not None:
                self.grace.observe_submission(sub.learner, sub.attempt, sub.local_step, sub.sent_at, now)
            if self.journal is not None:
                self.journal.note_received(sub, now)
            elif sub.key is not None:
                self.held.add(sub.key)
        for ev in self.exchange.take_events():
            self.hooks.on_event(ev)

    def note_liveness(self, live: set[int], down: dict[int, str], now: float) -> None:
        """A liveness event for every learner that turned alive or dead since the last look (a
        learner first seen already ended gets none)."""
        for m in sorted(live | set(down)):
            alive = m in live
            if self.seen.get(m) != alive and (alive or m in self.seen):
                ev = {"event": "liveness", "learner": m, "alive": alive, "t": now, "source": "syncer"}
                if not alive:
                    ev["reason"] = down[m]
                self.hooks.on_event(ev)
            self.seen[m] = alive

    def open_windows(self) -> None:
        """A round that just reached quorum gets its grace window (Eq. 3 with its own t_quorum)."""
        if self.grace is None:
            return
        for p, at in enumerate(self.syncer.quorum_at):
            if at is not None and p not in self.windows:
                first = min(s.sent_at for s in self.syncer.pending[p].values())
                self.windows[p] = (self.grace.seconds(t_quorum=max(at - first, 0.0)), self.grace.cap())
                self.grace.observe_quorum(first, at)

    def due(self, now: float, live: set[int], down: set[int]) -> list[int]:
        """The fragments ready to merge at ``now``: quorum, and the grace window over or every live learner in."""
        window = {p: w[0] for p, w in self.windows.items()}
        return [p for p in range(self.syncer.num_fragments) if self.syncer.ready(p, now, live, window.get(p), down)]

    def merge(self, p: int, now: float) -> None:
        """Merge fragment ``p`` (one outer step), journal it, publish it, close its round, report it.

        The one place a merge is published. A refused merge (non-finite result: ``Syncer.merge``
        returns None) publishes and reports nothing: learners keep the last sound Θ_p, and its
        "merge-refused" event goes out with the syncer's events at the end."""
        started = time.perf_counter()
        rec = self.syncer.merge(p, now)
        if self.journal is not None:
            self.journal.note_merge(self.syncer, p, rec, now, self.state)  # durable before the publish
        if rec is not None:
            self.faults.at_merge("before_publish", self.syncer.num_merges)
            self.exchange.publish(p, self.syncer.versions[p], self.syncer.global_params[p])
            self.faults.at_merge("after_publish", self.syncer.num_merges)
        self.close_round(p, rec, started)
        if rec is not None:
            self.hooks.on_merge(rec)

    def close_round(self, p: int, rec: dict | None, started: float) -> None:
        """The round of fragment ``p`` ended (merged or refused): measure the merge and publish
        (``started``: ``time.perf_counter()`` before the merge) and note the window it used on the record."""
        used = self.windows.pop(p, None)
        if self.grace is not None:
            self.grace.observe_merge(time.perf_counter() - started)
        if rec is not None and used is not None:
            rec["grace_s"] = round(used[0], 6)
            if used[1] is not None:  # an adaptive window: the bound it was clamped to (one measured step)
                rec["grace_cap_s"] = round(used[1], 6)

    def collect(self) -> None:
        """Delete the submissions the syncer is done with (merged or dropped). With a journal,
        objects are deleted once checkpoints cover them instead (``SyncerJournal``)."""
        if self.journal is not None:
            return
        pending = {s.key for frag in self.syncer.pending for s in frag.values()}
        done = self.held - pending
        if done:
            self.exchange.discard(sorted(done))
            self.held.difference_update(done)

    def evaluate_on_cadence(self) -> None:
        """Evaluate Θ once the tokens claimed pass the next multiple of ``eval_every_tokens`` (once
        the budget is spent, the final evaluation after the last merges measures the end point)."""
        claimed = self.exchange.claimed_tokens
        if claimed >= self.state["next_eval"] and claimed < self.exchange.token_budget:
            self.hooks.on_eval(self.syncer.params(), claimed)
            while self.state["next_eval"] <= claimed:
                self.state["next_eval"] += self.eval_every_tokens

    def finish(self) -> None:
        """The learners are done: receive their last submissions, merge every fragment still
        pending (quorum or not), write the last checkpoint, and evaluate at the tokens actually spent."""
        self.exchange.refresh()  # the learners' last heartbeats, not a cached read
        now = self.exchange.clock()
        self.receive(now)
        if self.journal is None:
            self.windows.clear()  # (these records carry no grace window without a journal, as ever)
        for p in range(self.syncer.num_fragments):
            if self.syncer.pending[p]:
                self.merge(p, now)
        if self.journal is not None:
            self.journal.finish(self.syncer, self.state, now)
        self.collect()
        self.hooks.on_eval(self.syncer.params(), self.exchange.claimed_tokens)


def run_syncer(
    syncer: Syncer,
    exchange: Exchange,
    hooks: SyncerHooks,
    *,
    eval_every_tokens: int,
    heartbeat_timeout_s: float,
    poll_s: float = 0.002,
    journal: SyncerJournal | None = None,
    grace: GraceWindow | None = None,
    faults: SyncerFaults | None = None,
) -> SyncerLoopResult:
    """Drain submissions, merge ready fragments, publish, and evaluate Θ every ``eval_every_tokens``
    tokens claimed (``hooks.on_eval``); ``heartbeat_timeout_s`` and ``poll_s`` in seconds.

    Each round also tops up the learners' token grants (``exchange.grant``; a no-op in process),
    deletes the submissions the syncer is done with (merged or dropped; ``exchange.discard``) and
    hands the exchange's own events (quarantined objects) and its own liveness events to
    ``hooks.on_event``: ``{"event": "liveness", "learner", "alive", "t", "reason"}`` whenever a
    learner that had reported turns alive or dead (:func:`liveness`; the dead are left out of the
    quorum, :meth:`Syncer.quorum`). Ends once ``exchange.learners_done()`` and the inbox is empty,
    after merging everything still pending (quorum or not) and a final evaluation at the tokens
    actually spent. Every adopted merge is published, then reported to ``hooks.on_merge``.

    ``grace`` (a :class:`~diloco.grace.GraceWindow`): the grace window each round gets once it
    reaches quorum, from the submissions' step times, the round's time to quorum and the measured
    merge time (Eq. 3 when adaptive); each merge record carries the window it used (``grace_s``)
    and, once adaptive, the bound it was clamped to (``grace_cap_s``: one measured inner step).
    Without it every round gets ``syncer.settings.grace_s``.

    With a ``journal`` (the fsspec exchange: ``diloco.syncer_journal``) the syncer survives a
    crash: it first recovers (checkpoint + journal replay; replayed merges reach ``hooks.on_merge``
    with ``"replayed": True``, and ``hooks.on_recover`` gets ``SyncerJournal.recover``'s summary),
    then writes a journal entry before every publish, checkpoints on the journal's cadence and at
    the end, and deletes submissions only once checkpoints cover them. ``faults``
    (:class:`SyncerFaults`, with a journal only) raises :class:`InjectedFailure` at a merge
    boundary. A stale syncer (a newer one took office) gets ``StaleSyncerError`` from its next
    journal entry, publish, grant, checkpoint or delete. Raises ``ValueError`` for ``faults``
    without a journal.
    """
    return SyncerLoop(
        syncer,
        exchange,
        hooks,
        eval_every_tokens,
        heartbeat_timeout_s,
        poll_s=poll_s,
        journal=journal,
        grace=grace,
        faults=faults or SyncerFaults(),
    ).run()
