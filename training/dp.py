"""The data-parallel baseline as one synchronous job (the step of ``training.step``, no syncer).

Same model initialisation, data (every training sequence), token budget and validation batches as
Decoupled DiLoCo; the global batch is ``dp.batch_size`` sequences, notionally split over
``dp.workers`` replicas that all-reduce their gradients every step (the report's byte count).
With more than one device in the process the step really is data-parallel over all of them
(``training.mesh``: a mesh over ``jax.devices()``, the batch split by rows, the gradient averaged
by XLA); with one, it runs there as a plain jitted step. No Prefect here.

Under a chaos schedule (``chaos.schedule`` or ``chaos.replay``, ``chaos.against_dp``) the job meets
the same hardware events as DiLoCo's learners, on its own training clock (seconds since it started,
its first evaluation and compile included, the clock of its train log): a failure of any replica
stalls the whole job for the failure's restart delay from the step boundary it meets it at (a
replica failing meanwhile extends the stall to its own return; it costs no second rollback), after which
it restores its last checkpoint (Orbax, every ``dp.checkpoint_every_steps``; none yet: step 0) and
recomputes the steps since (lock-step SPMD has no other way back); while any replica is slowed,
every step is (the all-reduce waits for the slowest replica). Events go to
``pretrain/dp/metrics/events.jsonl``. The rolled-back steps see the same batches again, so the
final model and its per-token curve equal the run without failures; only time is lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from configs.schema import ExperimentConfig, validate_against_model
from data.cursor import batch_at
from data.prepare import load_rows
from diloco.tensors import tensor_bytes, to_numpy
from run.clock import TrainingClock, WallClock
from run.control import STOP
from run.layout import RunLayout
from run.metrics import JsonlWriter
from training.checkpoint import latest_step, load_extra, load_meta, save_checkpoint
from training.common import budget_status, ensure_fresh, model_spec, save_chaos_schedule
from training.evaluation import EvalCadence, eval_record, final_heldout, heldout_metrics, val_batches
from training.functional import flatten, nest
from training.mesh import backend_line
from training.optimizers import lr_schedule, make_inner_tx
from training.step import Trainer
from training.tracking import method_tracker

STAGE, METHOD = "pretrain", "dp"


def dp_devices(cfg: ExperimentConfig, devices: Sequence[jax.Device] | None = None) -> list[jax.Device] | None:
    """The devices the DP step runs on: all of ``devices`` (default ``jax.devices()``) when there is
    more than one, else None (the default device, a plain jitted step).

    Raises ``ValueError`` naming ``dp.batch_size`` (or ``train.microbatch_size``) and the device
    count when the count does not divide the global batch (or each microbatch): every device takes
    an equal share of the rows of every step and every microbatch.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n == 1:
        return None
    if cfg.dp_batch_size % n:
        raise ValueError(
            f"dp.batch_size ({cfg.dp_batch_size}) must be divisible by the {n} devices the DP baseline "
            f"trains on (every device takes an equal share of the rows); pick a multiple of {n}"
        )
    mb = cfg.train.microbatch_size
    if mb is not None and mb % n:
        raise ValueError(
            f"train.microbatch_size ({mb}) must be divisible by the {n} devices the DP baseline trains on "
            f"(each microbatch of dp.batch_size is split over them); pick a multiple of {n} or unset it"
        )
    return devices


def train_dp(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    progress: Callable[[int, int, float, float], None] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
    clock: TrainingClock | None = None,
) -> dict:
    """Train the DP baseline for ``cfg.dp_steps`` steps; returns the summary dict.

    Writes ``pretrain/dp/metrics/{eval,train}.jsonl`` and ``pretrain/dp/checkpoints`` (step = tokens).
    ``progress(tokens, total_tokens, train_loss, heldout_loss)`` is called at each evaluation;
    ``on_step(step, metrics)`` after every step (metrics as device scalars). ``clock`` is the
    training clock the chaos schedule and the train log's ``t`` are read on (seconds; default: wall
    seconds since the call, :class:`run.clock.WallClock`; tests pass a
    :class:`run.clock.SimulatedClock`). Stops at the next step
    boundary when ``run.control.STOP`` is set, then evaluates and saves where it stopped. Raises
    ``FileExistsError`` if ``run_dir`` already holds DP results, and ``ValueError`` (before any
    work) if the process has several devices and they do not divide the global batch or each
    microbatch (:func:`dp_devices`).
    """
    run_dir = Path(run_dir)
    devices = dp_devices(cfg)
    ensure_fresh(run_dir, STAGE, METHOD)
    layout = RunLayout(run_dir)
    spec = model_spec(cfg, run_dir)
    steps = cfg.dp_steps
    trainer = Trainer(
        spec,
        make_inner_tx(cfg.dp.inner, steps),
        cfg.dp_microbatches,
        seed=cfg.seed,
        devices=devices,
        precision=cfg.precision,
    )
    params = trainer.init_params()
    validate_against_model(cfg, len(params))
    opt_state = trainer.init_opt(params)
    sched = save_chaos_schedule(cfg, run_dir) if cfg.chaos.against_dp else None
    failures = sorted(sched.failures, key=lambda f: f.at_s) if sched is not None else []
    ckpt_every = cfg.dp_checkpoint_every
    resume_dir = layout.job_resume(STAGE, METHOD)
    seqs = load_rows(run_dir, "train")
    val = val_batches(load_rows(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size)
    tracker = method_tracker(
        cfg, run_dir, STAGE, METHOD, flops_per_token=spec.flops_per_unit, devices=len(devices) if devices else 1
    )
    lr = lr_schedule(cfg.dp.inner, steps)
    eval_log = JsonlWriter(layout.metrics(STAGE, METHOD, "eval"), sink=tracker.sink("eval"))
    step_log = JsonlWriter(layout.metrics(STAGE, METHOD, "train"), sink=tracker.sink("train"))
    events = JsonlWriter(layout.metrics(STAGE, METHOD, "events")) if sched is not None or ckpt_every else None
    tps = cfg.tokens_per_dp_step
    epoch = index = 0
    t0 = time.monotonic()

    def measure() -> tuple[float, dict]:
        """(held-out loss, the eval-log fields: val/loss, the model's val/ metrics, eval_s)"""
        t = time.monotonic()
        fields = eval_record(heldout_metrics(trainer.evaluate, params, val))
        return fields["val/loss"], {**fields, "eval_s": time.monotonic() - t}

    last, fields = measure()
    eval_log({"method": METHOD, "tokens": 0, "wall_s": 0.0, "step": 0, **fields})
    cadence = EvalCadence(cfg.train.eval_every_tokens)
    done = high = 0  # steps the model holds now; the most it ever held (a rollback recomputes up to it)
    clock = WallClock(t0) if clock is None else clock  # the chaos schedule's clock: the train log's t
    slowed, lost_steps, stall_s, met = 1.0, 0, 0.0, 0  # met: failures the job met
    try:
        while done < steps:
            if STOP.is_set():  # SIGTERM/SIGINT: stop at this step boundary, evaluate and save below
                break
            if failures and failures[0].at_s <= clock():
                f = failures.pop(0)
                met += 1
                t_fail = clock()
                events(
                    {
                        "event": "failure",
                        "replica": f.learner,
                        "step": done,
                        "t": t_fail,
                        "at_s": f.at_s,
                        "restart_delay_s": f.restart_delay_s,
                        "reason": f"chaos: replica {f.learner} failed",
                    }
                )
                back_at = t_fail + f.restart_delay_s  # down for the restart delay from the failure
                while clock() < back_at and not STOP.is_set():  # the whole job is down
                    clock.sleep(min(0.05, back_at - clock()))
                    while failures and failures[0].at_s <= clock():  # another replica failed meanwhile:
                        g = failures.pop(0)  # the job restarts once both are back
                        met += 1
                        events(
                            {
                                "event": "failure",
                                "replica": g.learner,
                                "step": done,
                                "t": clock(),
                                "at_s": g.at_s,
                                "restart_delay_s": g.restart_delay_s,
                                "reason": f"chaos: replica {g.learner} failed while the job was down",
                                "while_down": True,
                            }
                        )
                        back_at = max(back_at, clock() + g.restart_delay_s)
                t_restore = clock()
                params, opt_state, (epoch, index), back = _restore(trainer, resume_dir, params, opt_state)
                lost_steps += done - back
                now = clock()
                events(
                    {
                        "event": "restore",
                        "step": back,
                        "lost_steps": done - back,
                        "t": now,
                        "restore_s": now - t_restore,
                        "down_s": now - t_fail,
                    }
                )
                stall_s += now - t_fail
                done = back
                continue
            step = done + 1
            batch, epoch, index = batch_at(seqs, epoch, index, cfg.dp_batch_size, cfg.seed)
            computing = clock()
            params, opt_state, metrics = trainer.step(params, opt_state, jax.tree.map(jnp.asarray, batch))
            if sched is not None:
                jax.block_until_ready(metrics["loss"])
                now = clock()
                factor = sched.dp_factor(now)
                if factor != slowed:
                    events({"event": "slowdown", "factor": factor, "step": step, "t": now})
                    slowed = factor
                if factor > 1.0 and step > 1:  # every replica waits for the slowest at the all-reduce
                    # (step 1 includes compiling)
                    clock.sleep((factor - 1.0) * (now - computing))
            if on_step is not None:
                on_step(step, metrics)
            tokens = step * tps
            done = step
            if ckpt_every and step % ckpt_every == 0 and step > high:
                t_save = time.perf_counter()
                save_checkpoint(
                    resume_dir,
                    step,
                    None,
                    {"step": step, "cursor": [int(epoch), int(index)]},
                    extra={"params": nest(params), "opt_state": opt_state},
                )
                events({"event": "checkpoint", "step": step, "t": clock(), "save_s": time.perf_counter() - t_save})
            recomputed = step <= high
            high = max(high, step)
            if recomputed:
                continue  # logged and measured the first time round
            if step % 10 == 0 or step == steps:
                step_log(
                    {
                        "step": step,
                        "tokens": tokens,
                        "train/loss": float(metrics["loss"]),
                        **{f"train/{k}": float(v) for k, v in metrics.items() if k != "loss"},
                        "train/lr": float(lr(step - 1)),  # the rate of this step's update
                        "t": clock(),
                    }
                )
            if cadence.due(tokens) or step == steps:
                last, fields = measure()
                eval_log({"method": METHOD, "tokens": tokens, "wall_s": time.monotonic() - t0, "step": step, **fields})
                if progress:
                    progress(tokens, steps * tps, float(metrics["loss"]), last)
        if done < steps:  # stopped early: measure where it stopped
            last, fields = measure()
            eval_log({"method": METHOD, "tokens": done * tps, "wall_s": time.monotonic() - t0, "step": done, **fields})
    finally:
        eval_log.close()
        step_log.close()
        if events is not None:
            events.close()
        tracker.close()
    wall = time.monotonic() - t0
    # whole val and test splits, after the clock stopped: what selection reads and the headline figure
    heldout = final_heldout(trainer.evaluate, params, run_dir, cfg.train.eval_batch_size)
    param_bytes = sum(tensor_bytes(params).values())
    W = cfg.dp.workers
    # Ring all-reduce: each of W workers sends (and receives) 2(W−1)/W of the gradient bytes per step.
    allreduce_bytes = int(2 * (W - 1) / W * param_bytes * W * done)  # sent by all workers, in total
    meta = {"method": METHOD, "steps": done, "tokens": done * tps}
    # float32 whatever the policy (training.precision): evaluation and fine-tuning read one layout
    save_checkpoint(layout.checkpoints(STAGE, METHOD), done * tps, nest(to_numpy(params)), meta)
    i = cfg.dp.inner
    text = cfg.unit == "tokens"
    rows = "seqs" if text else "images"
    return {
        "method": METHOD,
        "interrupted": STOP.is_set(),
        # trained vs budget (``training.common.budget_status``): the pipeline fails a short stage
        "budget": budget_status(
            done * tps,
            steps * tps,
            cfg.unit,
            interrupted=STOP.is_set(),
            finished=done >= steps,
            why=f"the job stopped at step {done:,} of {steps:,}",
        ),
        "hyperparameters": {
            "backend": backend_line(),
            "precision": cfg.precision.describe(),
            f"global batch ({rows})": cfg.dp_batch_size,
            **({"seq len": cfg.data.seq_len} if text else {}),
            "inner optimizer": i.name,
            "lr": i.lr,
            "warmup steps": i.warmup_steps,
            "weight decay": i.weight_decay,
            "grad clip": i.grad_clip,
            f"{cfg.unit}/step": tps,
            "simulated workers": W,
            "devices": len(devices) if devices else 1,
            f"microbatch ({rows})": cfg.train.microbatch_size or "whole batch",
        },
        "tokens": done * tps,
        "steps": done,
        "wall_s": wall,
        "tokens_per_s": done * tps / wall,
        # chaos: steps recomputed after rollbacks, seconds stalled (failure → restored), failures met
        "chaos": None
        if sched is None
        else {"failures": met, "lost_steps": lost_steps, "stall_s": stall_s, "checkpoint_every_steps": ckpt_every},
        "final_val_loss": last,
        "heldout": heldout,
        "merges": None,
        # No syncer: the ring all-reduce bytes, all workers, split evenly. ``allreduce_bytes`` counts
        # both directions (sent + received); bytes_to_syncer (sent) and bytes_from_syncer (received)
        # are each half of it.
        "bytes_to_syncer": allreduce_bytes,
        "bytes_from_syncer": allreduce_bytes,
        "allreduce_bytes": 2 * allreduce_bytes,
        "params": spec.params,
        "active_params": int(spec.extras.get("active_params", spec.params)),
        "flops_per_token": spec.flops_per_unit,
    }


def _restore(trainer: Trainer, resume_dir: Path, params, opt_state):
    """The job's last checkpoint in ``resume_dir`` (params, optimizer state, cursor, step), or, with
    none written yet, a fresh start: the initial parameters and optimizer state at step 0."""
    try:
        step = latest_step(resume_dir)
    except Exception:  # noqa: BLE001 - nothing saved yet (or only a cut-off save): start again
        fresh = trainer.init_params()
        return fresh, trainer.init_opt(fresh), (0, 0), 0
    meta = load_meta(resume_dir, step)
    restored = {k: jnp.asarray(v) for k, v in flatten(load_extra(resume_dir, "params", nest(params), step)).items()}
    opt = load_extra(resume_dir, "opt_state", opt_state, step)
    epoch, index = meta["cursor"]
    return restored, opt, (int(epoch), int(index)), int(meta["step"])
