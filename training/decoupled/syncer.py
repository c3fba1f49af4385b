"""The syncer side of a Decoupled DiLoCo run, in the syncer task's process: :class:`DiLoCoRun`
(opened by ``training.decoupled.setup.open_syncer``), :func:`run_syncer_to_end` (the merge loop,
held-out evaluation of Θ on the cadence) and the stage's summary it returns with the final
checkpoint (:func:`save_diloco`; the flow adds ``budget`` and writes it). No Prefect here."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.methods import DiLoCoConfig
from diloco.exchange import InMemoryExchange
from diloco.exchange.fsspec import FsspecExchange, StaleSyncerError
from diloco.faults import SyncerFaults
from diloco.grace import GraceWindow
from diloco.syncer import Syncer, SyncerSettings
from diloco.syncer_journal import JournalMismatchError, SyncerJournal
from diloco.syncer_loop import SyncerHooks, run_syncer
from diloco.tensors import tensor_bytes
from run.control import STOP
from run.layout import RunLayout
from run.metrics import JsonlWriter, read_jsonl
from run.tracking import NO_TRACKING, Tracker
from training.checkpoint import save_checkpoint
from training.decoupled import METHOD, STAGE
from training.decoupled.plan import DiLoCoPlan
from training.evaluation import eval_record, final_heldout, heldout_metrics
from training.functional import nest
from training.mesh import backend_line
from training.step import Trainer

log = logging.getLogger(__name__)


@dataclass
class DiLoCoRun:
    """The syncer side of one run (lives in the syncer task's process)."""

    plan: DiLoCoPlan
    run_dir: Path
    exchange: InMemoryExchange | FsspecExchange
    syncer: Syncer
    trainer: Trainer
    merges_log: JsonlWriter
    learners_log: JsonlWriter
    eval_log: JsonlWriter
    val: list[np.ndarray]
    generation: int = 1
    last_val_loss: float | None = None
    merges: int = 0
    attempt: int = 1
    journal: SyncerJournal | None = None  # fsspec exchange: journal + checkpoints (a syncer that survives)
    resumed: bool = False  # an earlier syncer of this run took office before this one
    logged_merges: set[tuple[int, int]] = field(default_factory=set)  # (fragment, version) in merges.jsonl
    tracker: Tracker = NO_TRACKING  # TensorBoard / W&B of the syncer's merges and evaluations (run.tracking)

    def log_event(self, event: str, **fields) -> None:
        """A syncer event in the learners log: ``role`` syncer, its ``attempt``, ``fields``, the merges so
        far and ``t`` (the run clock)."""
        head = {"event": event, "role": "syncer", "attempt": self.attempt}
        self.learners_log({**head, **fields, "merges": self.syncer.num_merges, "t": self.exchange.clock()})

    def close_logs(self) -> None:
        for log in (self.merges_log, self.learners_log, self.eval_log):
            log.close()
        self.tracker.close()


def grace_window(d: DiLoCoConfig) -> GraceWindow:
    """The syncer loop's grace window from ``diloco.grace*`` (τ defaults to H)."""
    return GraceWindow(
        mode=d.grace,
        fixed_s=d.grace_s,
        gamma=d.grace_gamma,
        overlap_steps=d.grace_overlap_steps or d.overlap_steps or d.sync_every,
        cap_s=d.grace_cap_s,
    )


def syncer_settings(d: DiLoCoConfig) -> SyncerSettings:
    """The syncer's settings from the ``diloco`` section ``d``."""
    return SyncerSettings(
        num_learners=d.learners,
        quorum=d.quorum,
        grace_s=d.grace_s,
        merge=d.merge,
        outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum,
        outer_nesterov=d.outer_nesterov,
        max_staleness=d.max_staleness,
        wire=d.wire.spec,
    )


def syncer_retryable(exc: BaseException) -> bool:
    """Whether a failed syncer attempt is worth a retry: not when another syncer took office
    (``StaleSyncerError``: a retry would fight it) or the journal does not replay
    (``JournalMismatchError``: a retry would replay it the same way)."""
    return not isinstance(exc, (StaleSyncerError, JournalMismatchError))


def run_syncer_to_end(run: DiLoCoRun, on_evaluated: Callable[[], None] | None = None) -> dict:
    """The syncer: merge loop, held-out evaluation of Θ on the cadence, final checkpoint; returns the
    summary. Ends once the flow has marked the learners done (``exchange.mark_learners_done``) and
    everything is flushed.

    A resumed syncer (fsspec exchange, an earlier attempt took office) skips the evaluation at 0
    tokens, logs a merge replayed from the journal only if ``merges.jsonl`` lacks it, and writes a
    ``syncer-resumed`` event (generation, checkpoint step and seq, entries replayed, merges
    republished, ``recover_s`` seconds, ``t``) to the learners log; a failing attempt writes a
    ``syncer-failure`` event (``attempt``, ``generation``, ``reason``, ``merges``, ``t``) before it re-raises.
    ``on_evaluated()`` is called after each evaluation is logged (the flow's live chart); its errors
    are logged as warnings, never the syncer's.
    """

    def on_merge(rec: dict) -> None:
        key = (int(rec["fragment"]), int(rec["version"]))
        if key in run.logged_merges:
            return  # replayed from the journal, logged by the attempt that made it
        run.logged_merges.add(key)
        run.merges += 1
        run.merges_log({**rec, "merge": run.merges})  # its ordinal in the run, resumed syncers included

    def on_eval(params: dict[str, np.ndarray], tokens: int) -> None:
        t0 = time.perf_counter()
        fields = eval_record(
            heldout_metrics(run.trainer.evaluate, {k: jnp.asarray(v) for k, v in params.items()}, run.val)
        )
        run.last_val_loss = fields["val/loss"]
        point = {"method": METHOD, "tokens": tokens, "wall_s": run.exchange.clock(), "merges": run.merges}
        run.eval_log({**point, **fields, "eval_s": time.perf_counter() - t0})
        if on_evaluated is not None:
            try:
                on_evaluated()
            except Exception as exc:  # noqa: BLE001 - a chart never stops the syncer
                log.warning("syncer: after the evaluation at %d tokens: %s: %s", tokens, type(exc).__name__, exc)

    def on_recover(info: dict) -> None:
        if run.resumed:
            run.log_event("syncer-resumed", pid=os.getpid(), **info)

    def on_event(ev: dict) -> None:
        run.learners_log({"source": "exchange", **ev})

    if not run.resumed:
        on_eval(run.syncer.params(), 0)
    plan = run.plan
    poll_s = 0.002 if plan.runtime.exchange_kind == "memory" else plan.runtime.exchange_poll_s
    grace = grace_window(plan.diloco)
    try:
        result = run_syncer(
            run.syncer,
            run.exchange,
            SyncerHooks(on_merge=on_merge, on_eval=on_eval, on_event=on_event, on_recover=on_recover),
            eval_every_tokens=plan.train.eval_every_tokens,
            heartbeat_timeout_s=plan.diloco.heartbeat_timeout_s,
            poll_s=poll_s,
            journal=run.journal,
            grace=grace,
            faults=syncer_faults(run),
        )
    except BaseException as exc:
        run.log_event("syncer-failure", generation=run.generation, reason=f"{type(exc).__name__}: {exc}")
        raise
    for ev in result.events:
        run.learners_log({**ev, "source": "syncer"})
    return save_diloco(run, result.wall_s, grace)


def syncer_faults(run: DiLoCoRun) -> SyncerFaults:
    """This syncer attempt's injected failure: the ``run.attempt``-th ``syncer_fail`` of ``chaos.events``
    (in merge order; a drawn schedule has none), with a journal only (the fsspec exchange); ``how:
    sigkill`` logs a ``syncer-kill`` event and SIGKILLs the process instead of raising. None due: no faults."""
    failures = sorted((e for e in run.plan.fault_events if e.kind == "syncer_fail"), key=lambda f: f.at_merge)
    if run.journal is None or run.attempt > len(failures):
        return SyncerFaults()
    f = failures[run.attempt - 1]
    if f.how != "sigkill":
        return SyncerFaults(fail_at=(f.at_merge, f.when))

    def on_fail(reason: str) -> None:
        run.log_event("syncer-kill", generation=run.generation, reason=f"chaos: SIGKILL ({reason})", pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)

    return SyncerFaults(fail_at=(f.at_merge, f.when), on_fail=on_fail)


def save_diloco(run: DiLoCoRun, wall_s: float, grace: GraceWindow) -> dict:
    """Checkpoint Θ and the outer state (step = tokens claimed); return the summary dict
    (docs/contracts.md, *Summaries*; the flow adds ``budget`` and writes it). ``grace``: the syncer
    loop's window, as the hyperparameters name it."""
    plan, s, tokens = run.plan, run.syncer, run.exchange.claimed_tokens
    learners = run.exchange.learners()
    ledger = _ledger(s, learners)
    meta = {
        "method": METHOD,
        "versions": s.versions,
        "merges": s.num_merges,
        "tokens": tokens,
        "fragments": s.fragments,
        "ledger": ledger,
    }
    theta = s.params()
    # whole val and test splits (the curve's fixed sample is for the cadence): selection reads val,
    # the headline figure is test
    heldout = final_heldout(
        run.trainer.evaluate, {k: jnp.asarray(v) for k, v in theta.items()}, run.run_dir, plan.train.eval_batch_size
    )
    checkpoints = RunLayout(run.run_dir).checkpoints(STAGE, METHOD)
    save_checkpoint(checkpoints, tokens, nest(theta), meta, extra={"outer_state": _outer_state(s)})
    d, spec = plan.diloco, run.trainer.spec
    return {
        "method": METHOD,
        "interrupted": STOP.is_set() or run.exchange.stop_requested(),
        "work_lost": work_lost(ledger, d.warn_dropped_fraction, d.max_dropped_fraction),
        "hyperparameters": _hyperparameters(plan, grace),
        "tokens": tokens,
        "steps": int(sum(int(v.get("step", 0)) for v in learners.values())),
        "wall_s": wall_s,
        "tokens_per_s": tokens / max(wall_s, 1e-9),
        "final_val_loss": run.last_val_loss,
        "heldout": heldout,
        "merges": s.num_merges,
        # learner→syncer submission payload bytes (every submission: merged, dropped or pending) and
        # syncer→learner pulled bytes, counted by the learners, summed over learners and attempts;
        # bytes_merged = the merge log's bytes_in total (submission bytes that went into merges).
        "bytes_to_syncer": int(sum(int(v.get("bytes_to_syncer", 0)) for v in learners.values())),
        "bytes_merged": int(sum(r.get("bytes_in", 0) for r in read_jsonl(run.merges_log.path))),
        "bytes_from_syncer": int(sum(int(v.get("bytes_from_syncer", 0)) for v in learners.values())),
        # seconds in exchange storage calls, encoding and checksums (0 in process memory): the
        # syncer's, and the learners' summed over their processes (threads of one process share one)
        "exchange_s": float(getattr(run.exchange, "io_s", 0.0)),
        "learner_exchange_s": _per_process_total(learners.values(), "exchange_s"),
        # run clock (seconds since set-up) of the first learner step: engine start, imports, compiles
        "startup_s": min((e["t"] for e in read_jsonl(run.learners_log.path) if e.get("event") == "start"), default=0.0),
        "ledger": ledger,
        "params": spec.params,
        "active_params": int(spec.extras.get("active_params", spec.params)),  # per token (MoE: k of E experts)
        "flops_per_token": spec.flops_per_unit,
        "fragment_bytes": [int(sum(tensor_bytes(g).values())) for g in s.global_params],
    }


def _outer_state(s: Syncer) -> dict[str, dict[str, np.ndarray]]:
    """The checkpoint's ``outer_state``: per fragment (``fragment_<p>``), its outer optimizer state's
    leaves in order (``0000``, ``0001``, …)."""
    return {
        f"fragment_{p}": {f"{i:04d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(st))}
        for p, st in enumerate(s.opt_states)
    }


def _ledger(s: Syncer, learners: dict[int, dict]) -> dict[str, dict]:
    """The token ledger, learner → counts in tokens: ``processed`` and ``attempts`` from its last
    heartbeat (``learners``), the rest from the syncer, which counts per fragment: averaged over the
    P fragments, model-level tokens."""
    P, pending, ledger = s.num_fragments, s.pending_tokens(), {}
    for m, entry in s.ledger.items():
        processed = int(learners.get(m, {}).get("processed", 0))
        ledger[str(m)] = {
            "processed": processed,
            "submitted": round(entry.submitted / P),
            "not_submitted": processed - round(entry.submitted / P),
            "merged": round(entry.merged / P),
            "recomputed": round(entry.recomputed / P),
            "dropped": round(entry.dropped / P),
            "pending": round(pending[m] / P),
            "drop_reasons": {k: round(v / P) for k, v in entry.drop_reasons.items()},
            "attempts": int(learners.get(m, {}).get("attempt", 1)),
        }
    return ledger


def _hyperparameters(plan: DiLoCoPlan, grace: GraceWindow) -> dict:
    """The summary's ``hyperparameters``: the run's DiLoCo settings, named as the report shows them."""
    d, text = plan.diloco, plan.unit == "tokens"
    rows = "seqs" if text else "images"
    cap = "one step" if grace.cap_s is None else f"{grace.cap_s:g} s"
    adaptive = f"adaptive (γ {grace.gamma:g}, τ {grace.overlap_steps} steps, cap {cap})"
    return {
        "backend": backend_line(),
        "precision": plan.precision.describe(),
        "learners (M)": d.learners,
        "fragments (P)": d.fragments,
        "sync every (H)": d.sync_every,
        "quorum (K)": d.quorum,
        "grace window (s)": d.grace_s,
        "grace": d.grace if d.grace == "fixed" else adaptive,
        "merge": d.merge,
        "outer lr": d.outer_lr,
        "outer momentum": d.outer_momentum,
        "nesterov": (d.outer_nesterov if d.outer_momentum else "n/a (no momentum)"),
        f"batch ({rows}/learner step)": d.batch_size,
        **({"seq len": plan.data.seq_len} if text else {}),
        "inner optimizer": d.inner.name,
        "inner lr": d.inner.lr,
        "warmup steps": d.inner.warmup_steps,
        "weight decay": d.inner.weight_decay,
        "grad clip": d.inner.grad_clip,
        f"{plan.unit}/learner step": plan.tokens_per_learner_step,
        "on receipt": (f"mix α={d.mix_alpha}" if d.receipt == "mix" else d.receipt.replace("_", " ")),
        "compute slots": d.compute_slots or "unpaced",
        "devices per learner": plan.runtime.devices_per_learner,
        f"microbatch ({rows})": plan.train.microbatch_size or "whole batch",
        "resume point every (steps)": d.resume_every_steps or "never",
        "wire format (learner→syncer)": d.wire.spec,
        "overlap τ (steps; a learner waits past it)": d.overlap_steps or "never waits",
    }


def _per_process_total(beats, key: str) -> float:
    """Sum of a process-wide counter over processes: heartbeats of one ``pid`` report the same
    counter at different times, so the largest of each process is taken."""
    most: dict = {}
    for b in beats:
        most[b.get("pid")] = max(most.get(b.get("pid"), 0.0), float(b.get(key, 0.0)))
    return float(sum(most.values()))


def work_lost(ledger: dict[str, dict], warn_above: float, fail_above: float) -> dict:
    """How much of the learners' work the syncer dropped, and whether that is acceptable.

    ``ledger``: learner → token counts (``save_diloco``). Returns ``processed_tokens``,
    ``dropped_tokens``, ``dropped_fraction`` (dropped / processed; 0 when nothing was processed),
    ``reasons`` (reason → tokens), the two thresholds (``diloco.warn_dropped_fraction``,
    ``diloco.max_dropped_fraction``) and ``status``: ``ok``, ``warning`` (above ``warn_above``) or
    ``failed`` (above ``fail_above``: the pipeline exits non-zero after writing the report).
    """
    processed = sum(int(v["processed"]) for v in ledger.values())
    dropped = sum(int(v["dropped"]) for v in ledger.values())
    reasons: dict[str, int] = {}
    for v in ledger.values():
        for k, n in v.get("drop_reasons", {}).items():
            reasons[k] = reasons.get(k, 0) + int(n)
    frac = dropped / processed if processed else 0.0
    status = "failed" if frac > fail_above else "warning" if frac > warn_above else "ok"
    return {
        "processed_tokens": processed,
        "dropped_tokens": dropped,
        "dropped_fraction": frac,
        "reasons": reasons,
        "warn_above": warn_above,
        "fail_above": fail_above,
        "status": status,
    }
