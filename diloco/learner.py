"""The learner loop: inner steps, fragment sends on the staggered schedule, receipts, resume points.

No Prefect and no model code here: the loop is handed a :class:`LearnerSetup` (the step function,
the batches, the exchange, the receipt rule, where to save resume points), which
``training.decoupled.setup`` builds from plain inputs. The loop never waits on the syncer or on peers:
newer global fragments are applied at step boundaries when present. One attempt's state is a
:class:`Learner` whose methods are the loop's steps (:func:`run_learner` reads as the algorithm);
scheduled faults enter through ``diloco.faults.FaultHooks`` at the step and send boundaries.

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
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from diloco.exchange.base import Exchange, Submission
from diloco.faults import (
    FaultHooks,
    InjectedFailure as InjectedFailure,  # re-exported: the task runner's retry reason
    LearnerFaults,
    LearnerView,
    wait_until,
)
from diloco.fragments import fragments_due
from diloco.pacing import FairTurns
from diloco.receipt import ReceiptRule
from diloco.tensors import to_numpy
from diloco.wire import WireFormat

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
    """Everything learner ``learner`` needs for one attempt (built by ``training.decoupled.setup``)."""

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
    faults: LearnerFaults = LearnerFaults()  # scheduled faults (chaos testing, ``diloco.faults``)
    num_learners: int = 1  # M: how many learners the start gate waits for
    start_wait_s: float = 0.0  # the start gate: wait at most this long for the other learners (attempt 1)
    log_every: int = 10
    lr: Callable[[int], float] | None = None  # the inner learning rate of update i (the schedule), for the log
    wire: WireFormat = WireFormat()  # how submissions cross the wire (diloco.wire); float32: θ as is
    # τ (diloco.overlap_steps): a fragment sent at step s must be merged back by step s + τ, or the
    # learner waits for it (the paper's overlapped communication); None = never wait
    overlap_steps: int | None = None
    wait_timeout_s: float = 10.0  # give up one wait after this long (diloco.heartbeat_timeout_s)
    sleep: Callable[[float], None] = time.sleep
    # the run clock when this attempt's task began (before its model and step were built), for the
    # start-up timeline of the ``start`` event; None = when the Learner was made
    began_at: float | None = None


def _process_started() -> float:
    """This process's start (Unix time, seconds)."""
    import psutil

    return psutil.Process().create_time()


def cluster_node() -> str | None:
    """The Ray node this process runs on (its node id), when it is a Ray worker; None elsewhere
    (threads, Dask: the heartbeat's and the event's ``host`` tells the machine)."""
    import sys

    ray = sys.modules.get("ray")  # (never imported here: only a Ray worker has it)
    if ray is None or not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - a driver-side or shut-down context: no node to name
        return None


def tree_digest(tree: Any) -> str:
    """sha256 of a pytree's array leaves (bytes, in leaf order): equal digests, equal states."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


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


class Learner:
    """One attempt of learner ``s.learner``: its parameters, inner optimizer state, fragments, data
    cursor and counters, and the steps of :func:`run_learner` as methods.

    Counters carried over attempts come from the exchange's record of the learner (``info``):
    bytes to and from the syncer (bytes), tokens processed (tokens), seconds waited (seconds); the
    fault hooks keep the corruptions sent."""

    def __init__(self, s: LearnerSetup) -> None:
        self.s, self.m, self.attempt, self.ex = s, s.learner, s.attempt, s.exchange
        self.info = self.ex.learners().get(self.m, {})
        self.bytes_in = int(self.info.get("bytes_from_syncer", 0))
        self.bytes_out = int(self.info.get("bytes_to_syncer", 0))
        self.processed = int(self.info.get("processed", 0))
        self.waited = float(self.info.get("waited_s", 0.0))
        self.frags = [FragmentState(list(names)) for names in s.fragments]
        self.in_flight: dict[int, tuple[int, int]] = {}  # fragment → (local step, base version) of its last send
        self.params: dict = {}
        self.opt_state: Any = None
        self.step, self.epoch, self.index = 0, 0, 0
        self.steps_this_attempt = self.skipped_saves = 0
        self.resumed = False
        self.origin = 0.0
        self.metrics: dict | None = None
        # start-up timeline on the run clock (the ``start`` event): process, task, built, gate
        self.began_at = self.ex.clock() if s.began_at is None else s.began_at
        self.ready_at, self.gate_s = self.began_at, 0.0
        self.current: str | None = None  # the last state logged (:meth:`state`)

    def clock(self) -> float:
        """The training clock: seconds since this learner's first attempt started."""
        return self.ex.clock() - self.origin

    def event(self, name: str, **fields) -> float:
        """Log ``{"event": name, "learner", "attempt", **fields, "t"}`` (``t``: the run clock unless
        given); returns ``t``."""
        t = fields.pop("t") if "t" in fields else None
        rec = {"event": name, "learner": self.m, "attempt": self.attempt, **fields}
        rec["t"] = self.ex.clock() if t is None else t
        self.s.log(rec)
        return rec["t"]

    def state(self, state: str, t: float | None = None, reason: str | None = None) -> None:
        """Log a transition to ``state`` (up, down, restarting, done) at ``t`` (the run clock unless
        given), unless the learner is in it already: a ``run.records.StateEvent`` (as a dict: this
        package imports none of the project's others)."""
        if state == self.current:
            return
        self.current = state
        rec = {"event": "state", "state": state, "learner": self.m, "attempt": self.attempt}
        rec |= {"host": socket.gethostname(), **({"reason": reason} if reason else {})}
        self.s.log({**rec, "t": self.ex.clock() if t is None else t})

    def fault_view(self) -> LearnerView:
        """What this attempt's fault hooks see of it (``diloco.faults.LearnerView``)."""
        ex, m, s = self.ex, self.m, self.s
        return LearnerView(
            m=m,
            attempt=self.attempt,
            info=self.info,
            clock=self.clock,
            run_clock=ex.clock,
            heartbeat=lambda **fields: ex.heartbeat(m, **fields),
            event=self.event,
            state=self.state,
            wait_until=lambda t: wait_until(self.clock, t, s.stop, ex, s.tokens_per_step),
            turns=s.turns,
            sleep=s.sleep,
        )

    def stopping(self) -> bool:
        return self.s.stop() or self.ex.is_closed()

    # -- start ------------------------------------------------------------------------------------
    def restore(self) -> None:
        """The paper's rejoin: pull every global fragment at its current version, then restore the last
        resume point (step, data cursor, inner optimizer state), or start at step 0; then (a first
        attempt on a process engine) pass the start gate and fix the training clock's origin."""
        s = self.s
        self.params = s.init_params()
        for p in range(len(self.frags)):
            self.pull(p, *self.ex.latest(p))
        self.opt_state = s.init_opt(self.params)
        point = s.resume.load(self.opt_state) if s.resume is not None else None
        if point is not None:
            self.step, (self.epoch, self.index), self.opt_state = point.step, tuple(point.cursor), point.opt_state
            self.resumed = True
        self.ready_at = self.ex.clock()
        if self.attempt == 1 and s.start_wait_s > 0:
            self.gate_s = _start_gate(self.ex, self.m, s.num_learners, s.start_wait_s, s.stop)
        self.origin = float(self.info["origin"]) if "origin" in self.info else self.ex.clock()
        self.ex.heartbeat(self.m, origin=self.origin)

    def announce(self) -> None:
        """Report ``running`` and log the attempt's ``start`` (with its optimizer state's digest)."""
        self.ex.heartbeat(
            self.m,
            status="running",
            attempt=self.attempt,
            step=self.step,
            processed=self.processed,
            cursor=(self.epoch, self.index),
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=self.ex.clock(),
        )
        t = self.event(
            "start",
            step=self.step,
            origin=self.origin,
            pid=os.getpid(),
            host=socket.gethostname(),
            node=cluster_node(),  # the Ray node, on Ray: where each attempt ran
            resumed=self.resumed,
            opt_state_digest=tree_digest(self.opt_state),
            # start-up, on the run clock: its process started (negative: before the run's clock, e.g.
            # a worker started in advance; imports follow), the task began, the model, initial
            # parameters and optimizer state were ready, and the seconds it then waited at the start
            # gate (the step compiles, or loads from the compilation cache, at the first step)
            process_t=round(self.ex.clock() - (time.time() - _process_started()), 3),
            task_t=round(self.began_at, 3),
            ready_t=round(self.ready_at, 3),
            gate_s=round(self.gate_s, 3),
        )
        self.state("up", t)

    # -- fragments in and out ---------------------------------------------------------------------
    def pull(self, p: int, version: int, theta: dict[str, np.ndarray]) -> None:
        """Apply global fragment ``p`` at ``version`` by the receipt rule (overwrite on a first pull)."""
        f, receipt = self.frags[p], self.s.receipt
        if f.version >= 0 and receipt.needs_local:
            new = receipt.apply(theta, to_numpy({k: self.params[k] for k in f.names}), f.reference)
        else:
            new = theta
        # Θ_p arrives in float32 (the syncer's master copy); kept in this learner's parameter dtype
        self.params = {**self.params, **{k: jnp.asarray(v, dtype=self.params[k].dtype) for k, v in new.items()}}
        f.received(version, theta, receipt.keeps_progress)
        self.bytes_in += sum(a.nbytes for a in theta.values())

    def send(self, p: int, faults: FaultHooks) -> None:
        """Submit fragment ``p``: θ_p itself (float32 wire) or Δ = θ_p − Θ_base encoded (``diloco.wire``)."""
        f, wire = self.frags[p], self.s.wire
        copy = to_numpy({k: self.params[k] for k in f.names})
        payload = wire.encode({k: copy[k] - f.base[k] for k in f.names} if wire.sends_delta else copy)
        sub = Submission(
            learner=self.m,
            fragment=p,
            params=faults.on_send(p, payload, self.step, f.version, f.tokens),
            tokens=f.tokens,
            steps=f.steps,
            base_version=f.version,
            local_step=self.step,
            attempt=self.attempt,
            sent_at=self.ex.clock(),
            wire=wire.spec,
        )
        self.bytes_out += sub.nbytes
        f.sent(copy)
        self.in_flight[p] = (self.step, f.version)
        self.ex.submit(sub)

    def overdue(self) -> int | None:
        """A fragment sent ≥ τ steps ago whose merge has not come back, or None."""
        if self.s.overlap_steps is None:
            return None
        versions = self.ex.versions()
        for p, (sent_step, base) in self.in_flight.items():
            if self.step - sent_step >= self.s.overlap_steps and versions[p] <= base:
                return p
        return None

    def refresh(self) -> None:
        """Wait out an overdue merge (τ: ``overlap_steps``; a ``wait`` event, given up after
        ``wait_timeout_s``), then apply every newer global fragment."""
        p_wait = self.overdue()
        if p_wait is not None:
            t_wait, t_clock, p_first = time.monotonic(), self.ex.clock(), p_wait
            while p_wait is not None and not self.stopping() and time.monotonic() - t_wait < self.s.wait_timeout_s:
                time.sleep(0.002)
                p_wait = self.overdue()
            w = time.monotonic() - t_wait
            self.waited += w
            self.event("wait", step=self.step, fragment=p_first, wait_s=w, t=t_clock, timed_out=p_wait is not None)
            if p_wait is not None:
                self.in_flight.pop(p_wait, None)  # its merge is not coming (dropped): stop waiting for it
        latest = self.ex.versions()
        for p, f in enumerate(self.frags):
            if latest[p] > f.version:
                self.pull(p, *self.ex.latest(p))
                if p in self.in_flight and latest[p] > self.in_flight[p][1]:
                    del self.in_flight[p]

    # -- the inner step ---------------------------------------------------------------------------
    def inner_step(self) -> float:
        """One inner optimizer step on the next batch, inside the host's compute turn; saves a resume
        point every ``resume_every`` steps. Returns the seconds it computed."""
        s = self.s
        batch, self.epoch, self.index = s.next_batch(self.epoch, self.index)
        with s.turns or contextlib.nullcontext():
            computing = time.perf_counter()
            self.params, self.opt_state, self.metrics = s.step(
                self.params, self.opt_state, jax.tree.map(jnp.asarray, batch)
            )
            # JAX dispatches asynchronously: hold the turn until the step has run, or co-located
            # learners would all compute at once and drift apart (what the turns prevent).
            jax.block_until_ready(self.metrics["loss"])
            self.step += 1
            self.steps_this_attempt += 1
            self.processed += s.tokens_per_step
            if s.resume is not None and s.resume_every and self.step % s.resume_every == 0:
                self.save_resume_point()
            return time.perf_counter() - computing

    def save_resume_point(self) -> None:
        """Hand a resume point to the store, inside the turn like the step: co-located learners reach
        the same step together, and saving outside their turns they queued on each other's writes
        while the first to finish took their turns, one sync period ahead for good. (The store copies
        the state and writes it in the background; one still being written skips this one rather
        than hold the turn.)"""
        saving = getattr(self.s.resume, "ready", lambda: True)()
        if saving:
            point = ResumePoint(self.step, (self.epoch, self.index), self.processed, self.opt_state)
            self.s.resume.save(point)
        else:
            self.skipped_saves += 1
        self.event("resume_point", step=self.step, saved=saving)

    def sync(self, faults: FaultHooks) -> None:
        """Count the step in every fragment and send the fragments due at this step (the staggered
        schedule, ``diloco.fragments.fragments_due``); with τ = H the merge of a fragment's last send
        is awaited first."""
        for f in self.frags:
            f.stepped(self.s.tokens_per_step)
        due = fragments_due(self.step, len(self.frags), self.s.period)
        if self.s.overlap_steps is not None and any(p in self.in_flight for p in due):
            self.refresh()
        for p in due:
            self.send(p, faults)

    def beat(self) -> None:
        """Heartbeat the counters to the exchange; every ``log_every`` steps log the train metrics."""
        beat = dict(
            step=self.step,
            processed=self.processed,
            cursor=(self.epoch, self.index),
            bytes_to_syncer=self.bytes_out,
            bytes_from_syncer=self.bytes_in,
            exchange_s=float(getattr(self.ex, "io_s", 0.0)),  # this process's, not this learner's
            waited_s=self.waited,
        )
        if self.step % self.s.log_every == 0:
            beat["loss"] = loss = float(self.metrics["loss"])
            metrics = {f"train/{k}": float(v) for k, v in self.metrics.items() if k != "loss"}
            if self.s.lr is not None:
                metrics["train/lr"] = float(self.s.lr(self.step - 1))  # the rate of this step's update
            self.s.log(
                {
                    "event": "step",
                    "learner": self.m,
                    "step": self.step,
                    "train/loss": loss,
                    **metrics,
                    "tokens": self.processed,
                    "t": self.ex.clock(),
                }
            )
        self.ex.heartbeat(self.m, **beat)

    # -- the end ----------------------------------------------------------------------------------
    def hand_in(self, faults: FaultHooks, why: str) -> dict:
        """Flush the resume store, send every fragment with unsent progress (unsent, not total: one
        sent and not yet merged back holds no new progress, and sending it again would have the syncer
        merge the same parameters twice), report ``done`` (``why``: the state event's reason);
        returns the attempt's summary."""
        if self.s.resume is not None:
            self.s.resume.flush()  # the last resume point is on disk before the learner reports done
        for p, f in enumerate(self.frags):
            if f.unsent_steps > 0:
                self.send(p, faults)
        self.ex.heartbeat(self.m, status="done", bytes_to_syncer=self.bytes_out, bytes_from_syncer=self.bytes_in)
        t = self.ex.clock()
        self.event("stop", step=self.step, t=t)
        self.state("done", t, why)
        return {
            "learner": self.m,
            "attempt": self.attempt,
            "steps": self.step,
            "steps_this_attempt": self.steps_this_attempt,
            "tokens": self.processed,
            "bytes_to_syncer": self.bytes_out,
            "bytes_from_syncer": self.bytes_in,
            "waited_s": self.waited,
            "resume_points_skipped": self.skipped_saves,
        }

    def failed(self, exc: BaseException, fired_at: float | None) -> None:
        """Let a resume save in flight finish (or fail) before a retry loads, report ``down`` and log
        the ``failure`` (at ``fired_at`` on the run clock when a timed failure fired)."""
        if self.s.resume is not None:
            with contextlib.suppress(BaseException):
                self.s.resume.flush()
        self.ex.heartbeat(self.m, status="down", reason=repr(exc))
        step = self.ex.learners().get(self.m, {}).get("step", 0)
        t = self.ex.clock() if fired_at is None else fired_at
        self.event("failure", reason=repr(exc), step=step, t=t)
        self.state("down", t, repr(exc))


def run_learner(s: LearnerSetup) -> dict:
    """Run inner steps until the budget is spent, the run closes or ``s.stop()``; then hand in
    every fragment with unsent progress. Returns a summary dict (steps, tokens, bytes, seconds waited).

    The learner never waits on the syncer or on peers, except with ``overlap_steps`` τ, when a
    fragment it sent τ steps ago has not been merged back (outside its compute turn). Scheduled
    faults (``s.faults``, :mod:`diloco.faults`) fire at the boundaries: before the first step, before
    and after each inner step and on each send. Raises :class:`InjectedFailure` at a scheduled
    failure, after reporting itself down and logging it; a scheduled kill SIGKILLs the process.
    """
    lrn = Learner(s)
    faults = s.faults.hooks(lrn.fault_view())
    why = "budget spent or run closed"
    try:
        if lrn.attempt > 1:  # a retry: restarting since its task began
            lrn.state("restarting", lrn.began_at, "retry")
        lrn.restore()
        faults.before_start()
        lrn.announce()
        while not lrn.stopping():
            if faults.before_step(lrn.step):  # leaves the run, or raises at a scheduled failure
                why = "left"  # a scavenged learner's window closed
                break
            lrn.refresh()
            if not lrn.ex.claim_tokens(s.tokens_per_step, learner=lrn.m, stop=s.stop):
                break
            computed = lrn.inner_step()
            faults.after_step(lrn.step, computed)
            lrn.sync(faults)
            lrn.beat()
        return lrn.hand_in(faults, why)
    except BaseException as exc:
        lrn.failed(exc, faults.fired_at)
        raise
