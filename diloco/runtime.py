"""The learner and syncer loops: plain Python threads-friendly loops around the pure pieces.

No Prefect here: ``tasks/pretrain.py`` wraps these loops as Prefect tasks (learners with retries).
Both loops are cooperative: they poll a ``threading.Event`` and the exchange, because nothing can
interrupt a running XLA call.

Resume order for a retried learner: (1) pull every global fragment at its current version,
(2) restore its local step, data cursor and processed-token count from its last heartbeat,
(3) start a fresh inner optimizer whose step counters are set to the local step (so the LR
schedule continues; moments restart at zero), (4) zero the per-fragment counters.

On receipt of a newer global fragment (:func:`on_receipt`): overwrite (the paper), mix, or keep the
inner steps taken while the fragment was in flight. With ``keep_in_flight`` the per-fragment
counters restart at the kept steps instead of zero, so a submission's tokens and steps always
describe exactly the progress its parameters hold relative to its base version. Learners that
share one process take first-come turns on the compute (:class:`FairTurns`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from diloco.exchange import Exchange, Submission
from diloco.fragments import fragments_due
from diloco.params import get_params, set_params, to_numpy
from diloco.syncer import Syncer
from models.training import train_step


class InjectedFailure(RuntimeError):
    """Raised by a learner at a configured local step (chaos testing); Prefect retries the task."""


# (epoch, index) -> (batch int32[B, L+1], next_epoch, next_index)
BatchFn = Callable[[int, int], tuple[np.ndarray, int, int]]


class FairTurns:
    """First-come-first-served turns on one host's compute for co-located learners.

    At most ``slots`` learners run an inner step at once; the others queue and are served in
    arrival order, so a learner that just stepped queues behind every learner already waiting.
    Without turns the OS scheduler lets some learner threads run many inner steps ahead of others
    on the same cores, and the fast ones' steps taken while a fragment is in flight are
    overwritten when the merged fragment comes back (or, with ``keep_in_flight``, land on a Θ
    that is many steps old). Turns pace co-located learners the way separate devices of equal speed
    would. Nothing else is shared: a learner that fails or stops simply stops queueing, so no
    learner ever waits for another's progress, only for a free slot.

    Raises ``ValueError`` if ``slots`` < 1.
    """

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be ≥ 1, got {slots}")
        self._guard = threading.Lock()
        self._queue: collections.deque[threading.Event] = collections.deque()
        self._free = slots

    def __enter__(self) -> "FairTurns":
        with self._guard:
            if self._free > 0 and not self._queue:
                self._free -= 1
                return self
            ticket = threading.Event()
            self._queue.append(ticket)
        ticket.wait()  # __exit__ hands its slot straight to the first ticket in the queue
        return self

    def __exit__(self, *exc) -> None:
        with self._guard:
            if self._queue:
                self._queue.popleft().set()
            else:
                self._free += 1


def on_receipt(
    received: dict[str, np.ndarray],
    local: dict[str, np.ndarray],
    reference: dict[str, np.ndarray],
    keep_in_flight: bool,
    mix_alpha: float = 0.0,
) -> dict[str, np.ndarray]:
    """A learner's new value of one fragment when the merged global fragment Θ_p arrives.

    Args:
        received: Θ_p from the syncer, tensor name → float32 array.
        local: the learner's current θ_p (same names and shapes).
        reference: what θ_p's unsent progress is measured against: the copy last sent, or, if the
            fragment was not sent since the last receipt, the Θ_p received then.
        keep_in_flight: θ ← Θ + (θ_local − reference) (ours): the inner steps taken while the
            fragment was in flight are kept and go into the next submission. Overwriting them
            (the paper's rule) discards about τ/H of every learner's compute, τ being the steps a
            fragment spends in flight: negligible at the paper's H, a quarter of it at H = 4.
        mix_alpha: when not keeping, θ ← α·θ_local + (1 − α)·Θ (Streaming DiLoCo, arXiv
            2501.18512); 0 overwrites.

    Returns new float32 arrays; the inputs are not modified.
    """
    if keep_in_flight:
        return {k: (v + (local[k] - reference[k])).astype(np.float32) for k, v in received.items()}
    if mix_alpha > 0:
        return {k: (mix_alpha * local[k] + (1 - mix_alpha) * v).astype(np.float32) for k, v in received.items()}
    return dict(received)


@dataclass
class LearnerSpec:
    """Everything learner ``learner`` needs; identical across its attempts."""

    learner: int
    next_batch: BatchFn
    model_factory: Callable[[], nnx.Module]
    tx: optax.GradientTransformation
    fragments: list[list[str]]
    period: int
    tokens_per_step: int
    mix_alpha: float = 0.0
    keep_in_flight: bool = False
    microbatches: int = 1
    turns: FairTurns | None = None
    fail_at_steps: tuple[int, ...] = ()  # ascending; the k-th fires on attempt k (chaos testing)
    log_every: int = 10


def _set_opt_counts(optimizer: nnx.Optimizer, step: int) -> None:
    """Set every optax ``count`` leaf (schedule and bias correction) and the Optimizer step to ``step``."""
    state = nnx.state(optimizer, nnx.OptState)

    def fix(path, leaf):
        last = path[-1]
        name = str(getattr(last, "key", getattr(last, "name", last)))
        return jnp.full_like(leaf, step) if name == "count" else leaf

    nnx.update(optimizer, jax.tree_util.tree_map_with_path(fix, state))
    optimizer.step[...] = jnp.asarray(step, dtype=optimizer.step[...].dtype)


def run_learner(
    spec: LearnerSpec,
    exchange: Exchange,
    stop: threading.Event,
    attempt: int,
    log: Callable[[dict], None],
    t0: float,
) -> dict:
    """Run inner steps until the token budget is spent or ``stop`` is set.

    Never waits on the syncer or on peers: received fragments are applied at step boundaries when
    present. Raises :class:`InjectedFailure` at a configured step on the first attempt, after
    recording the reason in the exchange and the log. Returns a summary dict (steps, tokens, bytes).
    """
    m, P = spec.learner, len(spec.fragments)
    try:
        model = spec.model_factory()
        versions = [-1] * P
        info = exchange.learners().get(m, {})
        bytes_in, bytes_out = int(info.get("bytes_from_syncer", 0)), int(info.get("bytes_to_syncer", 0))

        # ref[p]: what the local fragment's unsent progress is measured against (the last received
        # Θ_p, or the copy last sent); u_tokens/u_steps: that progress, in tokens and inner steps.
        ref: list[dict[str, np.ndarray] | None] = [None] * P
        c_tokens, c_steps = [0] * P, [0] * P
        u_tokens, u_steps = [0] * P, [0] * P

        def pull(p: int, version: int, params: dict[str, np.ndarray]) -> None:
            nonlocal bytes_in
            if versions[p] >= 0 and (spec.keep_in_flight or spec.mix_alpha > 0):
                local = get_params(model)
                local = {k: np.asarray(local[k]) for k in params}
                new = on_receipt(params, local, ref[p], spec.keep_in_flight, spec.mix_alpha)
            else:
                new = params  # first pull of this attempt, or overwrite
            set_params(model, new)
            if versions[p] >= 0 and spec.keep_in_flight:
                c_tokens[p], c_steps[p] = u_tokens[p], u_steps[p]  # the kept steps count again
            else:
                c_tokens[p], c_steps[p] = 0, 0
                u_tokens[p], u_steps[p] = 0, 0
            ref[p] = params
            versions[p] = version
            bytes_in += sum(a.nbytes for a in params.values())

        for p in range(P):
            pull(p, *exchange.latest(p))
        step, processed = int(info.get("step", 0)), int(info.get("processed", 0))
        epoch, index = info.get("cursor", (0, 0))
        optimizer = nnx.Optimizer(model, spec.tx, wrt=nnx.Param)
        if step:
            _set_opt_counts(optimizer, step)
        steps_this_attempt = 0
        exchange.heartbeat(m, status="running", attempt=attempt, step=step, processed=processed, cursor=(epoch, index))
        log({"event": "start", "learner": m, "attempt": attempt, "step": step, "t": time.monotonic() - t0})

        def send(p: int) -> None:
            nonlocal bytes_out
            names = spec.fragments[p]
            current = get_params(model)
            sub = Submission(
                learner=m, fragment=p, params=to_numpy({k: current[k] for k in names}),
                tokens=c_tokens[p], steps=c_steps[p], base_version=versions[p], local_step=step, attempt=attempt,
            )
            bytes_out += sub.nbytes
            ref[p], u_tokens[p], u_steps[p] = sub.params, 0, 0
            exchange.submit(sub)

        while not stop.is_set():
            latest = exchange.versions()
            for p in range(P):
                if latest[p] > versions[p]:
                    pull(p, *exchange.latest(p))
            if attempt <= len(spec.fail_at_steps) and step + 1 == spec.fail_at_steps[attempt - 1]:
                raise InjectedFailure(f"learner {m}: injected failure at local step {step + 1}")
            if not exchange.claim_tokens(spec.tokens_per_step):
                break
            batch, epoch, index = spec.next_batch(epoch, index)
            with spec.turns or contextlib.nullcontext():
                loss = float(train_step(model, optimizer, jnp.asarray(batch), spec.microbatches))
            step += 1
            steps_this_attempt += 1
            processed += spec.tokens_per_step
            for p in range(P):
                c_tokens[p] += spec.tokens_per_step
                c_steps[p] += 1
                u_tokens[p] += spec.tokens_per_step
                u_steps[p] += 1
            for p in fragments_due(step, P, spec.period):
                send(p)
            exchange.heartbeat(m, step=step, processed=processed, cursor=(epoch, index), loss=loss,
                               bytes_to_syncer=bytes_out, bytes_from_syncer=bytes_in)
            if step % spec.log_every == 0:
                log({"event": "step", "learner": m, "step": step, "train/loss": loss,
                     "tokens": processed, "t": time.monotonic() - t0})
        # Last step always syncs: hand in every fragment that has unsent progress.
        # (u_steps, not c_steps: a fragment sent and not yet merged back holds no new progress, and
        # sending it again would have the syncer merge the same parameters twice.)
        for p in range(P):
            if u_steps[p] > 0:
                send(p)
        exchange.heartbeat(m, status="done", bytes_to_syncer=bytes_out, bytes_from_syncer=bytes_in)
        log({"event": "stop", "learner": m, "attempt": attempt, "step": step, "t": time.monotonic() - t0})
        return {"learner": m, "attempt": attempt, "steps": step, "steps_this_attempt": steps_this_attempt,
                "tokens": processed, "bytes_to_syncer": bytes_out, "bytes_from_syncer": bytes_in}
    except BaseException as exc:
        exchange.heartbeat(m, status="down", reason=repr(exc))
        log({"event": "failure", "learner": m, "attempt": attempt, "reason": repr(exc),
             "step": exchange.learners().get(m, {}).get("step", 0), "t": time.monotonic() - t0})
        raise


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
    learners_done: threading.Event,
    on_merge: Callable[[dict], None],
    on_eval: Callable[[dict[str, np.ndarray], int], None],
    eval_every_tokens: int,
    heartbeat_timeout_s: float,
    t0: float,
    poll_s: float = 0.002,
) -> SyncerLoopResult:
    """Drain submissions, merge ready fragments, publish, and evaluate Θ every ``eval_every_tokens``.

    Ends once ``learners_done`` is set and the inbox is empty, after a final flush of everything
    still pending (quorum or not) and a final evaluation at the tokens actually spent.
    """
    next_eval = eval_every_tokens

    def handle(records: list[dict]) -> None:
        # poll/flush return adopted merges only: a refused merge (non-finite result) publishes and
        # logs nothing here, learners keep the last sound Θ_p, and its "merge-refused" event goes
        # out with the syncer's events at the end.
        for rec in records:
            p = rec["fragment"]
            exchange.publish(p, syncer.versions[p], syncer.global_params[p])
            on_merge(rec)

    while True:
        finished = learners_done.is_set()
        now = time.monotonic() - t0  # the syncer's clock: seconds since training start
        for sub in exchange.drain():
            syncer.receive(sub, now)
        handle(syncer.poll(now, live_learners(exchange, heartbeat_timeout_s)))
        claimed = exchange.claimed_tokens
        # (once the budget is spent, the final evaluation after the flush measures the end point)
        if claimed >= next_eval and not finished and claimed < exchange.token_budget:
            on_eval(syncer.params(), claimed)
            while next_eval <= claimed:
                next_eval += eval_every_tokens
        if finished:
            now = time.monotonic() - t0
            for sub in exchange.drain():
                syncer.receive(sub, now)
            handle(syncer.flush(now))
            on_eval(syncer.params(), exchange.claimed_tokens)
            break
        time.sleep(poll_s)
    return SyncerLoopResult(merges=syncer.num_merges, wall_s=time.monotonic() - t0, events=list(syncer.events))
