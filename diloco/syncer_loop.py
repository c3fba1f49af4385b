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
from diloco.syncer import Syncer


@dataclass
class SyncerLoopResult:
    merges: int
    wall_s: float
    events: list[dict] = field(default_factory=list)


def live_learners(exchange: Exchange, timeout_s: float) -> set[int]:
    """Learners running with a heartbeat in the last ``timeout_s`` seconds."""
    now = time.monotonic()
    return {
        m for m, info in exchange.learners().items()
        if info.get("status") == "running" and now - info.get("last_seen", -1e9) <= timeout_s
    }


def run_syncer(
    syncer: Syncer,
    exchange: Exchange,
    on_merge: Callable[[dict], None],
    on_eval: Callable[[dict[str, np.ndarray], int], None],
    eval_every_tokens: int,
    heartbeat_timeout_s: float,
    poll_s: float = 0.002,
    on_event: Callable[[dict], None] | None = None,
) -> SyncerLoopResult:
    """Drain submissions, merge ready fragments, publish, and evaluate Θ every ``eval_every_tokens``.

    Each round also tops up the learners' token grants (``exchange.grant``; a no-op in process),
    deletes the submissions the syncer is done with (merged or dropped; ``exchange.discard``) and
    hands the exchange's own events (quarantined objects) to ``on_event``. Ends once
    ``exchange.learners_done()`` and the inbox is empty, after a final flush of everything still
    pending (quorum or not) and a final evaluation at the tokens actually spent.
    """
    next_eval = eval_every_tokens
    held: set[str] = set()  # drained submission objects not yet merged or dropped

    def receive_all(now: float) -> None:
        for sub in exchange.drain():
            syncer.receive(sub, now)
            if sub.key is not None:
                held.add(sub.key)
        for ev in exchange.take_events():
            if on_event is not None:
                on_event(ev)

    def collect() -> None:
        pending = {s.key for frag in syncer.pending for s in frag.values()}
        done = held - pending
        if done:
            exchange.discard(sorted(done))
            held.difference_update(done)

    def handle(records: list[dict]) -> None:
        # poll/flush return adopted merges only: a refused merge (non-finite result) publishes and
        # logs nothing here, learners keep the last sound Θ_p, and its "merge-refused" event goes
        # out with the syncer's events at the end.
        for rec in records:
            p = rec["fragment"]
            exchange.publish(p, syncer.versions[p], syncer.global_params[p])
            on_merge(rec)

    while True:
        finished = exchange.learners_done()
        now = exchange.clock()  # the run's clock: seconds since training start
        receive_all(now)
        live = live_learners(exchange, heartbeat_timeout_s)
        handle(syncer.poll(now, live))
        collect()
        exchange.grant()
        claimed = exchange.claimed_tokens
        # (once the budget is spent, the final evaluation after the flush measures the end point)
        if claimed >= next_eval and not finished and claimed < exchange.token_budget:
            on_eval(syncer.params(), claimed)
            while next_eval <= claimed:
                next_eval += eval_every_tokens
        if finished:
            exchange.refresh()  # the learners' last heartbeats, not a cached read
            now = exchange.clock()
            receive_all(now)
            handle(syncer.flush(now))
            collect()
            on_eval(syncer.params(), exchange.claimed_tokens)
            break
        time.sleep(poll_s)
    exchange.close()
    return SyncerLoopResult(merges=syncer.num_merges, wall_s=exchange.clock(), events=list(syncer.events))
