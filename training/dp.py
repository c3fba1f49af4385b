"""The data-parallel baseline: one synchronous (SPMD) job, the step of ``training.step`` (no syncer).

Same model initialisation, data (every training sequence, in the same order), token budget and
validation batches as Decoupled DiLoCo; the global batch is ``dp.batch_size`` sequences a step.

* ``dp.hosts`` 1: the job runs in this process. With one device, as a plain jitted step; with
  several, data-parallel over all of them (``training.mesh``: the batch split by rows, the gradient
  averaged by XLA). Its ``dp.workers`` replicas are counted (the report's ring all-reduce bytes), not run.
* ``dp.hosts`` N > 1: N JAX processes, one per host, joined by ``jax.distributed``
  (``training.dp_job`` starts them): the step is data-parallel over every process's devices, each
  host feeding its rows of every global batch, XLA all-reducing the gradients across processes
  (gloo on CPU, NCCL on GPU). Host 0 (the primary) writes the logs, checkpoints and summary; every
  host evaluates (a collective too).

The job (:func:`run_job`, an elastic launcher's loop) starts every host, and when one dies (a
SIGKILL, a lost node, a scheduled ``dp_fail`` or a chaos schedule's failure of a replica) the whole
SPMD job is down: it waits out the failure's restart delay, then starts every host again from the
last Orbax checkpoint (``dp.checkpoint_every_steps``), which recomputes the steps since on the same
batches: the final model equals the run without failures, and the time lost is measured (events
``failure``, ``restore`` and ``recovered`` in ``pretrain/dp/metrics/events.jsonl``). Scheduled faults
reach the hosts through ``diloco.faults.HostHooks``, as a learner's through its hooks. No Prefect here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.faults import DPFailEvent
from configs.schema import ExperimentConfig, validate_against_model
from data.cursor import batch_at
from data.prepare import load_rows
from diloco.faults import HostHooks, InjectedFailure, JobFault
from diloco.tensors import tensor_bytes, to_numpy
from run.clock import EpochClock, TrainingClock
from run.control import STOP
from run.layout import RunLayout
from run.metrics import JsonlWriter
from run.records import StateEvent
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
    """The devices the DP step runs on: all of ``devices`` (default ``jax.devices()``: with
    ``jax.distributed``, every process's) when there is more than one, else None (the default
    device, a plain jitted step).

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


def dp_faults(cfg: ExperimentConfig) -> tuple[tuple[JobFault, ...], dict[int, tuple]]:
    """The job's scheduled faults: every ``dp_fail`` event of ``chaos.events``, then (with
    ``chaos.against_dp``) the chaos schedule's failures, replica m's on host m mod ``dp.hosts``
    (SIGKILLed with several hosts, raised in one process); and each host's slowdowns (the schedule's
    of the replicas it holds). Returns ``(failures, {host: slowdowns})``."""
    hosts = cfg.dp.hosts
    how = "sigkill" if hosts > 1 else "raise"
    fails: list[JobFault] = []
    for e in cfg.chaos.events:
        if isinstance(e, DPFailEvent):
            fails.append(
                JobFault(len(fails), e.host, how if e.how == "auto" else e.how, e.at_step, e.at_s, e.restart_delay_s)
            )
    slow: dict[int, list] = {h: [] for h in range(hosts)}
    sched = cfg.chaos_schedule() if cfg.chaos.against_dp else None
    if sched is not None:
        for f in sched.failures:
            fails.append(
                JobFault(len(fails), f.learner % hosts, how, None, f.at_s, f.restart_delay_s, replica=f.learner)
            )
        for e in sched.slowdowns:
            slow[e.learner % hosts].append(e)
    return tuple(fails), {h: tuple(v) for h, v in slow.items()}


@dataclass(frozen=True)
class Generation:
    """One start of every host of the job: ``number`` (0 the first, n the n-th restart), ``origin``
    (epoch seconds of the job clock's zero), ``started_s`` (the job clock when it was started: timed
    faults before it are spent), ``spent`` (indices of the job's faults already fired), and for a
    restart ``failed_s`` (the job clock of the failure it recovers from) and ``high`` (the most steps
    any earlier start completed: steps up to it are recomputed)."""

    number: int = 0
    origin: float = field(default_factory=time.time)
    started_s: float = 0.0
    spent: tuple[int, ...] = ()
    failed_s: float | None = None
    high: int = 0


class DPHost:
    """One host's share of the DP job (all of it with one host): the model, optimizer state, data
    cursor, logs (host 0's) and the job's clock. :meth:`start` restores the newest checkpoint on a
    restart; :meth:`train_step`, :meth:`after_step` and :meth:`finish` are the loop's parts."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        run_dir: str | Path,
        clock: TrainingClock,
        rank: int = 0,
        progress: Callable[[int, int, float, float], None] | None = None,
        on_step: Callable[[int, dict], None] | None = None,
    ):
        self.cfg, self.run_dir, self.clock, self.rank = cfg, Path(run_dir), clock, rank
        self.primary, self.progress, self.on_step = rank == 0, progress, on_step
        self.layout = RunLayout(run_dir)
        self.devices = dp_devices(cfg)
        spec = self.spec = model_spec(cfg.model, cfg.data, cfg.runtime, run_dir)
        self.steps, self.tps = cfg.dp_steps, cfg.tokens_per_dp_step
        self.trainer = Trainer(
            spec,
            make_inner_tx(cfg.dp.inner, self.steps),
            cfg.dp_microbatches,
            seed=cfg.seed,
            devices=self.devices,
            precision=cfg.precision,
        )
        self.params = self.trainer.init_params()
        validate_against_model(cfg.diloco, len(self.params))
        self.opt_state = self.trainer.init_opt(self.params)
        self.seqs = load_rows(run_dir, "train")
        self.val = val_batches(load_rows(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size)
        self.lr = lr_schedule(cfg.dp.inner, self.steps)
        self.step, self.cursor, self.high, self.restored_t = 0, (0, 0), 0, None
        self.last = float("nan")
        self.cadence = EvalCadence(cfg.train.eval_every_tokens)
        devices = len(self.devices) if self.devices else 1
        self.tracker = method_tracker(cfg, run_dir, STAGE, METHOD, flops_per_token=spec.flops_per_unit, devices=devices)
        self.eval_log = self._writer("eval", self.tracker.sink("eval"))
        self.step_log = self._writer("train", self.tracker.sink("train"))
        self.events = self._writer("events")
        # a host's own events (a slowdown: its hooks) from every host; the job's (start, restore, …) from host 0
        self.host_events = self.events if self.primary else JsonlWriter(self.layout.metrics(STAGE, METHOD, "events"))

    def _writer(self, name: str, sink=None) -> Callable[[dict], None]:
        if not self.primary:
            return lambda record: None
        return JsonlWriter(self.layout.metrics(STAGE, METHOD, name), sink=sink)

    def measure(self) -> None:
        """The held-out loss on the fixed validation batches, logged at the tokens trained so far."""
        t = time.monotonic()
        fields = eval_record(heldout_metrics(self.trainer.evaluate, self.params, self.val))
        self.last = fields["val/loss"]
        record = {"method": METHOD, "tokens": self.step * self.tps, "wall_s": self.clock(), "step": self.step}
        self.eval_log({**record, **fields, "eval_s": time.monotonic() - t})

    def start(self, gen: Generation) -> None:
        """Begin ``gen``: a first start measures the initial model; a restart restores the newest
        checkpoint (or, with none yet, the initial state at step 0) and logs a ``restore`` event with
        the steps it lost and the seconds the job was down."""
        self.high, self.generation = gen.high, gen.number
        self.cadence.due(gen.high * self.tps)  # the measurements up to it were made before the failure
        if gen.number == 0:  # up: the job's clock since its launch, the hosts' start-up before it
            now = self.clock()
            self.events({"event": "start", "generation": 0, "t": now})
            self.events(StateEvent(state="up", t=now, generation=0).line())
            self.measure()
            return
        t = time.monotonic()
        self.params, self.opt_state, self.cursor, self.step = self._restore()
        self.restored_t = now = self.clock()
        self.events(
            {
                "event": "restore",
                "generation": gen.number,
                "step": self.step,
                "lost_steps": gen.high - self.step,
                "t": now,
                "restore_s": time.monotonic() - t,
                "down_s": now - gen.failed_s if gen.failed_s is not None else None,
            }
        )
        self.events(StateEvent(state="up", t=now, generation=gen.number).line())

    def _restore(self):
        resume_dir = self.layout.job_resume(STAGE, METHOD)
        try:
            step = latest_step(resume_dir)
        except Exception:  # noqa: BLE001 - nothing saved yet (or only a cut-off save): start again
            fresh = self.trainer.init_params()
            return fresh, self.trainer.init_opt(fresh), (0, 0), 0
        meta = load_meta(resume_dir, step)
        # host copies: the step places them on its devices (with several hosts, every process's: a
        # restored array committed to this process's device would be a cross-host transfer to JAX)
        like = nest(self.params)
        params = {k: np.asarray(v) for k, v in flatten(load_extra(resume_dir, "params", like, step)).items()}
        opt = jax.tree.map(
            np.asarray, load_extra(resume_dir, "opt_state", jax.tree.map(np.asarray, self.opt_state), step)
        )
        epoch, index = meta["cursor"]
        return params, opt, (int(epoch), int(index)), int(meta["step"])

    def train_step(self, timed: bool = False) -> float:
        """One step on the next global batch (this host's rows of it); returns its seconds, waited for
        when ``timed`` (else the step may still run: XLA dispatches asynchronously)."""
        t = time.perf_counter()
        batch, *self.cursor = batch_at(self.seqs, *self.cursor, self.cfg.dp_batch_size, self.cfg.seed)
        self.params, self.opt_state, self.metrics = self.trainer.step(
            self.params, self.opt_state, jax.tree.map(jnp.asarray, batch)
        )
        self.step += 1
        if self.on_step is not None:
            self.on_step(self.step, self.metrics)
        if timed:
            jax.block_until_ready(self.metrics["loss"])
        return time.perf_counter() - t

    def after_step(self) -> None:
        """Checkpoint, log and evaluate when due; steps a restart recomputes (up to the high-water
        mark) were logged and measured the first time round, and are not saved again."""
        step, cfg = self.step, self.cfg
        if step <= self.high:
            if step == self.high and self.restored_t is not None:  # back where the job was when it died
                now = self.clock()
                self.events({"event": "recovered", "step": step, "t": now, "recompute_s": now - self.restored_t})
            return
        every = cfg.dp_checkpoint_every
        if every and step % every == 0:
            self.checkpoint()
        if step % 10 == 0 or step == self.steps:
            m = self.metrics
            self.step_log(
                {
                    "step": step,
                    "tokens": step * self.tps,
                    "train/loss": float(m["loss"]),
                    **{f"train/{k}": float(v) for k, v in m.items() if k != "loss"},
                    "train/lr": float(self.lr(step - 1)),  # the rate of this step's update
                    "t": self.clock(),
                }
            )
        if self.cadence.due(step * self.tps) or step == self.steps:
            self.measure()
            if self.progress and self.primary:
                self.progress(step * self.tps, self.steps * self.tps, float(self.metrics["loss"]), self.last)

    def checkpoint(self) -> None:
        """Host 0 saves the job's state (parameters, optimizer state, cursor; Orbax) at this step."""
        if not self.primary:
            return
        t = time.perf_counter()
        host = jax.tree.map(np.asarray, {"params": nest(self.params), "opt_state": self.opt_state})
        meta = {"step": self.step, "cursor": [int(c) for c in self.cursor]}
        save_checkpoint(self.layout.job_resume(STAGE, METHOD), self.step, None, meta, extra=host)
        self.events({"event": "checkpoint", "step": self.step, "t": self.clock(), "save_s": time.perf_counter() - t})

    def finish(self, stopped: bool) -> dict | None:
        """After the loop: measure where a stop left it, then (every host) the whole held-out splits,
        and host 0 saves the final model and returns the summary; other hosts return None."""
        if self.step < self.steps:
            self.measure()
        wall = self.clock()
        self.events(StateEvent(state="done", t=wall, generation=self.generation).line())
        # whole val and test splits, after the clock stopped: what selection reads and the headline figure
        heldout = final_heldout(self.trainer.evaluate, self.params, self.run_dir, self.cfg.train.eval_batch_size)
        if not self.primary:
            return None
        done, tps, cfg = self.step, self.tps, self.cfg
        meta = {"method": METHOD, "steps": done, "tokens": done * tps}
        # float32 whatever the policy (training.precision): evaluation and fine-tuning read one layout
        save_checkpoint(self.layout.checkpoints(STAGE, METHOD), done * tps, nest(to_numpy(self.params)), meta)
        param_bytes = sum(tensor_bytes(self.params).values())
        W = cfg.dp.workers
        # Ring all-reduce: each of W workers sends (and receives) 2(W−1)/W of the gradient bytes per step.
        allreduce_bytes = int(2 * (W - 1) / W * param_bytes * W * done)  # sent by all workers, in total
        i, text = cfg.dp.inner, cfg.unit == "tokens"
        rows = "seqs" if text else "images"
        return {
            "method": METHOD,
            "interrupted": stopped,
            # trained vs budget (``training.common.budget_status``): the pipeline fails a short stage
            "budget": budget_status(
                done * tps,
                self.steps * tps,
                cfg.unit,
                interrupted=stopped,
                finished=done >= self.steps,
                why=f"the job stopped at step {done:,} of {self.steps:,}",
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
                **({"hosts": cfg.dp.hosts} if cfg.dp.hosts > 1 else {"simulated workers": W}),
                "devices": len(self.devices) if self.devices else 1,
                f"microbatch ({rows})": cfg.train.microbatch_size or "whole batch",
            },
            "tokens": done * tps,
            "steps": done,
            "wall_s": wall,
            "tokens_per_s": done * tps / wall,
            "final_val_loss": self.last,
            "heldout": heldout,
            "merges": None,
            # No syncer: the ring all-reduce bytes, all workers, split evenly. ``allreduce_bytes`` counts
            # both directions (sent + received); bytes_to_syncer (sent) and bytes_from_syncer (received)
            # are each half of it.
            "bytes_to_syncer": allreduce_bytes,
            "bytes_from_syncer": allreduce_bytes,
            "allreduce_bytes": 2 * allreduce_bytes,
            "params": self.spec.params,
            "active_params": int(self.spec.extras.get("active_params", self.spec.params)),
            "flops_per_token": self.spec.flops_per_unit,
        }

    def close(self) -> None:
        for w in {id(w): w for w in (self.eval_log, self.step_log, self.events, self.host_events)}.values():
            if isinstance(w, JsonlWriter):
                w.close()
        self.tracker.close()


def run_host(
    host: DPHost, gen: Generation, stop: Callable[[int], bool], note: Callable[[dict], None] = lambda r: None
) -> dict | None:
    """Run ``host`` through generation ``gen`` of the job until the budget is spent or ``stop(step)``
    (every host must stop at the same step); returns host 0's summary (None on other hosts). Its
    scheduled faults (:func:`dp_faults`) fire through ``diloco.faults.HostHooks``: ``note`` receives a
    failure's record, then the host raises ``InjectedFailure`` or SIGKILLs its process."""
    failures, slowdowns = dp_faults(host.cfg)
    hooks = HostHooks(
        host.rank,
        failures,
        slowdowns[host.rank],
        host.clock,
        host.clock.sleep,
        note,
        host.host_events,
        gen.spent,
        gen.started_s,
    )
    host.start(gen)
    while host.step < host.steps and not stop(host.step):
        hooks.before_step(host.step)  # raises, or SIGKILLs this process, at a scheduled failure
        hooks.after_step(host.step, host.train_step(timed=bool(hooks.slowdowns)))
        host.after_step()
    return host.finish(stopped=host.step < host.steps)


@dataclass
class Outcome:
    """How one generation ended: ``summary`` (host 0's, when the job finished or stopped) or the
    ``failure`` record of the host that died (host, step, t, restart delay, reason)."""

    summary: dict | None = None
    failure: dict | None = None


def run_job(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    launch: Callable[[Generation], Outcome],
    clock: TrainingClock,
    origin: float,
) -> dict:
    """The DP job as an elastic launcher runs it: ``launch(generation)`` starts every host and returns
    how they ended; after a failure the job stays down for its restart delay (a scheduled failure of
    another replica meanwhile extends it to that one's return), then starts a new generation from the
    last checkpoint: after every scheduled failure, and after at most ``dp.restarts`` unscheduled
    deaths (a crash, a kill by hand, a lost node). Logs ``failure`` events (the restore and recovery
    are logged by host 0 of the next generation); returns host 0's summary with ``chaos`` (failures,
    steps recomputed, seconds down) and ``restarts`` (one record per restart: measured ``down_s``,
    ``lost_steps``, ``recompute_s``). Raises ``RuntimeError`` when the restarts are used up."""
    failures, _ = dp_faults(cfg)
    events = JsonlWriter(RunLayout(run_dir).metrics(STAGE, METHOD, "events"))
    gen, unscheduled = Generation(origin=origin), 0
    try:
        while True:
            out = launch(gen)
            if out.failure is None:
                break
            f = out.failure
            spent = {*gen.spent, *([f["index"]] if f.get("index") is not None else [])}
            high = max(gen.high, int(f.get("step") or 0))
            events({"event": "failure", "generation": gen.number, **f, "step": high})
            host = None if f.get("host") is None else str(f["host"])
            events(StateEvent(state="down", t=f["t"], generation=gen.number, host=host, reason=f.get("reason")).line())
            unscheduled += f.get("index") is None
            if cfg.dp.restarts is not None and unscheduled > cfg.dp.restarts:
                raise RuntimeError(
                    f"DP host {f.get('host')} died ({f.get('reason')}) and the job has used its {cfg.dp.restarts} "
                    "restarts after unscheduled deaths (dp.restarts); see the host's log, or raise dp.restarts"
                )
            back = f["t"] + float(f.get("restart_delay_s") or 0.0)
            for g in failures:  # other replicas failing while the job is down: back once they are too
                if g.at_s is not None and g.index not in spent and g.at_s <= back:
                    spent.add(g.index)
                    while_down = {"replica": g.replica, "host": g.host, "index": g.index, "t": g.at_s}
                    events({"event": "failure", **while_down, "step": high, "while_down": True, "reason": "chaos"})
                    back = max(back, g.at_s + g.restart_delay_s)
            while clock() < back and not STOP.is_set():  # (a stop: the hosts restore, then stop at once)
                clock.sleep(min(0.05, back - clock()))
            gen = Generation(gen.number + 1, origin, clock(), tuple(sorted(spent)), f["t"], high)
            events(StateEvent(state="restarting", t=gen.started_s, generation=gen.number, reason="restart").line())
    finally:
        events.close()
    return {**out.summary, **job_record(run_dir, cfg)}


def job_record(run_dir: str | Path, cfg: ExperimentConfig) -> dict:
    """The job's failures and restarts from its events (measured): ``chaos`` (failures, lost_steps,
    stall_s: seconds from each failure to its restore, checkpoint_every_steps; None when the job met
    no scheduled fault and none died) and ``restarts`` (per restart: generation, failed_at_s,
    restored_step, lost_steps, down_s, recompute_s)."""
    from run.metrics import read_jsonl

    events = read_jsonl(RunLayout(run_dir).metrics(STAGE, METHOD, "events"))
    fails = [e for e in events if e.get("event") == "failure"]
    restores = [e for e in events if e.get("event") == "restore"]
    recovered = {e.get("step"): e for e in events if e.get("event") == "recovered"}
    scheduled = bool(dp_faults(cfg)[0]) or any(e.get("event") == "slowdown" for e in events)
    restarts = [
        {
            "generation": r.get("generation"),
            "failed_at_s": (r["t"] - r["down_s"]) if r.get("down_s") is not None else None,
            "restored_step": r["step"],
            "lost_steps": r["lost_steps"],
            "down_s": r.get("down_s"),
            "recompute_s": (recovered.get(r["step"] + r["lost_steps"]) or {}).get("recompute_s")
            if r["lost_steps"]
            else 0.0,
        }
        for r in restores
    ]
    chaos = (
        {
            "failures": len(fails),
            "lost_steps": sum(r["lost_steps"] for r in restores),
            "stall_s": sum(r.get("down_s") or 0.0 for r in restores),
            "checkpoint_every_steps": cfg.dp_checkpoint_every,
        }
        if fails or scheduled
        else None
    )
    return {"chaos": chaos, "restarts": restarts}


def train_dp(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    progress: Callable[[int, int, float, float], None] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
    clock: TrainingClock | None = None,
) -> dict:
    """Train the DP baseline in this process (``dp.hosts`` 1) for ``cfg.dp_steps`` steps; returns the summary.

    Writes ``pretrain/dp/metrics/{eval,train,events}.jsonl``, ``pretrain/dp/checkpoints`` (step =
    tokens) and, with checkpoints on, ``pretrain/dp/resume``. ``progress(tokens, total_tokens,
    train_loss, heldout_loss)`` is called at each evaluation; ``on_step(step, metrics)`` after every
    step (metrics as device scalars). ``clock``: the job's clock, which the chaos schedule, the train
    log's ``t`` and the eval log's ``wall_s`` are read on (seconds; default: wall seconds since the
    call; tests pass a :class:`run.clock.SimulatedClock`). A scheduled failure raises here and the job
    restarts in this process from its last checkpoint (:func:`run_job`). Stops at the next step
    boundary when ``run.control.STOP`` is set, then evaluates and saves where it stopped. Raises
    ``FileExistsError`` if ``run_dir`` already holds DP results, and ``ValueError`` (before any work)
    if the process has several devices and they do not divide the global batch or each microbatch
    (:func:`dp_devices`).
    """
    own = clock is None
    clock = EpochClock() if own else clock
    dp_devices(cfg)
    ensure_fresh(run_dir, STAGE, METHOD)
    if cfg.chaos.against_dp:
        save_chaos_schedule(cfg.chaos_schedule(), run_dir)
    host = DPHost(cfg, run_dir, clock, 0, progress, on_step)
    origin = time.time()
    if own:  # the job's clock starts with its first measurement, the model and data built
        clock.origin = origin

    def launch(gen: Generation) -> Outcome:
        try:
            return Outcome(summary=run_host(host, gen, lambda step: STOP.is_set()))
        except InjectedFailure as exc:
            return Outcome(failure=exc.record)

    try:
        return run_job(cfg, run_dir, launch, clock, origin)
    finally:
        host.close()


def write_progress(path: Path, step: int, t: float) -> None:
    """Host 0's last completed step (and the job clock then) for its launcher: replaced every step, no
    fsync (a lost write costs the launcher one step of its high-water mark)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"step": step, "t": t}))
    os.replace(tmp, path)
