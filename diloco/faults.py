"""Faults a learner, the syncer or a DP host is scheduled to suffer (chaos testing), and the hooks that fire them.

The events are the config's own (``configs.faults``: ``chaos.events``, and the drawn or replayed
``chaos.schedule``'s, which are the same typed events), read here by their fields alone (diloco
imports nothing of ours): every event has a ``kind``; per kind, the fields read are

===========================  ======================================================================
kind                         what happens to learner m
===========================  ======================================================================
``fail`` / ``kill``          at local step ``at_step`` (the k-th such failure on its k-th attempt), or
                             at the first step boundary after ``at_s`` seconds of its training clock:
                             it raises :class:`InjectedFailure` (``how`` raise, retried by the task
                             runner) or SIGKILLs its own process (``how`` sigkill: a timed kill reports
                             itself down first, a step kill tells no one); a timed failure's retry
                             stays down ``restart_delay_s`` from when it fired
``slowdown``                 from ``from_s`` to ``to_s`` of its training clock it steps ``factor``×
                             less often than its peers (:func:`slow_down`)
``corrupt``                  its first submission after ``at_s`` is damaged in flight
                             (``corruption``: :func:`corrupt_payload`)
``presence``                 a scavenged learner: it trains only from ``join_s`` to ``leave_s``
===========================  ======================================================================

The learner loop (``diloco.learner``) knows nothing of chaos: it calls a :class:`FaultHooks` at its
boundaries (before its first step, before and after each inner step, on each send), and the hooks
see a :class:`LearnerView` of it, never the learner itself. The syncer's faults (``syncer_fail``)
enter its loop (``diloco.syncer_loop``) through :class:`SyncerFaults` at merge boundaries, and a DP
host's (``dp_fail``, and the schedule's failures and slowdowns of replica m on host m mod
``dp.hosts``) through :class:`HostHooks` at the DP job's step boundaries (``training.dp``).

A new fault kind is written in three files: its event in ``configs/faults.py``, its hook here, and
what the report shows of it (``reports/``); docs/chaos.md lists them.

The training clock is seconds since the learner's first attempt started (kept by the exchange
over attempts); the run clock is the exchange's ``clock()``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from diloco.exchange.base import Exchange


class InjectedFailure(RuntimeError):
    """Raised by a learner (or the syncer, or a DP host) at a scheduled fault; the task runner retries
    it. ``record``: what a DP host's failure tells its job (:class:`HostHooks`), else None."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record


FAILURES = ("fail", "kill")


@dataclass(frozen=True)
class LearnerFaults:
    """One learner's scheduled events (``configs.faults`` events, any order; at most one ``presence``),
    sorted by kind."""

    events: tuple = ()
    step_failures: tuple = field(init=False)  # ascending at_step: the k-th on attempt k
    timed_failures: tuple = field(init=False)  # ascending at_s
    slowdowns: tuple = field(init=False)
    corruptions: tuple = field(init=False)  # ascending at_s
    join_s: float = field(init=False)  # the presence window (0, None: always present)
    leave_s: float | None = field(init=False)

    def __post_init__(self) -> None:
        def of(*kinds):
            return [e for e in self.events if e.kind in kinds]

        presence = of("presence")
        if len(presence) > 1:
            raise ValueError("a learner has at most one presence window")
        put = object.__setattr__
        at_steps: dict[int, Any] = {}  # one failure per step: a kill wins over a raise
        for f in (f for f in of(*FAILURES) if f.at_step is not None):
            if f.at_step not in at_steps or f.how == "sigkill":
                at_steps[f.at_step] = f
        put(self, "step_failures", tuple(at_steps[k] for k in sorted(at_steps)))
        put(
            self,
            "timed_failures",
            tuple(sorted((f for f in of(*FAILURES) if f.at_s is not None), key=lambda f: f.at_s)),
        )
        put(self, "slowdowns", tuple(of("slowdown")))
        put(self, "corruptions", tuple(sorted(of("corrupt"), key=lambda c: c.at_s)))
        put(self, "join_s", presence[0].join_s if presence else 0.0)
        put(self, "leave_s", presence[0].leave_s if presence else None)

    @classmethod
    def of(cls, events: Sequence, learner: int) -> LearnerFaults:
        """Learner ``learner``'s among ``events`` (every event of the run: those without a ``learner``
        belong to the syncer or the DP job)."""
        return cls(tuple(e for e in events if getattr(e, "learner", None) == learner))

    def hooks(self, view: LearnerView) -> FaultHooks:
        """The hooks that fire these faults on one attempt of a learner."""
        return FaultHooks(self, view)


@dataclass(frozen=True)
class LearnerView:
    """What the fault hooks see of one learner attempt (``diloco.learner.Learner.fault_view``): who it
    is, its exchange record when the attempt began (``info``: ``failed_t``, ``failed_at_s``,
    ``corrupted``), its clocks (seconds) and the few things a fault does to it."""

    m: int
    attempt: int
    info: Mapping[str, Any]
    clock: Callable[[], float]  # the training clock
    run_clock: Callable[[], float]  # the exchange's clock
    heartbeat: Callable[..., None]  # report fields of this learner to the exchange (status, reason, …)
    event: Callable[..., None]  # log a learner event: event(name, **fields)
    state: Callable[..., None]  # log a state transition: state(up | down | restarting | done, t, reason)
    wait_until: Callable[[float], None]  # idle until the training clock reaches t (or the run ends for it)
    turns: Any  # the host's compute turns (diloco.pacing.FairTurns) or None: alone on its device
    sleep: Callable[[float], None]


def kill_self() -> None:
    """SIGKILL this process: a real crash, nothing after it runs (chaos testing)."""
    os.kill(os.getpid(), signal.SIGKILL)


def corrupt_payload(payload: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    """A copy of a submission ``payload`` damaged in flight (chaos): ``nan`` sets the first value of
    its first floating-point array (a quantised format's scale) to NaN; ``shape`` drops the last
    value of its first array. The syncer must refuse either ("non-finite", "wrong-tensors")."""
    out = dict(payload)
    names = sorted(out)
    if kind == "nan":
        name = next((k for k in names if np.issubdtype(out[k].dtype, np.floating)), None)
        if name is None:  # bfloat16 travels as uint16 bit patterns: 0x7FC0 is a NaN
            name = names[0]
            bad = np.array(out[name], copy=True).reshape(-1)
            bad[0] = 0x7FC0
        else:
            bad = np.array(out[name], copy=True).reshape(-1)
            bad[0] = np.nan
        out[name] = bad.reshape(np.shape(out[name]))
    else:
        out[names[0]] = np.asarray(out[names[0]]).reshape(-1)[:-1].copy()
    return out


def wait_until(
    clock: Callable[[], float], until: float, stop: Callable[[], bool], ex: Exchange, tokens_per_step: int = 1
) -> float:
    """Sleep until ``clock() >= until``, or stop, or the run closes, or the others have claimed the
    budget (no step of ``tokens_per_step`` tokens is left: a scavenged learner whose window opens
    after the run's end, a restart due after it); returns the seconds waited."""
    t0 = time.monotonic()
    while clock() < until and not (stop() or ex.is_closed()):
        if ex.claimed_tokens + tokens_per_step > ex.token_budget:
            break
        time.sleep(min(0.05, max(until - clock(), 0.001)))
    return time.monotonic() - t0


def slow_down(turns, sleep: Callable[[float], None], extra: float, computed: float, owed: float) -> float:
    """A slower device (a ``slowdown`` event): after a step of ``computed`` seconds, make this learner
    (factor − 1) = ``extra`` steps' worth slower than its peers; returns the part of a turn still owed.

    Alone on its device (``turns`` None) it idles ``extra × computed`` seconds. On a host shared in
    first-come turns (``diloco.pacing.FairTurns``) idling cannot slow it (its peers' turns fill the
    idle and it is served once a round all the same), so it owes ``extra`` of a turn per step and, for
    each whole turn owed, sits one out: it joins the queue and passes its turn on unused, the learners
    behind it stepping first. It steps factor× less often than its peers, as on a device factor×
    slower. A turn passed at once (nobody else was waiting) costs nothing, so then it idles one
    step's time instead."""
    if turns is None:
        sleep(extra * computed)
        return 0.0
    owed += extra
    while owed >= 1.0:
        owed -= 1.0
        t = time.perf_counter()
        with turns:
            pass  # sat out: the learners queued before it took their turns
        if time.perf_counter() - t < 0.5 * computed:
            sleep(computed)
    return owed


@dataclass
class SyncerFaults:
    """Fault injection at merge boundaries (chaos testing of the syncer's recovery).

    ``fail_at = (n, "before_publish" | "after_publish")``: :meth:`at_merge` raises
    :class:`InjectedFailure` right after the n-th adopted merge (counted over the
    whole run) is journaled, or once it is published; ``on_fail(reason)``, when given, is called
    first (e.g. to SIGKILL the process instead). Needs a journal (``diloco.syncer_loop.SyncerLoop``
    refuses it without one). The default injects nothing.
    """

    fail_at: tuple[int, str] | None = None
    on_fail: Callable[[str], None] | None = None

    def at_merge(self, point: str, merge_number: int) -> None:
        """The loop reached ``point`` ("before_publish" | "after_publish") of adopted merge
        ``merge_number`` (1-based). Raises ``InjectedFailure`` there if ``fail_at`` says so."""
        if self.fail_at != (merge_number, point):
            return
        reason = f"syncer: injected failure at merge {merge_number} ({point.replace('_', ' ')})"
        if self.on_fail is not None:
            self.on_fail(reason)
        raise InjectedFailure(reason)


class FaultHooks:
    """Fires one learner attempt's :class:`LearnerFaults` at the loop's boundaries, seeing the
    learner through a :class:`LearnerView`.

    ``before_start`` (a retry waits out its restart delay; a scavenged learner waits to join),
    ``before_step`` (True: leave the run; else fails or kills at a due failure), ``after_step``
    (slows down), ``on_send`` (damages a payload). ``fired_at``: the run clock when a timed failure
    fired (its failure event's time), else None. ``corrupted``: submissions damaged so far, over
    attempts (kept in the exchange's record)."""

    def __init__(self, plan: LearnerFaults, view: LearnerView) -> None:
        self.plan, self.v = plan, view
        self.fired_at: float | None = None
        self.pending: list = []  # timed failures after this attempt's start, ascending
        self.slowed, self.owed, self.steps = 1.0, 0.0, 0  # the current factor; turns owed; steps this attempt
        self.corrupted = int(view.info.get("corrupted", 0))

    # -- before the first step --------------------------------------------------------------------
    def before_start(self) -> None:
        """A retry stays down for the restart delay of the timed failure it follows, counted from the
        moment that failure fired (a failure fires at the first step boundary after its time; a
        compiling first step can make that seconds late); failing again while down extends it (as
        DP). A scavenged learner waits (status ``absent``) until it joins."""
        v, plan = self.v, self.plan
        if v.attempt > 1 and plan.timed_failures:
            fired = float(v.info.get("failed_t", v.clock()))
            due = [f for f in plan.timed_failures if f.at_s <= fired]
            if due:
                # the failure that fired (the earliest pending one: two can fall due at one step boundary)
                which = v.info.get("failed_at_s")
                f = next((f for f in due if which is not None and f.at_s == float(which)), due[-1])
                back = fired + f.restart_delay_s
                for g in plan.timed_failures:
                    if f.at_s < g.at_s <= back:
                        back = max(back, g.at_s + g.restart_delay_s)
                if back > v.clock():  # still within the restart delay
                    v.heartbeat(
                        status="down",
                        reason=f"restarting: delay {f.restart_delay_s:g} s after the failure at {f.at_s:g} s",
                    )
                    v.wait_until(back)
        if v.clock() < plan.join_s:
            v.heartbeat(status="absent", pid=os.getpid())
            v.wait_until(plan.join_s)
            if v.clock() >= plan.join_s:  # (else the run ended first: it never joins, and stops at once)
                v.event("join", train_t=v.clock())
        start = v.clock()
        self.pending = [f for f in plan.timed_failures if f.at_s > start]

    # -- at step boundaries -----------------------------------------------------------------------
    def before_step(self, step: int) -> bool:
        """Before local step ``step`` + 1: True when the learner leaves the run now (its presence window
        closed); raises :class:`InjectedFailure` (or SIGKILLs the process) when a failure is due."""
        v, plan = self.v, self.plan
        if plan.leave_s is not None and v.clock() >= plan.leave_s:  # a scavenged learner's devices go back
            v.event("leave", step=step, train_t=v.clock())
            return True
        if self.pending and self.pending[0].at_s <= v.clock():
            f = self.pending.pop(0)
            self.fired_at = v.run_clock()
            v.heartbeat(failed_t=v.clock(), failed_at_s=f.at_s)  # its retry is down from here
            self._fail(f.how, f"at {f.at_s:g} s of training", step, report_down=True, train_t=v.clock())
        k = v.attempt - 1
        if k < len(plan.step_failures) and step + 1 == plan.step_failures[k].at_step:
            self._fail(plan.step_failures[k].how, f"at local step {step + 1}", step)
        return False

    def _fail(self, how: str, when: str, step: int, report_down: bool = False, **fields) -> None:
        """Raise :class:`InjectedFailure`, or (``how`` sigkill) log a ``kill`` event and SIGKILL the
        process, first reporting it down to the exchange when ``report_down`` (a timed failure, whose
        retry waits out a restart delay; a step kill is seen by the syncer as silence)."""
        if how == "sigkill":
            reason = f"chaos: SIGKILL {when}"
            if report_down:
                self.v.heartbeat(status="down", reason=reason)
            t = self.v.run_clock()
            self.v.event("kill", step=step, reason=reason, t=t, **fields)
            self.v.state("down", t, reason)
            kill_self()
        raise InjectedFailure(f"learner {self.v.m}: injected failure {when}")

    def after_step(self, step: int, computed: float) -> None:
        """Slow the learner down after local step ``step`` took ``computed`` seconds when a slowdown is
        on (logging each change of pace once; an attempt's first step, which compiles, is not slowed)."""
        self.steps += 1
        if not self.plan.slowdowns:
            return
        now = self.v.clock()
        factor = max(
            (e.factor for e in self.plan.slowdowns if e.from_s <= now and (e.to_s is None or now < e.to_s)), default=1.0
        )
        if factor != self.slowed:
            self.v.event("slowdown", factor=factor, step=step, train_t=now)
            self.slowed = factor
        if factor > 1.0 and self.steps > 1:
            self.owed = slow_down(self.v.turns, self.v.sleep, factor - 1.0, computed, self.owed)

    def on_send(
        self, p: int, payload: dict[str, np.ndarray], step: int, version: int, tokens: int
    ) -> dict[str, np.ndarray]:
        """``payload`` of fragment ``p`` (sent at local step ``step``, on base ``version``, carrying
        ``tokens``), damaged when a corruption is due."""
        due = self.plan.corruptions
        if self.corrupted < len(due) and due[self.corrupted].at_s <= self.v.clock():
            kind = due[self.corrupted].corruption
            payload = corrupt_payload(payload, kind)
            self.corrupted += 1
            self.v.heartbeat(corrupted=self.corrupted)
            self.v.event(
                "corrupt", fragment=p, kind=kind, step=step, base_version=version, tokens=tokens, train_t=self.v.clock()
            )
        return payload


@dataclass(frozen=True)
class JobFault:
    """A failure of a synchronous job's host: host ``host`` fails before it takes step ``at_step`` or
    after ``at_s`` seconds of the job's clock (exactly one), by ``how`` (raise | sigkill), and the job
    stays down ``restart_delay_s`` seconds. ``index`` names it over the job's restarts (a fault fires
    once); ``replica``: the chaos schedule's learner it came from (the report's row), else the host."""

    index: int
    host: int
    how: str
    at_step: int | None = None
    at_s: float | None = None
    restart_delay_s: float = 0.0
    replica: int | None = None


class HostHooks:
    """Fires one DP host's scheduled faults at the job loop's step boundaries (``training.dp``), as
    :class:`FaultHooks` does a learner's.

    ``failures``: the job's (every host's; only ``host``'s fire here) that are not ``spent`` (indices
    already fired, or passed while the job was down). A step failure fires before the host takes step
    ``at_step``; a timed one at the first step boundary after ``at_s`` of the job's ``clock``, if after
    ``since_s`` (this start of the job). ``slowdowns``: this host's; while one is on, the host idles
    (factor − 1) × each step's compute (``sleep``), and the hosts it all-reduces with wait for it.
    ``note(record)`` is called with the failure's record (host, replica, index, step, t, at_s,
    restart_delay_s, reason) before the host raises :class:`InjectedFailure` (carrying it) or SIGKILLs
    its process; ``event(record)`` logs a change of pace."""

    def __init__(
        self,
        host: int,
        failures: tuple[JobFault, ...],
        slowdowns: tuple,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        note: Callable[[dict], None],
        event: Callable[[dict], None],
        spent: tuple[int, ...] = (),
        since_s: float = 0.0,
    ) -> None:
        self.host, self.clock, self.sleep, self.note, self.event = host, clock, sleep, note, event
        self.failures = [f for f in failures if f.host == host and f.index not in spent]
        self.slowdowns, self.since_s = slowdowns, since_s
        self.slowed, self.steps = 1.0, 0  # the current factor; steps taken since this start

    def before_step(self, step: int) -> None:
        """Before the host takes step ``step`` + 1: fail when a failure is due."""
        if not self.failures:
            return
        now = self.clock()
        for f in self.failures:
            timed = f.at_s is not None and self.since_s < f.at_s <= now
            if timed or f.at_step == step + 1:
                when = f"at {f.at_s:g} s of training" if timed else f"at step {step + 1}"
                reason = f"chaos: host {self.host} {'killed' if f.how == 'sigkill' else 'failed'} {when}"
                record = {
                    "host": self.host,
                    "replica": self.host if f.replica is None else f.replica,
                    "index": f.index,
                    "step": step,
                    "t": now,
                    "at_s": f.at_s,
                    "restart_delay_s": f.restart_delay_s,
                    "how": f.how,
                    "reason": reason,
                }
                self.note(record)
                if f.how == "sigkill":
                    kill_self()
                raise InjectedFailure(reason, record)

    def after_step(self, step: int, computed: float) -> None:
        """After step ``step`` took ``computed`` seconds: idle while a slowdown is on (logging each change
        of pace once; the first step of a start, which compiles, is not slowed)."""
        self.steps += 1
        if not self.slowdowns:
            return
        now = self.clock()
        factor = max(
            (e.factor for e in self.slowdowns if e.from_s <= now and (e.to_s is None or now < e.to_s)), default=1.0
        )
        if factor != self.slowed:
            self.event({"event": "slowdown", "factor": factor, "host": self.host, "step": step, "t": now})
            self.slowed = factor
        if factor > 1.0 and self.steps > 1:
            self.sleep((factor - 1.0) * computed)
