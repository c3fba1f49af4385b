"""Pretraining tasks: Decoupled DiLoCo (a syncer task + M retryable learner tasks) and the DP baseline.

The plain functions here build state and run loops from ``diloco.runtime``; the Prefect tasks at the
bottom are thin wrappers. Both methods see the same data (the DP job reads the union of the learner
shards), the same token budget (``cfg.dp_steps × tokens per DP step``), and are measured on the
same validation batches every ``train.eval_every_tokens`` tokens.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from configs.schema import ExperimentConfig, validate_against_model
from diloco.exchange import InMemoryExchange
from diloco.fragments import balanced_fragments
from diloco.params import embedding_names, get_params, set_params, tensor_bytes, to_numpy
from diloco.runtime import FairTurns, LearnerSpec, run_learner, run_syncer
from diloco.syncer import Syncer, SyncerSettings
from models import build_model, count_params, flops_per_token
from models.checkpoint import save_checkpoint
from models.training import heldout_loss, make_inner_tx, train_step, val_batches
from run.control import STOP
from tasks.data import batch_at, load_manifest, load_sequences
from tasks.metrics import JsonlWriter, write_json


class AnyStop:
    """Set when any of ``events`` is: a run's own stop (the syncer ended) or the process-wide
    stop signal (``run.control.STOP``). Has the ``is_set``/``set`` of a ``threading.Event``;
    ``set`` sets the first (the run's own)."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)

    def set(self) -> None:
        self.events[0].set()


def token_budget(cfg: ExperimentConfig) -> int:
    """Tokens each method trains on: ``train.token_budget`` rounded up to whole DP steps."""
    return cfg.dp_steps * cfg.tokens_per_dp_step


def _model_factory(cfg: ExperimentConfig, vocab_size: int):
    def factory() -> nnx.Module:
        return build_model(cfg.model, vocab_size, cfg.data.seq_len, nnx.Rngs(cfg.seed))

    return factory


@dataclass
class DiLoCoRun:
    """Shared state of one Decoupled DiLoCo run (lives in one process; passed to thread tasks)."""

    cfg: ExperimentConfig
    run_dir: Path
    exchange: InMemoryExchange
    syncer: Syncer
    specs: list[LearnerSpec]
    stop: AnyStop
    learners_done: threading.Event
    merges_log: JsonlWriter
    learners_log: JsonlWriter
    eval_log: JsonlWriter
    eval_model: nnx.Module
    val: list[np.ndarray]
    budget: int
    t0: float = field(default_factory=time.monotonic)
    last_val_loss: float | None = None
    merges: int = 0


def ensure_fresh(run_dir: Path, method: str) -> None:
    """Refuse to train ``method`` again into a run directory that already holds its results.

    Raises ``FileExistsError`` naming what exists and the fix; nothing is written or deleted.
    """
    existing = [p for p in (run_dir / "checkpoints" / method, run_dir / "pretrain" / method,
                            run_dir / "metrics" / f"{method}_eval.jsonl") if p.exists()]
    if existing:
        raise FileExistsError(
            f"{run_dir} already holds {method} results ({', '.join(str(p.relative_to(run_dir)) for p in existing)}); "
            "pass a new run directory, or delete those paths to train this method again"
        )


def setup_diloco(cfg: ExperimentConfig, run_dir: Path) -> DiLoCoRun:
    """Build the global model, fragments, syncer, exchange (version 0 published) and learner specs.

    Raises ``FileExistsError`` if ``run_dir`` already holds DiLoCo results.
    """
    ensure_fresh(run_dir, "diloco")
    manifest = load_manifest(run_dir)
    vocab = int(manifest["vocab_size"])
    factory = _model_factory(cfg, vocab)
    model = factory()
    theta0 = to_numpy(get_params(model))
    validate_against_model(cfg, len(theta0))
    d = cfg.diloco
    fragments = balanced_fragments(tensor_bytes(theta0), d.fragments)
    settings = SyncerSettings(
        num_learners=d.learners, quorum=d.quorum, grace_s=d.grace_s, merge=d.merge, outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum, outer_nesterov=d.outer_nesterov, max_staleness=d.max_staleness,
    )
    syncer = Syncer(theta0, fragments, settings, embedding_names(theta0))
    budget = token_budget(cfg)
    exchange = InMemoryExchange(len(fragments), budget)
    for p in range(len(fragments)):
        exchange.publish(p, 0, syncer.global_params[p])
    tx = make_inner_tx(d.inner, cfg.learner_steps)  # one object shared by all learners: no recompiles
    specs = []
    turns = FairTurns(d.compute_slots) if d.compute_slots else None
    for m in range(d.learners):
        seqs = load_sequences(run_dir, f"shard_{m:02d}")
        fails = tuple(sorted(f.at_step for f in cfg.chaos.failures if f.learner == m))
        specs.append(LearnerSpec(
            learner=m,
            next_batch=partial(batch_at, seqs, batch_size=d.batch_size, seed=cfg.seed + 1000 * (m + 1)),
            model_factory=factory, tx=tx, fragments=fragments, period=d.sync_every,
            tokens_per_step=cfg.tokens_per_learner_step, mix_alpha=d.mix_alpha, keep_in_flight=d.keep_in_flight,
            microbatches=cfg.learner_microbatches, turns=turns, fail_at_steps=fails,
        ))
    mdir = run_dir / "metrics"
    return DiLoCoRun(
        cfg=cfg, run_dir=run_dir, exchange=exchange, syncer=syncer, specs=specs,
        stop=AnyStop(threading.Event(), STOP), learners_done=threading.Event(),
        merges_log=JsonlWriter(mdir / "diloco_merges.jsonl"),
        learners_log=JsonlWriter(mdir / "diloco_learners.jsonl"),
        eval_log=JsonlWriter(mdir / "diloco_eval.jsonl"),
        eval_model=factory(), val=val_batches(load_sequences(run_dir, "val"), cfg.train.eval_batches,
                                               cfg.train.eval_batch_size),
        budget=budget,
    )


def diloco_learner(run: DiLoCoRun, m: int, attempt: int) -> dict:
    """Plain learner body (see ``diloco.runtime.run_learner``)."""
    return run_learner(run.specs[m], run.exchange, run.stop, attempt, run.learners_log, run.t0)


def diloco_syncer(run: DiLoCoRun) -> dict:
    """Plain syncer body: merge loop, held-out evaluation of Θ, final checkpoint and summary."""

    def on_merge(rec: dict) -> None:
        run.merges += 1
        run.merges_log(rec)

    def on_eval(params: dict[str, np.ndarray], tokens: int) -> None:
        set_params(run.eval_model, params)
        loss = heldout_loss(run.eval_model, run.val)
        run.last_val_loss = loss
        run.eval_log({"method": "diloco", "tokens": tokens, "wall_s": time.monotonic() - run.t0,
                      "merges": run.merges, "val/loss": loss})

    on_eval(run.syncer.params(), 0)
    result = run_syncer(run.syncer, run.exchange, run.learners_done, on_merge, on_eval,
                        run.cfg.train.eval_every_tokens, run.cfg.diloco.heartbeat_timeout_s, run.t0)
    for ev in result.events:
        run.learners_log({**ev, "source": "syncer"})
    set_params(run.eval_model, run.syncer.params())
    return save_diloco(run, result.wall_s)


def save_diloco(run: DiLoCoRun, wall_s: float) -> dict:
    cfg, s = run.cfg, run.syncer
    P = s.num_fragments
    outer = {f"fragment_{p}": {f"{i:04d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(st))}
             for p, st in enumerate(s.opt_states)}
    learners = run.exchange.learners()
    pending = s.pending_tokens()
    ledger = {}
    for m, entry in s.ledger.items():
        processed = int(learners.get(m, {}).get("processed", 0))
        # The syncer counts per fragment; averaging over the P fragments gives model-level tokens.
        ledger[str(m)] = {
            "processed": processed,
            "submitted": round(entry.submitted / P),
            "not_submitted": processed - round(entry.submitted / P),
            "merged": round(entry.merged / P), "dropped": round(entry.dropped / P),
            "pending": round(pending[m] / P),
            "drop_reasons": {k: round(v / P) for k, v in entry.drop_reasons.items()},
            "attempts": int(learners.get(m, {}).get("attempt", 1)),
        }
    meta = {"method": "diloco", "versions": s.versions, "merges": s.num_merges, "tokens": run.exchange.claimed_tokens,
            "fragments": s.fragments, "ledger": ledger}
    save_checkpoint(run.run_dir / "checkpoints" / "diloco", run.exchange.claimed_tokens,
                    nnx.to_pure_dict(nnx.state(run.eval_model, nnx.Param)), meta, extra={"outer_state": outer})
    merges_bytes_in = sum(r.get("bytes_in", 0) for r in _read(run.merges_log.path))
    d = cfg.diloco
    summary = {
        "method": "diloco",
        "interrupted": STOP.is_set(),
        "work_lost": work_lost(ledger, d.warn_dropped_fraction, d.max_dropped_fraction),
        "hyperparameters": {
            "learners (M)": d.learners, "fragments (P)": d.fragments, "sync every (H)": d.sync_every,
            "quorum (K)": d.quorum, "grace window (s)": d.grace_s, "merge": d.merge, "outer lr": d.outer_lr,
            "outer momentum": d.outer_momentum,
            "nesterov": (d.outer_nesterov if d.outer_momentum else "n/a (no momentum)"),
            "batch (seqs/learner step)": d.batch_size, "seq len": cfg.data.seq_len,
            "inner optimizer": d.inner.name, "inner lr": d.inner.lr, "warmup steps": d.inner.warmup_steps,
            "weight decay": d.inner.weight_decay, "grad clip": d.inner.grad_clip,
            "tokens/learner step": cfg.tokens_per_learner_step,
            "on receipt": ("keep in-flight steps" if d.keep_in_flight
                           else f"mix α={d.mix_alpha}" if d.mix_alpha else "overwrite"),
            "compute slots": d.compute_slots or "unpaced",
            "microbatch (seqs)": cfg.train.microbatch_size or "whole batch",
        },
        "tokens": run.exchange.claimed_tokens,
        "steps": int(sum(int(v.get("step", 0)) for v in learners.values())),
        "wall_s": wall_s,
        "tokens_per_s": run.exchange.claimed_tokens / max(wall_s, 1e-9),
        "final_val_loss": run.last_val_loss,
        "merges": s.num_merges,
        # learner→syncer submission payload bytes (every submission: merged, dropped or pending) and
        # syncer→learner pulled bytes, counted by the learners, summed over learners and attempts;
        # bytes_merged = the merge log's bytes_in total (submission bytes that went into merges).
        "bytes_to_syncer": int(sum(int(v.get("bytes_to_syncer", 0)) for v in learners.values())),
        "bytes_merged": int(merges_bytes_in),
        "bytes_from_syncer": int(sum(int(v.get("bytes_from_syncer", 0)) for v in learners.values())),
        "ledger": ledger,
        "params": count_params(run.eval_model),
        "flops_per_token": flops_per_token(cfg.model, run.eval_model.vocab_size, cfg.data.seq_len),
        "fragment_bytes": [int(sum(tensor_bytes(g).values())) for g in s.global_params],
    }
    return summary


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
    return {"processed_tokens": processed, "dropped_tokens": dropped, "dropped_fraction": frac,
            "reasons": reasons, "warn_above": warn_above, "fail_above": fail_above, "status": status}


def _read(path: Path) -> list[dict]:
    from tasks.metrics import read_jsonl

    return read_jsonl(path)


def train_dp(cfg: ExperimentConfig, run_dir: Path, progress=None) -> dict:
    """The data-parallel baseline as one synchronous job: global batch M × learner batch.

    Same model init, data (all training sequences), token budget and validation batches as DiLoCo.
    Writes ``metrics/dp_eval.jsonl``, ``checkpoints/dp`` and returns the summary dict.
    """
    ensure_fresh(run_dir, "dp")
    manifest = load_manifest(run_dir)
    vocab = int(manifest["vocab_size"])
    model = _model_factory(cfg, vocab)()
    validate_against_model(cfg, len(get_params(model)))
    steps = cfg.dp_steps
    tx = make_inner_tx(cfg.dp.inner, steps)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    seqs = load_sequences(run_dir, "train")
    val = val_batches(load_sequences(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size)
    eval_log = JsonlWriter(run_dir / "metrics" / "dp_eval.jsonl")
    step_log = JsonlWriter(run_dir / "metrics" / "dp_steps.jsonl")
    tps = cfg.tokens_per_dp_step
    epoch = index = 0
    t0 = time.monotonic()
    last = heldout_loss(model, val)
    eval_log({"method": "dp", "tokens": 0, "wall_s": 0.0, "step": 0, "val/loss": last})
    next_eval = cfg.train.eval_every_tokens
    done = 0
    for step in range(1, steps + 1):
        if STOP.is_set():  # SIGTERM/SIGINT: stop at this step boundary, evaluate and save below
            break
        batch, epoch, index = batch_at(seqs, epoch, index, cfg.dp_batch_size, cfg.seed)
        loss = train_step(model, optimizer, jnp.asarray(batch), cfg.dp_microbatches)
        tokens = step * tps
        done = step
        if step % 10 == 0 or step == steps:
            step_log({"step": step, "tokens": tokens, "train/loss": float(loss), "t": time.monotonic() - t0})
        if tokens >= next_eval or step == steps:
            last = heldout_loss(model, val)
            eval_log({"method": "dp", "tokens": tokens, "wall_s": time.monotonic() - t0, "step": step, "val/loss": last})
            while next_eval <= tokens:
                next_eval += cfg.train.eval_every_tokens
            if progress:
                progress(tokens, steps * tps, float(loss), last)
    if done < steps:  # stopped early: measure where it stopped
        last = heldout_loss(model, val)
        eval_log({"method": "dp", "tokens": done * tps, "wall_s": time.monotonic() - t0, "step": done,
                  "val/loss": last})
    steps = done
    wall = time.monotonic() - t0
    param_bytes = sum(tensor_bytes(get_params(model)).values())
    M = cfg.diloco.learners
    # Ring all-reduce: each of M workers sends (and receives) 2(M−1)/M of the gradient bytes per step.
    allreduce_bytes = int(2 * (M - 1) / M * param_bytes * M * steps)  # sent by all workers, in total
    meta = {"method": "dp", "steps": steps, "tokens": steps * tps}
    save_checkpoint(run_dir / "checkpoints" / "dp", steps * tps, nnx.to_pure_dict(nnx.state(model, nnx.Param)), meta)
    i = cfg.dp.inner
    return {
        "method": "dp",
        "interrupted": STOP.is_set(),
        "hyperparameters": {
            "global batch (seqs)": cfg.dp_batch_size, "seq len": cfg.data.seq_len, "inner optimizer": i.name,
            "lr": i.lr, "warmup steps": i.warmup_steps, "weight decay": i.weight_decay, "grad clip": i.grad_clip,
            "tokens/step": tps, "simulated workers": M,
            "microbatch (seqs)": cfg.train.microbatch_size or "whole batch",
        },
        "tokens": steps * tps, "steps": steps, "wall_s": wall, "tokens_per_s": steps * tps / wall,
        "final_val_loss": last, "merges": None,
        # No syncer: the ring all-reduce bytes, all workers, split evenly. ``allreduce_bytes`` counts
        # both directions (sent + received); bytes_to_syncer (sent) and bytes_from_syncer (received)
        # are each half of it (the local ``allreduce_bytes`` above is the sent half).
        "bytes_to_syncer": allreduce_bytes, "bytes_from_syncer": allreduce_bytes,
        "allreduce_bytes": 2 * allreduce_bytes,
        "params": count_params(model), "flops_per_token": flops_per_token(cfg.model, vocab, cfg.data.seq_len),
    }


# -- Prefect tasks -------------------------------------------------------------------------------
@task(name="learner", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3, log_prints=False)
def learner_task(run: DiLoCoRun, m: int) -> dict:
    """Learner m as a retryable task: a retry pulls the current global fragments and resumes at its
    data position (``diloco.runtime`` resume order)."""
    from prefect.runtime import task_run

    attempt = int(task_run.run_count or 1)
    logger = get_run_logger()
    if attempt > 1:
        logger.warning("learner %d: attempt %d, rejoining from the syncer's global fragments", m, attempt)
    out = diloco_learner(run, m, attempt)
    logger.info("learner %d done: %d steps, %d tokens", m, out["steps"], out["tokens"])
    return out


@task(name="syncer", cache_policy=NO_CACHE)
def syncer_task(run: DiLoCoRun) -> dict:
    """The syncer: runs until every learner task has ended, then saves Θ and the outer state."""
    return diloco_syncer(run)


@task(name="dp-trainer", cache_policy=NO_CACHE)
def dp_task(cfg: ExperimentConfig, run_dir: Path) -> dict:
    logger = get_run_logger()

    def progress(tokens, total, loss, val):
        logger.info("dp: tokens %s/%s (%.0f%%)  train loss %.3f  held-out loss %.3f",
                    f"{tokens:,}", f"{total:,}", 100 * tokens / total, loss, val)

    summary = train_dp(cfg, run_dir, progress)
    write_json(run_dir / "pretrain" / "dp" / "summary.json", summary)
    return summary
