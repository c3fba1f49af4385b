"""The learner loop: inner steps, fragment sends on the staggered schedule, receipts, resume points.

No Prefect and no model code here: the loop is handed a :class:`LearnerSetup` (the step function,
the batches, the exchange, the receipt rule, where to save resume points), which
``training.diloco`` builds from plain inputs. The loop never waits on the syncer or on peers:
newer global fragments are applied at step boundaries when present.

Resume order for a retried learner (attempt > 1, or any attempt that finds a resume point):
(1) pull every global fragment at its current version (the paper's rejoin); (2) restore its local
step, data cursor and inner optimizer state (Adam moments and step counts) from the last saved
resume point, or start at step 0 with a fresh optimizer if none was saved; (3) zero the
per-fragment counters (the pulled fragments hold none of its progress). Tokens processed by steps
after the last resume point are counted once in ``processed`` (they were claimed from the budget)
and taken again from the resume point. Sends of those steps carry ``attempt`` and ``local_step``: the
syncer merges each (learner, fragment, local step) at most once and counts a re-trained step whose
work it had merged as recomputed (``diloco.syncer``); the counters sent (``tokens``, ``steps``) run
from the resume or the last receipt, which is what lets it split a copy's new steps from re-trained ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from diloco.exchange.base import Exchange, Submission
from diloco.fragments import fragments_due
from diloco.pacing import FairTurns
from diloco.receipt import ReceiptRule
from diloco.tensors import to_numpy
from diloco.wire import WireFormat


class InjectedFailure(RuntimeError):
    """Raised by a learner at a configured local step (chaos testing); the task runner retries it."""


# (epoch, index) -> (batch [B, ...], next_epoch, next_index): a pure, resumable cursor
BatchFn = Callable[[int, int], tuple[np.ndarray, int, int]]
# (params, opt_state, batch) -> (params, opt_state, metrics): training.step.make_train_step
StepFn = Callable[[dict, Any, Any], tuple[dict, Any, dict]]


@dataclass
class ResumePoint:
    """Where a learner can restart: after ``step`` inner steps, at data cursor ``cursor``, with its
    inner optimizer state (a pytree of arrays). ``tokens``: tokens it had processed then."""

    step: int
    cursor: tuple[int, int]
    tokens: int
    opt_state: Any


class ResumeStore(Protocol):
    """Durable resume points of one learner (``training.checkpoint.OrbaxResumeStore``).

    ``save`` may return before the point is durable (an asynchronous write); ``flush`` blocks until
    every save is written and raises a failed write's error; ``load`` sees every finished save. A
    store may also have ``ready()``: False while a save is in flight (the learner then skips that
    resume point instead of waiting inside its compute turn)."""

    def save(self, point: ResumePoint) -> None: ...
    def flush(self) -> None: ...
    def load(self, opt_template: Any) -> ResumePoint | None: ...


@dataclass
class FragmentState:
    """A learner's view of fragment p.

    ``version``: the global version last received (−1: none yet). ``base``: that version's Θ_p
    (float32, as pulled): what a quantised submission's update Δ = θ − Θ_base is taken against.
    ``reference``: what the unsent progress is measured against (the Θ_p received, or the copy
    last sent). ``tokens``/``steps``:
    progress relative to ``version`` (what the next submission reports); ``unsent_tokens``/
    ``unsent_steps``: progress since ``reference``.
    """

    names: list[str]
    version: int = -1
    base: dict[str, np.ndarray] | None = None
    reference: dict[str, np.ndarray] | None = None
    tokens: int = 0
    steps: int = 0
    unsent_tokens: int = 0
    unsent_steps: int = 0

    def stepped(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1
        self.unsent_tokens += tokens
        self.unsent_steps += 1

    def sent(self, copy: dict[str, np.ndarray]) -> None:
        self.reference, self.unsent_tokens, self.unsent_steps = copy, 0, 0

    def received(self, version: int, params: dict[str, np.ndarray], keeps_progress: bool) -> None:
        if self.version >= 0 and keeps_progress:  # the kept steps count again, against the new base
            self.tokens, self.steps = self.unsent_tokens, self.unsent_steps
        else:
            self.tokens = self.steps = self.unsent_tokens = self.unsent_steps = 0
        self.reference, self.base, self.version = params, params, version


@dataclass
class LearnerSetup:
    """Everything learner ``learner`` needs for one attempt (built by ``training.diloco``)."""

    learner: int
    attempt: int
    step: StepFn
    init_params: Callable[[], dict]
    init_opt: Callable[[dict], Any]
    next_batch: BatchFn
    fragments: list[list[str]]
    period: int  # H
    tokens_per_step: int
    receipt: ReceiptRule
    exchange: Exchange
    log: Callable[[dict], None]
    stop: Callable[[], bool] = lambda: False
    resume: ResumeStore | None = None
    resume_every: int = 0
    turns: FairTurns | None = None
    fail_at_steps: tuple[int, ...] = ()  # ascending; the k-th fires on attempt k (chaos testing)
    kill_steps: frozenset[int] = frozenset()  # those of fail_at_steps that SIGKILL the process instead
    kill_at_s: tuple[float, ...] = ()  # SIGKILL the process at these run-clock times (seconds), each once
    num_learners: int = 1  # M: how many learners the start gate waits for
    start_wait_s: float = 0.0  # the start gate: wait at most this long for the other learners (attempt 1)
    log_every: int = 10
    wire: WireFormat = WireFormat()  # how submissions cross the wire (diloco.wire); float32: θ as is
    # (factor, from_s, to_s or None): in [from_s, to_s) of the training clock the learner steps factor×
    # less often than its peers: it sits out turns, or idles alone (chaos.slowdowns, _slow_down)
    slowdowns: tuple[tuple[float, float, float | None], ...] = ()
    # chaos schedule (configs.chaos), on the training clock: (at_s, restart_delay_s, how) failures,
    # ascending; the presence window (join_s, leave_s or None); (at_s, kind) corruptions, ascending
    timed_failures: tuple[tuple[float, float, str], ...] = ()
    window: tuple[float, float | None] = (0.0, None)
    corruptions: tuple[tuple[float, str], ...] = ()
    # τ (diloco.overlap_steps): a fragment sent at step s must be merged back by step s + τ, or the
    # learner waits for it (the paper's overlapped communication); None = never wait
    overlap_steps: int | None = None
    wait_timeout_s: float = 10.0  # give up one wait after this long (diloco.heartbeat_timeout_s)
    sleep: Callable[[float], None] = time.sleep


def tree_digest(tree: Any) -> str:
    """sha256 of a pytree's array leaves (bytes, in leaf order): equal digests, equal states."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


def _kill_self() -> None:
    """SIGKILL this process: a real crash, nothing after it runs (chaos testing)."""
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_timer(ex: Exchange, at_s: float, learner: int, attempt: int, log) -> threading.Event:
    """A daemon thread that SIGKILLs this process once the run clock reaches ``at_s`` seconds;
    setting the returned event disarms it (the learner ended first)."""
    disarm = threading.Event()

    def watch() -> None:
        while not disarm.wait(min(0.05, max(at_s - ex.clock(), 0.0))):
            if ex.clock() >= at_s:
                log(
                    {
                        "event": "kill",
                        "learner": learner,
                        "attempt": attempt,
                        "step": ex.learners().get(learner, {}).get("step", 0),
                        "reason": f"chaos: SIGKILL at {at_s:g} s",
                        "t": ex.clock(),
                    }
                )
                _kill_self()

    threading.Thread(target=watch, name=f"chaos-kill-{learner}", daemon=True).start()
    return disarm


def _start_gate(ex: Exchange, m: int, num_learners: int, wait_s: float, stop: Callable[[], bool]) -> float:
    """Report ready, then wait until all ``num_learners`` learners have reported (ready or later),
    ``wait_s`` seconds have passed, the run closed or ``stop()``. Returns the seconds waited.

    Only first attempts pass the gate, and only before their first step: learners in separate
    processes start seconds apart (each imports JAX and compiles its step), and without it the first
    one up would take a large share of the token budget alone before the others could contribute.
    Once training has started no learner ever waits for another."""
    t0 = time.monotonic()
    ex.heartbeat(m, status="ready", pid=os.getpid())
    while time.monotonic() - t0 < wait_s and not (stop() or ex.is_closed()):
        if len(ex.learners()) >= num_learners:
            break
        time.sleep(0.01)
    return time.monotonic() - t0


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


def _wait_until(
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


def _slow_down(s: LearnerSetup, extra: float, computed: float, owed: float) -> float:
    """A slower device (chaos slowdowns): after a step of ``computed`` seconds, make this learner
    (factor − 1) = ``extra`` steps' worth slower than its peers; returns the part of a turn still owed.

    Alone on its device (no turns) it idles ``extra × computed`` seconds. On a host shared in first-come
    turns idling cannot slow it (its peers' turns fill the idle and it is served once a round all the
    same), so it owes ``extra`` of a turn per step and, for each whole turn owed, sits one out: it joins
    the queue and passes its turn on unused, the learners behind it stepping first. It steps factor×
    less often than its peers, as on a device factor× slower. A turn passed at once (nobody else was
    waiting) costs nothing, so then it idles one step's time instead."""
    if s.turns is None:
        s.sleep(extra * computed)
        return 0.0
    owed += extra
    while owed >= 1.0:
        owed -= 1.0
        t = time.perf_counter()
        with s.turns:
            pass  # sat out: the learners queued before it took their turns
        if time.perf_counter() - t < 0.5 * computed:
            s.sleep(computed)
    return owed


def run_learner(s: LearnerSetup) -> dict:
    """Run inner steps until the budget is spent, the run closes or ``s.stop()``; then hand in
    every fragment with unsent progress.

    Chaos (``configs.chaos`` schedules, on the training clock: seconds since this learner's first
    attempt started): a retried attempt first waits out the restart delay of the failure it
    follows, counted from the moment that failure fired (status ``down``); a scavenged learner waits
    to join (status ``absent``) and stops when it leaves; a timed failure fires in the attempt that
    was running at its time; the next submission after a corruption's time is damaged in flight.
    With ``overlap_steps`` τ the learner waits (outside its compute turn) when a fragment it sent τ
    steps ago has not been merged back.

    Raises :class:`InjectedFailure` at a configured step or time, after recording the reason in the
    exchange and the log; at a configured kill (``kill_steps``, ``kill_at_s``, a timed failure with
    ``how`` sigkill) SIGKILLs its own process instead (after a log line only). Returns a summary
    dict (steps, tokens, bytes, seconds waited).
    """
    m, ex = s.learner, s.exchange
    fired_at = None  # run clock at which a timed failure fired (its failure event's time)
    disarm = None
    ahead = sorted(t for t in s.kill_at_s if t > ex.clock())  # a kill time already passed has fired
    if ahead:
        disarm = _kill_timer(ex, ahead[0], m, s.attempt, s.log)
    try:
        info = ex.learners().get(m, {})
        bytes_in, bytes_out = int(info.get("bytes_from_syncer", 0)), int(info.get("bytes_to_syncer", 0))
        processed = int(info.get("processed", 0))
        params = s.init_params()
        frags = [FragmentState(list(names)) for names in s.fragments]

        def pull(p: int, version: int, theta: dict[str, np.ndarray]) -> None:
            nonlocal bytes_in, params
            f = frags[p]
            if f.version >= 0 and s.receipt.needs_local:
                new = s.receipt.apply(theta, to_numpy({k: params[k] for k in f.names}), f.reference)
            else:
                new = theta  # first pull of this attempt, or overwrite
            # Θ_p arrives in float32 (the syncer's master copy); kept in this learner's parameter dtype
            params = {**params, **{k: jnp.asarray(v, dtype=params[k].dtype) for k, v in new.items()}}
            f.received(version, theta, s.receipt.keeps_progress)
            bytes_in += sum(a.nbytes for a in theta.values())

        for p in range(len(frags)):
            pull(p, *ex.latest(p))
        opt_state = s.init_opt(params)
        step, cursor = 0, (0, 0)
        point = s.resume.load(opt_state) if s.resume is not None else None
        if point is not None:
            step, cursor, opt_state = point.step, tuple(point.cursor), point.opt_state
        epoch, index = cursor
        if s.attempt == 1 and s.start_wait_s > 0:
            _start_gate(ex, m, s.num_learners, s.start_wait_s, s.stop)
        # the training clock: seconds since this learner's first attempt started (kept by the exchange)
        origin = float(info["origin"]) if "origin" in info else ex.clock()
        ex.heartbeat(m, origin=origin)

        def clock() -> float:
            return ex.clock() - origin

        waited = float(info.get("waited_s", 0.0))
        corrupted = int(info.get("corrupted", 0))  # corruptions already sent (over attempts)
        if s.attempt > 1 and s.timed_failures:
            # down for the restart delay from the moment its failure fired (a failure fires at the first
            # step boundary after its time, a compiling first step can make that seconds late)
            fired = float(info.get("failed_t", clock()))
            due = [(a, d) for a, d, _ in s.timed_failures if a <= fired]
            if due:
                # the failure that fired (the earliest pending one: two can fall due at one step boundary)
                which = info.get("failed_at_s")
                a, d = next(((a, d) for a, d in due if which is not None and a == float(which)), due[-1])
                back = fired + d
                for a2, d2, _ in sorted(s.timed_failures):  # failing again while down extends it (as DP)
                    if a < a2 <= back:
                        back = max(back, a2 + d2)
                if back > clock():  # still within the restart delay
                    ex.heartbeat(m, status="down", reason=f"restarting: delay {d:g} s after the failure at {a:g} s")
                    _wait_until(clock, back, s.stop, ex, s.tokens_per_step)
        join_s, leave_s = s.window
        if clock() < join_s:
            ex.heartbeat(m, status="absent", pid=os.getpid())
            _wait_until(clock, join_s, s.stop, ex, s.tokens_per_step)
            if clock() >= join_s:  # (else the run ended first: it never joins, and stops at once)
                s.log({"event": "join", "learner": m, "attempt": s.attempt, "t": ex.clock(), "train_t": clock()})
        attempt_start = clock()
        pending_failures = [(a, how) for a, _, how in s.timed_failures if a > attempt_start]
        ex.heartbeat(
            m,
            status="running",
            attempt=s.attempt,
            step=step,
            processed=processed,
            cursor=(epoch, index),
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=ex.clock(),
        )
        s.log(
            {
                "event": "start",
                "learner": m,
                "attempt": s.attempt,
                "step": step,
                "t": ex.clock(),
                "origin": origin,
                "pid": os.getpid(),
                "resumed": point is not None,
                "opt_state_digest": tree_digest(opt_state),
            }
        )
        steps_this_attempt = skipped_saves = 0
        sat_out = 0.0  # turns owed by a slowed learner (chaos slowdowns, :func:`_slow_down`)

        in_flight: dict[int, tuple[int, int]] = {}  # fragment → (local step, base version) of its last send

        def send(p: int) -> None:
            nonlocal bytes_out, corrupted
            f = frags[p]
            copy = to_numpy({k: params[k] for k in f.names})
            # float32: θ itself (bit-identical to before wire formats); else Δ = θ − Θ_base, encoded
            payload = s.wire.encode({k: copy[k] - f.base[k] for k in f.names} if s.wire.sends_delta else copy)
            if corrupted < len(s.corruptions) and s.corruptions[corrupted][0] <= clock():
                kind = s.corruptions[corrupted][1]
                payload = corrupt_payload(payload, kind)
                corrupted += 1
                ex.heartbeat(m, corrupted=corrupted)
                s.log(
                    {
                        "event": "corrupt",
                        "learner": m,
                        "attempt": s.attempt,
                        "fragment": p,
                        "kind": kind,
                        "step": step,
                        "base_version": f.version,
                        "tokens": f.tokens,
                        "t": ex.clock(),
                        "train_t": clock(),
                    }
                )
            sub = Submission(
                learner=m,
                fragment=p,
                params=payload,
                tokens=f.tokens,
                steps=f.steps,
                base_version=f.version,
                local_step=step,
                attempt=s.attempt,
                sent_at=ex.clock(),
                wire=s.wire.spec,
            )
            bytes_out += sub.nbytes
            f.sent(copy)
            in_flight[p] = (step, f.version)
            ex.submit(sub)

        def overdue() -> int | None:
            """A fragment sent ≥ τ steps ago whose merge has not come back, or None."""
            if s.overlap_steps is None:
                return None
            versions = ex.versions()
            for p, (sent_step, base) in in_flight.items():
                if step - sent_step >= s.overlap_steps and versions[p] <= base:
                    return p
            return None

        def refresh() -> None:
            """Wait out an overdue merge (τ: ``overlap_steps``; a ``wait`` event), then apply every newer
            global fragment."""
            nonlocal waited
            p_wait = overdue()
            if p_wait is not None:
                t_wait, t_clock, p_first = time.monotonic(), ex.clock(), p_wait
                while (
                    p_wait is not None
                    and not (s.stop() or ex.is_closed())
                    and time.monotonic() - t_wait < s.wait_timeout_s
                ):
                    time.sleep(0.002)
                    p_wait = overdue()
                w = time.monotonic() - t_wait
                waited += w
                s.log(
                    {
                        "event": "wait",
                        "learner": m,
                        "attempt": s.attempt,
                        "step": step,
                        "fragment": p_first,
                        "wait_s": w,
                        "t": t_clock,
                        "timed_out": p_wait is not None,
                    }
                )
                if p_wait is not None:
                    in_flight.pop(p_wait, None)  # its merge is not coming (dropped): stop waiting for it
            latest = ex.versions()
            for p, f in enumerate(frags):
                if latest[p] > f.version:
                    pull(p, *ex.latest(p))
                    if p in in_flight and latest[p] > in_flight[p][1]:
                        del in_flight[p]

        metrics, slowed = None, 1.0
        while not (s.stop() or ex.is_closed()):
            if leave_s is not None and clock() >= leave_s:  # a scavenged learner's devices go back
                s.log(
                    {
                        "event": "leave",
                        "learner": m,
                        "attempt": s.attempt,
                        "step": step,
                        "t": ex.clock(),
                        "train_t": clock(),
                    }
                )
                break
            if pending_failures and pending_failures[0][0] <= clock():
                at, how = pending_failures.pop(0)
                fired_at = ex.clock()
                ex.heartbeat(m, failed_t=clock(), failed_at_s=at)  # its retry is down for the restart delay from here
                if how == "sigkill":
                    ex.heartbeat(m, status="down", reason=f"chaos: SIGKILL at {at:g} s of training")
                    s.log(
                        {
                            "event": "kill",
                            "learner": m,
                            "attempt": s.attempt,
                            "step": step,
                            "reason": f"chaos: SIGKILL at {at:g} s of training",
                            "t": ex.clock(),
                            "train_t": clock(),
                        }
                    )
                    _kill_self()
                raise InjectedFailure(f"learner {m}: injected failure at {at:g} s of training")
            refresh()
            if s.attempt <= len(s.fail_at_steps) and step + 1 == s.fail_at_steps[s.attempt - 1]:
                if step + 1 in s.kill_steps:
                    s.log(
                        {
                            "event": "kill",
                            "learner": m,
                            "attempt": s.attempt,
                            "step": step,
                            "reason": f"chaos: SIGKILL at local step {step + 1}",
                            "t": ex.clock(),
                        }
                    )
                    _kill_self()
                raise InjectedFailure(f"learner {m}: injected failure at local step {step + 1}")
            if not ex.claim_tokens(s.tokens_per_step, learner=m, stop=s.stop):
                break
            batch, epoch, index = s.next_batch(epoch, index)
            with s.turns or contextlib.nullcontext():
                computing = time.perf_counter()
                params, opt_state, metrics = s.step(params, opt_state, jax.tree.map(jnp.asarray, batch))
                # JAX dispatches asynchronously: hold the turn until the step has run, or co-located
                # learners would all compute at once and drift apart (what the turns prevent).
                jax.block_until_ready(metrics["loss"])
                step += 1
                steps_this_attempt += 1
                processed += s.tokens_per_step
                if s.resume is not None and s.resume_every and step % s.resume_every == 0:
                    # Handed over inside the turn, like the step: co-located learners reach the same
                    # step together, and saving outside their turns they queued on each other's
                    # writes while the first to finish took their turns, one sync period ahead for
                    # good. (The store copies the state and writes it in the background.)
                    saving = getattr(s.resume, "ready", lambda: True)()
                    if saving:
                        s.resume.save(
                            ResumePoint(step=step, cursor=(epoch, index), tokens=processed, opt_state=opt_state)
                        )
                    else:  # the last one is still being written: skip this one rather than hold the turn
                        skipped_saves += 1
                    s.log(
                        {
                            "event": "resume_point",
                            "learner": m,
                            "attempt": s.attempt,
                            "step": step,
                            "saved": saving,
                            "t": ex.clock(),
                        }
                    )
                computed = time.perf_counter() - computing
            if s.slowdowns:
                now = clock()
                factor = max((f for f, a, b in s.slowdowns if a <= now and (b is None or now < b)), default=1.0)
                if factor != slowed:
                    s.log(
                        {
                            "event": "slowdown",
                            "learner": m,
                            "attempt": s.attempt,
                            "factor": factor,
                            "step": step,
                            "t": ex.clock(),
                            "train_t": now,
                        }
                    )
                    slowed = factor
                if factor > 1.0 and steps_this_attempt > 1:  # (an attempt's first step includes compiling)
                    sat_out = _slow_down(s, factor - 1.0, computed, sat_out)
            for f in frags:
                f.stepped(s.tokens_per_step)
            due = fragments_due(step, len(frags), s.period)
            if s.overlap_steps is not None and any(p in in_flight for p in due):
                refresh()  # with τ = H the merge of its last send is due now, before it is sent again
            for p in due:
                send(p)
            beat = dict(
                step=step,
                processed=processed,
                cursor=(epoch, index),
                bytes_to_syncer=bytes_out,
                bytes_from_syncer=bytes_in,
                exchange_s=float(getattr(ex, "io_s", 0.0)),  # this process's, not this learner's
                waited_s=waited,
            )
            if step % s.log_every == 0:
                loss = float(metrics["loss"])
                beat["loss"] = loss
                s.log(
                    {
                        "event": "step",
                        "learner": m,
                        "step": step,
                        "train/loss": loss,
                        **{f"train/{k}": float(v) for k, v in metrics.items() if k != "loss"},
                        "tokens": processed,
                        "t": ex.clock(),
                    }
                )
            ex.heartbeat(m, **beat)
        if s.resume is not None:
            s.resume.flush()  # the last resume point is on disk before the learner reports done
        # Last step always syncs: hand in every fragment that has unsent progress. (unsent, not
        # total: a fragment sent and not yet merged back holds no new progress, and sending it again
        # would have the syncer merge the same parameters twice.)
        for p, f in enumerate(frags):
            if f.unsent_steps > 0:
                send(p)
        ex.heartbeat(m, status="done", bytes_to_syncer=bytes_out, bytes_from_syncer=bytes_in)
        s.log({"event": "stop", "learner": m, "attempt": s.attempt, "step": step, "t": ex.clock()})
        return {
            "learner": m,
            "attempt": s.attempt,
            "steps": step,
            "steps_this_attempt": steps_this_attempt,
            "tokens": processed,
            "bytes_to_syncer": bytes_out,
            "bytes_from_syncer": bytes_in,
            "waited_s": waited,
            "resume_points_skipped": skipped_saves,
        }
    except BaseException as exc:
        if s.resume is not None:
            with contextlib.suppress(BaseException):
                s.resume.flush()  # a save in flight finishes (or fails) before a retry loads
        ex.heartbeat(m, status="down", reason=repr(exc))
        s.log(
            {
                "event": "failure",
                "learner": m,
                "attempt": s.attempt,
                "reason": repr(exc),
                "step": ex.learners().get(m, {}).get("step", 0),
                "t": ex.clock() if fired_at is None else fired_at,
            }
        )
        raise
    finally:
        if disarm is not None:
            disarm.set()
