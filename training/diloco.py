"""A Decoupled DiLoCo run, set up from plain inputs: the syncer side and each learner's attempt.

``setup_diloco(cfg, run_dir)`` builds the global parameters, fragments, syncer and exchange (version
0 published) and registers the exchange under the run directory. ``learner_attempt(cfg, run_dir,
m, attempt)`` takes only plain, serialisable inputs and rebuilds everything a learner needs from
them: the model spec and compiled step (shared by the learners of one process), its shard and data
cursor, its resume point and the exchange handle. ``run_syncer_to_end(run)`` drives the syncer,
evaluates Θ on the cadence and saves the checkpoint and summary. No Prefect here.

Both methods see the same data (the DP job reads the union of the learner shards), the same token
budget (``cfg.dp_steps × tokens per DP step``) and the same validation batches.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.schema import ExperimentConfig, validate_against_model
from data.cursor import batch_at
from data.prepare import load_rows
from diloco.exchange import InMemoryExchange, open_exchange, register_exchange
from diloco.fragments import balanced_fragments
from diloco.learner import LearnerSetup, run_learner
from diloco.pacing import FairTurns
from diloco.receipt import receipt_rule
from diloco.syncer import Syncer, SyncerSettings
from diloco.syncer_loop import run_syncer
from diloco.tensors import embedding_names, tensor_bytes, to_numpy
from run.control import STOP
from run.layout import RunLayout
from run.metrics import JsonlWriter, read_jsonl
from training.checkpoint import OrbaxResumeStore, save_checkpoint
from training.common import ensure_fresh, model_spec, token_budget
from training.evaluation import eval_record, heldout_metrics, val_batches
from training.functional import nest
from training.optimizers import make_inner_tx
from training.step import Trainer

STAGE, METHOD = "pretrain", "diloco"


def _key(run_dir: str | Path) -> str:
    return str(Path(run_dir).absolute())


_TRAINERS: dict[tuple[str, str], Trainer] = {}
_TURNS: dict[str, FairTurns | None] = {}
_LOCK = threading.Lock()


def learner_trainer(cfg: ExperimentConfig, run_dir: str | Path) -> Trainer:
    """One compiled learner step per run and process, shared by its learners (no recompiles)."""
    key = (repr(cfg), _key(run_dir))
    with _LOCK:
        if key not in _TRAINERS:
            tx = make_inner_tx(cfg.diloco.inner, cfg.learner_steps)
            _TRAINERS[key] = Trainer(model_spec(cfg, run_dir), tx, cfg.learner_microbatches, seed=cfg.seed)
        return _TRAINERS[key]


def _turns(run_dir: str | Path, slots: int) -> FairTurns | None:
    """The first-come turns shared by the learners of one run in this process (None: unpaced)."""
    with _LOCK:
        return _TURNS.setdefault(_key(run_dir), FairTurns(slots) if slots else None)


def run_fragments(cfg: ExperimentConfig, trainer: Trainer) -> list[list[str]]:
    """The run's P fragments: derived from the parameter sizes alone, so the syncer and every learner
    attempt, in any process, get the same partition without exchanging it."""
    return balanced_fragments(tensor_bytes(trainer.param_shapes), cfg.diloco.fragments)


@dataclass
class DiLoCoRun:
    """The syncer side of one run (lives in the process that set it up)."""

    cfg: ExperimentConfig
    run_dir: Path
    exchange: InMemoryExchange
    syncer: Syncer
    trainer: Trainer
    merges_log: JsonlWriter
    learners_log: JsonlWriter
    eval_log: JsonlWriter
    val: list[np.ndarray]
    budget: int
    last_val_loss: float | None = None
    merges: int = 0

    def close_logs(self) -> None:
        for log in (self.merges_log, self.learners_log, self.eval_log):
            log.close()


def setup_diloco(cfg: ExperimentConfig, run_dir: str | Path) -> DiLoCoRun:
    """Build Θ₀, fragments, syncer and exchange (version 0 of every fragment published), and
    register the exchange for the learners of this process.

    Raises ``FileExistsError`` if ``run_dir`` already holds DiLoCo results, ``ValueError`` if P
    exceeds the model's tensors.
    """
    run_dir = Path(run_dir)
    ensure_fresh(run_dir, STAGE, METHOD)
    trainer = learner_trainer(cfg, run_dir)
    theta0 = to_numpy(trainer.init_params())
    validate_against_model(cfg, len(theta0))
    d = cfg.diloco
    fragments = run_fragments(cfg, trainer)
    settings = SyncerSettings(
        num_learners=d.learners, quorum=d.quorum, grace_s=d.grace_s, merge=d.merge, outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum, outer_nesterov=d.outer_nesterov, max_staleness=d.max_staleness,
    )
    syncer = Syncer(theta0, fragments, settings, embedding_names(theta0))
    budget = token_budget(cfg)
    exchange = InMemoryExchange(len(fragments), budget)
    for p in range(len(fragments)):
        exchange.publish(p, 0, syncer.global_params[p])
    register_exchange(_key(run_dir), exchange)
    layout = RunLayout(run_dir)
    return DiLoCoRun(
        cfg=cfg, run_dir=run_dir, exchange=exchange, syncer=syncer, trainer=trainer,
        merges_log=JsonlWriter(layout.metrics(STAGE, METHOD, "merges")),
        learners_log=JsonlWriter(layout.metrics(STAGE, METHOD, "learners")),
        eval_log=JsonlWriter(layout.metrics(STAGE, METHOD, "eval")),
        val=val_batches(load_rows(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size),
        budget=budget,
    )


def learner_setup(cfg: ExperimentConfig, run_dir: str | Path, learner: int, attempt: int,
                  log, exchange=None) -> LearnerSetup:
    """Learner ``learner``'s setup for ``attempt``, from plain inputs (and the process's exchange
    registered for ``run_dir`` unless ``exchange`` is given)."""
    d = cfg.diloco
    trainer = learner_trainer(cfg, run_dir)
    exchange = exchange if exchange is not None else open_exchange(_key(run_dir))
    seqs = load_rows(run_dir, f"shard_{learner:02d}")
    fails = tuple(sorted(f.at_step for f in cfg.chaos.failures if f.learner == learner))
    return LearnerSetup(
        learner=learner, attempt=attempt, step=trainer.step, init_params=trainer.init_params,
        init_opt=trainer.init_opt,
        next_batch=partial(batch_at, seqs, batch_size=d.batch_size, seed=cfg.seed + 1000 * (learner + 1)),
        fragments=run_fragments(cfg, trainer), period=d.sync_every,
        tokens_per_step=cfg.tokens_per_learner_step, receipt=receipt_rule(d.receipt, d.mix_alpha),
        exchange=exchange, log=log, stop=STOP.is_set,
        resume=OrbaxResumeStore(RunLayout(run_dir).resume_point(STAGE, METHOD, learner)),
        resume_every=d.resume_every_steps, turns=_turns(run_dir, d.compute_slots),
        fail_at_steps=fails,
    )


def learner_attempt(cfg: ExperimentConfig, run_dir: str | Path, learner: int, attempt: int,
                    exchange=None) -> dict:
    """Run one attempt of learner ``learner`` (``diloco.learner.run_learner``) from plain inputs.

    ``exchange``: default, the one registered for ``run_dir`` in this process by
    :func:`setup_diloco`. Raises whatever the attempt raised (``InjectedFailure`` for a scheduled
    failure); the task runner retries it, and the retry resumes from the saved resume point.
    """
    log = JsonlWriter(RunLayout(run_dir).metrics(STAGE, METHOD, "learners"))
    try:
        return run_learner(learner_setup(cfg, run_dir, learner, attempt, log, exchange))
    finally:
        log.close()


def initial_exchange(cfg: ExperimentConfig, run_dir: str | Path) -> InMemoryExchange:
    """An exchange holding version 0 of every global fragment (Θ₀) and the run's token budget,
    with no syncer behind it: for a learner run on its own (a check of one learner, a test)."""
    trainer = learner_trainer(cfg, run_dir)
    theta0 = to_numpy(trainer.init_params())
    fragments = run_fragments(cfg, trainer)
    exchange = InMemoryExchange(len(fragments), token_budget(cfg))
    for p, names in enumerate(fragments):
        exchange.publish(p, 0, {k: theta0[k] for k in names})
    return exchange


def run_syncer_to_end(run: DiLoCoRun, learners_done) -> dict:
    """The syncer: merge loop, held-out evaluation of Θ on the cadence, final checkpoint; returns the
    summary. Ends once ``learners_done`` (a ``threading.Event``) is set and everything is flushed."""

    def on_merge(rec: dict) -> None:
        run.merges += 1
        run.merges_log(rec)

    def on_eval(params: dict[str, np.ndarray], tokens: int) -> None:
        t0 = time.perf_counter()
        fields = eval_record(heldout_metrics(run.trainer.evaluate, {k: jnp.asarray(v) for k, v in params.items()},
                                             run.val))
        run.last_val_loss = fields["val/loss"]
        run.eval_log({"method": METHOD, "tokens": tokens, "wall_s": run.exchange.clock(),
                      "merges": run.merges, **fields, "eval_s": time.perf_counter() - t0})

    on_eval(run.syncer.params(), 0)
    result = run_syncer(run.syncer, run.exchange, learners_done, on_merge, on_eval,
                        run.cfg.train.eval_every_tokens, run.cfg.diloco.heartbeat_timeout_s)
    for ev in result.events:
        run.learners_log({**ev, "source": "syncer"})
    return save_diloco(run, result.wall_s)


def save_diloco(run: DiLoCoRun, wall_s: float) -> dict:
    """Checkpoint Θ and the outer state (step = tokens claimed); return the summary dict."""
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
    tokens = run.exchange.claimed_tokens
    meta = {"method": METHOD, "versions": s.versions, "merges": s.num_merges, "tokens": tokens,
            "fragments": s.fragments, "ledger": ledger}
    theta = s.params()
    layout = RunLayout(run.run_dir)
    save_checkpoint(layout.checkpoints(STAGE, METHOD), tokens, nest(theta), meta, extra={"outer_state": outer})
    merges_bytes_in = sum(r.get("bytes_in", 0) for r in read_jsonl(run.merges_log.path))
    d = cfg.diloco
    spec = run.trainer.spec
    text = cfg.unit == "tokens"
    rows = "seqs" if text else "images"
    return {
        "method": METHOD,
        "interrupted": STOP.is_set(),
        "work_lost": work_lost(ledger, d.warn_dropped_fraction, d.max_dropped_fraction),
        "hyperparameters": {
            "learners (M)": d.learners, "fragments (P)": d.fragments, "sync every (H)": d.sync_every,
            "quorum (K)": d.quorum, "grace window (s)": d.grace_s, "merge": d.merge, "outer lr": d.outer_lr,
            "outer momentum": d.outer_momentum,
            "nesterov": (d.outer_nesterov if d.outer_momentum else "n/a (no momentum)"),
            f"batch ({rows}/learner step)": d.batch_size, **({"seq len": cfg.data.seq_len} if text else {}),
            "inner optimizer": d.inner.name, "inner lr": d.inner.lr, "warmup steps": d.inner.warmup_steps,
            "weight decay": d.inner.weight_decay, "grad clip": d.inner.grad_clip,
            f"{cfg.unit}/learner step": cfg.tokens_per_learner_step,
            "on receipt": (f"mix α={d.mix_alpha}" if d.receipt == "mix" else d.receipt.replace("_", " ")),
            "compute slots": d.compute_slots or "unpaced",
            f"microbatch ({rows})": cfg.train.microbatch_size or "whole batch",
            "resume point every (steps)": d.resume_every_steps or "never",
        },
        "tokens": tokens,
        "steps": int(sum(int(v.get("step", 0)) for v in learners.values())),
        "wall_s": wall_s,
        "tokens_per_s": tokens / max(wall_s, 1e-9),
        "final_val_loss": run.last_val_loss,
        "merges": s.num_merges,
        # learner→syncer submission payload bytes (every submission: merged, dropped or pending) and
        # syncer→learner pulled bytes, counted by the learners, summed over learners and attempts;
        # bytes_merged = the merge log's bytes_in total (submission bytes that went into merges).
        "bytes_to_syncer": int(sum(int(v.get("bytes_to_syncer", 0)) for v in learners.values())),
        "bytes_merged": int(merges_bytes_in),
        "bytes_from_syncer": int(sum(int(v.get("bytes_from_syncer", 0)) for v in learners.values())),
        "ledger": ledger,
        "params": spec.params,
        "active_params": int(spec.extras.get("active_params", spec.params)),  # per token (MoE: k of E experts)
        "flops_per_token": spec.flops_per_unit,
        "fragment_bytes": [int(sum(tensor_bytes(g).values())) for g in s.global_params],
    }


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
