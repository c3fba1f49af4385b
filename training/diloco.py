"""A Decoupled DiLoCo run, set up from plain inputs: the exchange, the syncer side and each learner's attempt.

``prepare_diloco(cfg, run_dir)`` (the process that runs the flow) builds Θ₀ and the fragments and
creates the run's exchange holding version 0 of every fragment: in process memory, registered under
the run directory (``runtime.exchange`` memory), or as durable objects at an fsspec URL (fsspec).
``open_syncer(cfg, run_dir, attempt)`` (the syncer task's process, which may be another one) opens
that exchange, takes office as its syncer (fencing out any earlier one) and builds the syncer from
Θ₀; with the fsspec exchange a restarted syncer then resumes from its checkpoint and journal
(``diloco.syncer_journal``) when ``run_syncer_to_end`` starts the loop.
``learner_attempt(cfg, run_dir, m, attempt)`` takes only plain, serialisable inputs and rebuilds
everything a learner needs from them, in any process: the model spec and compiled step (shared by
the learners of one process on the same devices: ``runtime.devices_per_learner`` of them,
``training.mesh.learner_devices``), its shard and data cursor, its resume point and the exchange
handle.
``run_syncer_to_end(run)`` drives the syncer, evaluates Θ on the cadence and saves the checkpoint
and summary. ``setup_diloco`` = prepare + open in one process. No Prefect here.

Both methods see the same data (the DP job reads the union of the learner shards), the same token
budget (``cfg.dp_steps × tokens per DP step``) and the same validation batches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.schema import ExperimentConfig, validate_against_model
from data.cursor import batch_at
from data.prepare import load_rows
from diloco.exchange import InMemoryExchange, open_exchange, register_exchange
from diloco.exchange.fsspec import FsspecExchange, StaleSyncerError
from diloco.faults import Corrupt, Fail, LearnerFaults, Presence, SlowDown, SyncerFaults
from diloco.fragments import balanced_fragments
from diloco.grace import GraceWindow
from diloco.learner import LearnerSetup, run_learner
from diloco.pacing import FairTurns, HostTurns
from diloco.receipt import receipt_rule
from diloco.syncer import Syncer, SyncerSettings
from diloco.syncer_journal import JournalMismatchError, SyncerJournal
from diloco.syncer_loop import SyncerHooks, liveness, run_syncer
from diloco.tensors import embedding_names, tensor_bytes, to_numpy
from diloco.wire import WireFormat
from run.control import STOP
from run.layout import RunLayout
from run.metrics import JsonlWriter, read_jsonl
from run.tracking import NO_TRACKING, Tracker
from training.checkpoint import OrbaxResumeStore, OrbaxSyncerStore, save_checkpoint
from training.common import compilation_cache_dir, ensure_fresh, model_spec, save_chaos_schedule, token_budget
from training.evaluation import eval_record, final_heldout, heldout_metrics, val_batches
from training.functional import nest
from training.mesh import backend_line, learner_devices, single_default
from training.optimizers import lr_schedule, make_inner_tx
from training.step import Trainer
from training.tracking import method_tracker

log = logging.getLogger(__name__)
STAGE, METHOD = "pretrain", "diloco"


def _key(run_dir: str | Path) -> str:
    return str(Path(run_dir).absolute())


_TRAINERS: dict[tuple, Trainer] = {}
_TURNS: dict[tuple, FairTurns | None] = {}
_EXCHANGES: dict[str, FsspecExchange] = {}
_LOCK = threading.Lock()


def _absolute(url: str) -> str:
    """A local path without a protocol (relative, or with ``~``) made absolute in this process; any
    other URL as it is."""
    url = url.rstrip("/")
    if "://" not in url and "::" not in url and not url.startswith(("file:", "local:")):
        return str(Path(url).expanduser().absolute())
    return url


def with_absolute_exchange(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with ``runtime.exchange_url`` made absolute (:func:`_absolute`) in the calling process:
    the flow does it once, before any task starts, so worker processes started in another folder (a
    Ray or Dask cluster) open the same exchange."""
    url = cfg.runtime.exchange_url
    if not url or _absolute(url) == url:
        return cfg
    return cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"exchange_url": _absolute(url)})})


def exchange_url(cfg: ExperimentConfig, run_dir: str | Path) -> str:
    """Where the run's fsspec exchange lives: ``runtime.exchange_url``/<run directory name>, or
    ``pretrain/diloco/exchange`` inside the run directory. The flow passes its tasks a config whose
    URL is already absolute (:func:`with_absolute_exchange`) and an absolute run directory."""
    if cfg.runtime.exchange_url:
        return f"{_absolute(cfg.runtime.exchange_url)}/{Path(run_dir).absolute().name}"
    return str(RunLayout(Path(run_dir).absolute()).exchange(STAGE, METHOD))


def open_run_exchange(cfg: ExperimentConfig, run_dir: str | Path):
    """This process's handle on the run's exchange (one per run and process, shared by its threads).

    Raises ``LookupError`` (memory: the run was set up in another process) or ``FileNotFoundError``
    (fsspec: nothing created at the URL yet)."""
    if cfg.runtime.exchange_kind == "memory":
        return open_exchange(_key(run_dir))
    url = exchange_url(cfg, run_dir)
    with _LOCK:
        if url not in _EXCHANGES:
            _EXCHANGES[url] = FsspecExchange.open(url, poll_s=cfg.runtime.exchange_poll_s)
        return _EXCHANGES[url]


def learner_trainer(cfg: ExperimentConfig, run_dir: str | Path, devices: Sequence[jax.Device] | None = None) -> Trainer:
    """One compiled learner step per run, process and device slice, shared by the learners on that
    slice (no recompiles); learners on other devices get their own.

    ``devices``: the slice (``training.mesh.learner_devices``); None, or just the default device,
    is the default device (the syncer's side: Θ₀, fragments, held-out evaluation)."""
    placed = None if single_default(devices) else tuple(devices)
    key = (repr(cfg), _key(run_dir), None if placed is None else tuple((d.platform, d.id) for d in placed))
    with _LOCK:
        if key not in _TRAINERS:
            tx = make_inner_tx(cfg.diloco.inner, cfg.learner_steps)
            _TRAINERS[key] = Trainer(
                model_spec(cfg, run_dir),
                tx,
                cfg.learner_microbatches,
                seed=cfg.seed,
                devices=placed,
                precision=cfg.precision,
            )
        return _TRAINERS[key]


def _turns(run_dir: str | Path, slots: int, accelerators: tuple | None = None) -> FairTurns | None:
    """The first-come turns shared by the learners of one run in this process (None: unpaced):
    one set per accelerator slice (``accelerators``: its devices), one for all when None (CPU)."""
    with _LOCK:
        return _TURNS.setdefault((_key(run_dir), accelerators), FairTurns(slots) if slots else None)


def host_turns_dir(run_dir: str | Path) -> Path:
    """The folder in which the learner processes of one run on this host take turns
    (:class:`~diloco.pacing.HostTurns`): under the host's temporary folder, so learners on other
    hosts never pace against these."""
    digest = hashlib.sha1(_key(run_dir).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "ddiloco-turns" / digest


def learner_turns(
    cfg: ExperimentConfig, run_dir: str | Path, devices: Sequence[jax.Device] | None = None
) -> FairTurns | HostTurns | None:
    """The turns learner steps take on this host (``diloco.compute_slots``; None when 0): between
    the threads of this process on the thread engine, between the learner processes of this host
    on Ray and Dask and in emulated datacenters (none for a Ray learner with GPUs of its own).

    Threads: ``devices`` is the learner's slice (``training.mesh.learner_devices``). On accelerators
    the learners of one slice take turns and those of different slices never wait for each other
    (learner m on GPU m computes while learner m' computes on GPU m'); on CPU every learner takes
    turns with every other (CPU devices, even several, are the same cores)."""
    slots = cfg.diloco.compute_slots
    if not cfg.learner_processes or not slots:
        own = None
        if devices is not None and any(d.platform != "cpu" for d in devices):
            own = tuple((d.platform, d.id) for d in devices)
        return _turns(run_dir, slots, own)
    if cfg.runtime.engine == "ray" and _ray_gpu_ids():
        return None  # GPUs of its own (runtime.learner_gpus): nothing on this host to take turns on
    return HostTurns(host_turns_dir(run_dir), slots)


def _ray_gpu_ids() -> list:
    """The GPUs Ray reserved for this worker's task ([] outside a Ray worker)."""
    try:
        import ray
    except ImportError:
        return []
    return list(ray.get_gpu_ids()) if ray.is_initialized() else []


def run_fragments(cfg: ExperimentConfig, trainer: Trainer) -> list[list[str]]:
    """The run's P fragments: derived from the parameter sizes alone, so the syncer and every learner
    attempt, in any process, get the same partition without exchanging it."""
    return balanced_fragments(tensor_bytes(trainer.param_shapes), cfg.diloco.fragments)


@dataclass
class DiLoCoRun:
    """The syncer side of one run (lives in the syncer task's process)."""

    cfg: ExperimentConfig
    run_dir: Path
    exchange: InMemoryExchange | FsspecExchange
    syncer: Syncer
    trainer: Trainer
    merges_log: JsonlWriter
    learners_log: JsonlWriter
    eval_log: JsonlWriter
    val: list[np.ndarray]
    budget: int
    generation: int = 1
    last_val_loss: float | None = None
    merges: int = 0
    attempt: int = 1
    journal: SyncerJournal | None = None  # fsspec exchange: journal + checkpoints (a syncer that survives)
    resumed: bool = False  # an earlier syncer of this run took office before this one
    logged_merges: set[tuple[int, int]] = field(default_factory=set)  # (fragment, version) in merges.jsonl
    tracker: Tracker = NO_TRACKING  # TensorBoard / W&B of the syncer's merges and evaluations (run.tracking)

    def close_logs(self) -> None:
        for log in (self.merges_log, self.learners_log, self.eval_log):
            log.close()
        self.tracker.close()


def grace_window(cfg: ExperimentConfig) -> GraceWindow:
    """The syncer loop's grace window from ``diloco.grace*`` (τ defaults to H)."""
    d = cfg.diloco
    return GraceWindow(
        mode=d.grace,
        fixed_s=d.grace_s,
        gamma=d.grace_gamma,
        overlap_steps=d.grace_overlap_steps or d.overlap_steps or d.sync_every,
        cap_s=d.grace_cap_s,
    )


def syncer_settings(cfg: ExperimentConfig) -> SyncerSettings:
    d = cfg.diloco
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


def prepare_diloco(cfg: ExperimentConfig, run_dir: str | Path):
    """Create the run's exchange holding Θ₀ (version 0 of every fragment) and the token budget; the
    in-process one is registered for the learners and syncer of this process. Returns it.

    Raises ``FileExistsError`` if ``run_dir`` already holds DiLoCo results (or the fsspec exchange
    URL already holds an exchange), ``ValueError`` if P exceeds the model's tensors or (thread
    engine: the learners run in this process) ``runtime.devices_per_learner`` does not fit this
    process's devices (more than there are, or not a divisor of their number).
    """
    run_dir = Path(run_dir)
    ensure_fresh(run_dir, STAGE, METHOD)
    save_chaos_schedule(cfg, run_dir)
    if not cfg.learner_processes:  # the learners run in this process: refused before any starts
        learner_devices(0, cfg.runtime.devices_per_learner)
    trainer = learner_trainer(cfg, run_dir)
    theta0 = to_numpy(trainer.init_params())
    validate_against_model(cfg, len(theta0))
    fragments = run_fragments(cfg, trainer)
    initial = [{k: theta0[k] for k in names} for names in fragments]
    budget = token_budget(cfg)
    if cfg.runtime.exchange_kind == "memory":
        exchange = InMemoryExchange(len(fragments), budget)
        for p, params in enumerate(initial):
            exchange.publish(p, 0, params)
        register_exchange(_key(run_dir), exchange)
        return exchange
    # every learner starts with, and is topped up by, one sync period of inner steps' tokens
    grant = cfg.diloco.sync_every * cfg.tokens_per_learner_step
    return FsspecExchange.create(
        exchange_url(cfg, run_dir),
        initial=initial,
        num_learners=cfg.diloco.learners,
        token_budget=budget,
        grant_tokens=grant,
        poll_s=cfg.runtime.exchange_poll_s,
    )


def open_syncer(cfg: ExperimentConfig, run_dir: str | Path, attempt: int = 1) -> DiLoCoRun:
    """The syncer side of the run prepared by :func:`prepare_diloco`, in this process: opens the
    exchange, takes office (fencing out any earlier syncer) and builds the syncer from Θ₀.

    With the fsspec exchange the syncer gets its own handle on the exchange (never the one this
    process's learners share: a restarted syncer must not inherit what a failed one drained) and a
    :class:`~diloco.syncer_journal.SyncerJournal` with its checkpoints in
    ``RunLayout.syncer_state``; :func:`run_syncer_to_end` recovers from them first (a fresh run has
    neither and starts exactly as before). ``attempt``: the syncer task's attempt (1, 2, …), raised
    to the exchange's generation (an engine's re-run of a dead worker), which picks its scheduled
    ``syncer_fail`` event of ``chaos.events``.
    """
    run_dir = Path(run_dir)
    layout = RunLayout(run_dir)
    trainer = learner_trainer(cfg, run_dir)
    fragments = run_fragments(cfg, trainer)
    journal, resumed = None, False
    if cfg.runtime.exchange_kind == "memory":
        exchange = open_run_exchange(cfg, run_dir)
        generation = exchange.take_office()
        theta = {}
        for p in range(len(fragments)):
            theta.update(exchange.latest(p)[1])
    else:
        exchange = FsspecExchange.open(exchange_url(cfg, run_dir), poll_s=cfg.runtime.exchange_poll_s)
        resumed = exchange.generation() > 0
        generation = exchange.take_office()
        theta = {}
        for p in range(len(fragments)):
            theta.update(exchange.origin(p))
        journal = SyncerJournal(
            exchange, OrbaxSyncerStore(layout.syncer_state(STAGE, METHOD)), cfg.diloco.syncer_checkpoint_every_s
        )
    syncer = Syncer(theta, fragments, syncer_settings(cfg), embedding_names(theta))
    merges_path = layout.metrics(STAGE, METHOD, "merges")
    tracker = method_tracker(cfg, run_dir, STAGE, METHOD)
    logged = {(int(r["fragment"]), int(r["version"])) for r in read_jsonl(merges_path)} if resumed else set()
    return DiLoCoRun(
        cfg=cfg,
        run_dir=run_dir,
        exchange=exchange,
        syncer=syncer,
        trainer=trainer,
        merges_log=JsonlWriter(merges_path, sink=tracker.sink("merges")),
        learners_log=JsonlWriter(layout.metrics(STAGE, METHOD, "learners")),
        eval_log=JsonlWriter(layout.metrics(STAGE, METHOD, "eval"), sink=tracker.sink("eval")),
        tracker=tracker,
        val=val_batches(load_rows(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size),
        # a syncer whose process died is re-run by the engine without counting a Prefect retry: the
        # exchange's generation counts every syncer that took office in this run
        budget=token_budget(cfg),
        generation=generation,
        attempt=max(attempt, generation),
        journal=journal,
        resumed=resumed,
        logged_merges=logged,
        merges=len(logged),
    )


def setup_diloco(cfg: ExperimentConfig, run_dir: str | Path) -> DiLoCoRun:
    """:func:`prepare_diloco` and :func:`open_syncer` in this process (the thread engine, tests)."""
    prepare_diloco(cfg, run_dir)
    return open_syncer(cfg, run_dir)


def learner_faults(cfg: ExperimentConfig, learner: int) -> LearnerFaults:
    """Learner ``learner``'s scheduled faults (``cfg.fault_events()``: ``chaos.events`` and the drawn
    or replayed ``chaos.schedule``) as ``diloco.faults`` values: ``fail`` and ``kill`` a
    :class:`Fail` (how raise or sigkill), ``slowdown``, ``corrupt`` and ``presence`` their own."""
    out: list = []
    for e in cfg.fault_events():
        if getattr(e, "learner", None) != learner:
            continue
        if e.kind in ("fail", "kill"):
            out.append(Fail(at_step=e.at_step, at_s=e.at_s, how=e.how, restart_delay_s=e.restart_delay_s))
        elif e.kind == "slowdown":
            out.append(SlowDown(e.factor, e.from_s, e.to_s))
        elif e.kind == "corrupt":
            out.append(Corrupt(e.at_s, e.corruption))
        elif e.kind == "presence":
            out.append(Presence(e.join_s, e.leave_s))
    return LearnerFaults(tuple(out))


def learner_setup(
    cfg: ExperimentConfig, run_dir: str | Path, learner: int, attempt: int, log, exchange=None
) -> LearnerSetup:
    """Learner ``learner``'s setup for ``attempt``, from plain inputs (and the process's exchange
    registered for ``run_dir`` unless ``exchange`` is given). Its step runs on
    ``learner_devices(learner, runtime.devices_per_learner)`` (``ValueError`` if those do not fit)."""
    d = cfg.diloco
    devices = learner_devices(learner, cfg.runtime.devices_per_learner)
    trainer = learner_trainer(cfg, run_dir, devices)
    exchange = exchange if exchange is not None else open_run_exchange(cfg, run_dir)
    seqs = load_rows(run_dir, f"shard_{learner:02d}")
    faults = learner_faults(cfg, learner)
    return LearnerSetup(
        learner=learner,
        attempt=attempt,
        step=trainer.step,
        init_params=trainer.init_params,
        init_opt=trainer.init_opt,
        next_batch=partial(batch_at, seqs, batch_size=d.batch_size, seed=cfg.seed + 1000 * (learner + 1)),
        fragments=run_fragments(cfg, trainer),
        period=d.sync_every,
        tokens_per_step=cfg.tokens_per_learner_step,
        receipt=receipt_rule(d.receipt, d.mix_alpha),
        exchange=exchange,
        log=log,
        stop=lambda: STOP.is_set() or exchange.stop_requested(),
        resume=OrbaxResumeStore(RunLayout(run_dir).resume_point(STAGE, METHOD, learner)),
        resume_every=d.resume_every_steps,
        faults=faults,
        turns=learner_turns(cfg, run_dir, devices),
        overlap_steps=d.overlap_steps,
        wait_timeout_s=d.heartbeat_timeout_s,
        num_learners=d.learners,
        # threads of one process start together; processes seconds apart (the gate's docstring)
        start_wait_s=cfg.runtime.start_wait_s if cfg.learner_processes else 0.0,
        wire=WireFormat(d.wire.dtype, d.wire.block_size),
        lr=lr_schedule(d.inner, cfg.learner_steps),
    )


def warm_compilation_cache(cfg: ExperimentConfig, run_dir: str | Path) -> float:
    """Compile the learner step and the held-out evaluation here, into the run's compilation cache
    (``runtime.compilation_cache``), so that the learner and syncer processes of a process engine
    load them instead of each compiling them at once: the flow calls it right after submitting
    their tasks, while the workers still import. Runs one step on learner 0's first batch and one
    evaluation batch on throw-away copies of Θ₀ (nothing is logged or kept). Returns the seconds
    it took; 0.0 when the cache is off.

    Measured in ``benchmarks/engines.py`` (its ``-uncached`` arms): the saving shows in the training
    seconds, since a learner compiles its step at its first step."""
    if compilation_cache_dir(cfg, run_dir) is None:
        return 0.0
    t0 = time.perf_counter()
    trainer = learner_trainer(cfg, run_dir)
    params = trainer.init_params()
    opt = trainer.init_opt(params)
    batch, _, _ = batch_at(load_rows(run_dir, "shard_00"), 0, 0, batch_size=cfg.diloco.batch_size, seed=cfg.seed)
    val = val_batches(load_rows(run_dir, "val"), 1, cfg.train.eval_batch_size)
    heldout_metrics(trainer.evaluate, params, val)
    _, _, metrics = trainer.step(params, opt, jax.tree.map(jnp.asarray, batch))
    jax.block_until_ready(metrics["loss"])
    return time.perf_counter() - t0


def learner_attempt(cfg: ExperimentConfig, run_dir: str | Path, learner: int, attempt: int, exchange=None) -> dict:
    """Run one attempt of learner ``learner`` (``diloco.learner.run_learner``) from plain inputs.

    ``exchange``: default, this process's handle on the run's exchange (:func:`open_run_exchange`).
    ``attempt`` is raised past the last attempt the exchange saw start (a process engine re-runs a
    killed learner without counting a Prefect retry). Raises whatever the attempt raised
    (``InjectedFailure`` for a scheduled failure); the task runner retries it, and the retry resumes
    from the saved resume point. An attempt whose set-up raises (e.g. ``ValueError``: its worker
    cannot meet ``runtime.devices_per_learner``) is a failure before its first step: it reports itself
    ``down`` to the exchange and logs a ``failure`` event (``before_start``) first, at the local step
    its earlier attempts reached (0 on a first attempt).
    """
    exchange = exchange if exchange is not None else open_run_exchange(cfg, run_dir)
    began_at = exchange.clock()
    seen = exchange.learners().get(learner, {})
    previous, last_step = seen.get("attempt"), int(seen.get("step") or 0)  # of its earlier attempts
    if previous is not None:
        attempt = max(attempt, int(previous) + 1)
    tracker = method_tracker(
        cfg,
        run_dir,
        STAGE,
        METHOD,
        flops_per_token=model_spec(cfg, run_dir).flops_per_unit,
        devices=cfg.runtime.devices_per_learner,
    )
    log = JsonlWriter(RunLayout(run_dir).metrics(STAGE, METHOD, "learners"), sink=tracker.sink("learners"))
    try:
        try:
            setup = learner_setup(cfg, run_dir, learner, attempt, log, exchange)
            setup.began_at = began_at
        except BaseException as exc:  # failed before its first step: logged as a failure all the same
            exchange.heartbeat(
                learner, status="down", attempt=attempt, step=last_step, reason=repr(exc), pid=os.getpid()
            )
            log(
                {
                    "event": "failure",
                    "learner": learner,
                    "attempt": attempt,
                    "reason": repr(exc),
                    "step": last_step,
                    "t": exchange.clock(),
                    "before_start": True,
                }
            )
            raise
        return run_learner(setup)
    finally:
        log.close()
        tracker.close()


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
        run.eval_log(
            {
                "method": METHOD,
                "tokens": tokens,
                "wall_s": run.exchange.clock(),
                "merges": run.merges,
                **fields,
                "eval_s": time.perf_counter() - t0,
            }
        )
        if on_evaluated is not None:
            try:
                on_evaluated()
            except Exception as exc:  # noqa: BLE001 - a chart never stops the syncer
                log.warning("syncer: after the evaluation at %d tokens: %s: %s", tokens, type(exc).__name__, exc)

    def on_recover(info: dict) -> None:
        if run.resumed:
            run.learners_log(
                {
                    "event": "syncer-resumed",
                    "role": "syncer",
                    "attempt": run.attempt,
                    "pid": os.getpid(),
                    **info,
                    "merges": run.syncer.num_merges,
                    "t": run.exchange.clock(),
                }
            )

    def on_event(ev: dict) -> None:
        run.learners_log({"source": "exchange", **ev})

    if not run.resumed:
        on_eval(run.syncer.params(), 0)
    poll_s = 0.002 if run.cfg.runtime.exchange_kind == "memory" else run.cfg.runtime.exchange_poll_s
    try:
        result = run_syncer(
            run.syncer,
            run.exchange,
            SyncerHooks(on_merge=on_merge, on_eval=on_eval, on_event=on_event, on_recover=on_recover),
            eval_every_tokens=run.cfg.train.eval_every_tokens,
            heartbeat_timeout_s=run.cfg.diloco.heartbeat_timeout_s,
            poll_s=poll_s,
            journal=run.journal,
            grace=grace_window(run.cfg),
            faults=syncer_faults(run),
        )
    except BaseException as exc:
        run.learners_log(
            {
                "event": "syncer-failure",
                "role": "syncer",
                "attempt": run.attempt,
                "generation": run.generation,
                "reason": f"{type(exc).__name__}: {exc}",
                "merges": run.syncer.num_merges,
                "t": run.exchange.clock(),
            }
        )
        raise
    for ev in result.events:
        run.learners_log({**ev, "source": "syncer"})
    return save_diloco(run, result.wall_s)


def syncer_faults(run: DiLoCoRun) -> SyncerFaults:
    """This syncer attempt's injected failure: the ``run.attempt``-th ``syncer_fail`` of ``chaos.events``
    (in merge order), with a journal only (the fsspec exchange); ``how: sigkill`` logs a
    ``syncer-kill`` event and SIGKILLs the process instead of raising. None due: no faults."""
    failures = sorted((e for e in run.cfg.chaos.events if e.kind == "syncer_fail"), key=lambda f: f.at_merge)
    if run.journal is None or run.attempt > len(failures):
        return SyncerFaults()
    f = failures[run.attempt - 1]
    if f.how != "sigkill":
        return SyncerFaults(fail_at=(f.at_merge, f.when))

    def on_fail(reason: str) -> None:
        run.learners_log(
            {
                "event": "syncer-kill",
                "role": "syncer",
                "attempt": run.attempt,
                "generation": run.generation,
                "reason": f"chaos: SIGKILL ({reason})",
                "merges": run.syncer.num_merges,
                "pid": os.getpid(),
                "t": run.exchange.clock(),
            }
        )
        os.kill(os.getpid(), signal.SIGKILL)

    return SyncerFaults(fail_at=(f.at_merge, f.when), on_fail=on_fail)


def save_diloco(run: DiLoCoRun, wall_s: float) -> dict:
    """Checkpoint Θ and the outer state (step = tokens claimed); return the summary dict."""
    cfg, s = run.cfg, run.syncer
    P = s.num_fragments
    outer = {
        f"fragment_{p}": {f"{i:04d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(st))}
        for p, st in enumerate(s.opt_states)
    }
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
            "merged": round(entry.merged / P),
            "recomputed": round(entry.recomputed / P),
            "dropped": round(entry.dropped / P),
            "pending": round(pending[m] / P),
            "drop_reasons": {k: round(v / P) for k, v in entry.drop_reasons.items()},
            "attempts": int(learners.get(m, {}).get("attempt", 1)),
        }
    tokens = run.exchange.claimed_tokens
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
        run.trainer.evaluate, {k: jnp.asarray(v) for k, v in theta.items()}, run.run_dir, cfg.train.eval_batch_size
    )
    layout = RunLayout(run.run_dir)
    save_checkpoint(layout.checkpoints(STAGE, METHOD), tokens, nest(theta), meta, extra={"outer_state": outer})
    merges_bytes_in = sum(r.get("bytes_in", 0) for r in read_jsonl(run.merges_log.path))
    d = cfg.diloco
    spec = run.trainer.spec
    text = cfg.unit == "tokens"
    rows = "seqs" if text else "images"
    return {
        "method": METHOD,
        "interrupted": STOP.is_set() or run.exchange.stop_requested(),
        "work_lost": work_lost(ledger, d.warn_dropped_fraction, d.max_dropped_fraction),
        "hyperparameters": {
            "backend": backend_line(),
            "precision": cfg.precision.describe(),
            "learners (M)": d.learners,
            "fragments (P)": d.fragments,
            "sync every (H)": d.sync_every,
            "quorum (K)": d.quorum,
            "grace window (s)": d.grace_s,
            "grace": d.grace
            if d.grace == "fixed"
            else f"adaptive (γ {d.grace_gamma:g}, "
            f"τ {d.grace_overlap_steps or d.overlap_steps or d.sync_every} steps, cap "
            f"{'one step' if d.grace_cap_s is None else f'{d.grace_cap_s:g} s'})",
            "merge": d.merge,
            "outer lr": d.outer_lr,
            "outer momentum": d.outer_momentum,
            "nesterov": (d.outer_nesterov if d.outer_momentum else "n/a (no momentum)"),
            f"batch ({rows}/learner step)": d.batch_size,
            **({"seq len": cfg.data.seq_len} if text else {}),
            "inner optimizer": d.inner.name,
            "inner lr": d.inner.lr,
            "warmup steps": d.inner.warmup_steps,
            "weight decay": d.inner.weight_decay,
            "grad clip": d.inner.grad_clip,
            f"{cfg.unit}/learner step": cfg.tokens_per_learner_step,
            "on receipt": (f"mix α={d.mix_alpha}" if d.receipt == "mix" else d.receipt.replace("_", " ")),
            "compute slots": d.compute_slots or "unpaced",
            "devices per learner": cfg.runtime.devices_per_learner,
            f"microbatch ({rows})": cfg.train.microbatch_size or "whole batch",
            "resume point every (steps)": d.resume_every_steps or "never",
            "wire format (learner→syncer)": d.wire.spec,
            "overlap τ (steps; a learner waits past it)": d.overlap_steps or "never waits",
        },
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
        "bytes_merged": int(merges_bytes_in),
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


def live_view(cfg: ExperimentConfig, exchange, run_dir: str | Path) -> tuple[list[dict], dict]:
    """The syncer's-eye view of a running DiLoCo run, for a live artifact: one row per learner
    (alive as the syncer judges it from heartbeats, ``diloco.syncer_loop.liveness``; status,
    attempt, inner step, tokens processed, bytes sent and received, seconds since its last
    heartbeat, process id) and the totals: global versions, merges, tokens claimed, tokens merged
    (Σ over the merge log of the contributors' token counters ÷ P, the model-level tokens in Θ).
    Reads the exchange and ``metrics/merges.jsonl``; writes nothing."""
    live, down = liveness(exchange, cfg.diloco.heartbeat_timeout_s)
    now = time.monotonic()
    rows = []
    beats = exchange.learners()
    for m in range(cfg.diloco.learners):
        b = beats.get(m, {})
        state = "alive" if m in live else down.get(m, b.get("status", "not started"))
        rows.append(
            {
                "learner": m,
                "state": state,
                "attempt": b.get("attempt", 1 if b else None),
                "step": b.get("step"),
                "tokens": b.get("processed"),
                "bytes sent": b.get("bytes_to_syncer"),
                "bytes received": b.get("bytes_from_syncer"),
                "heartbeat age (s)": round(now - b["last_seen"], 1) if "last_seen" in b else None,
                "pid": b.get("pid"),
            }
        )
    merges = read_jsonl(RunLayout(run_dir).metrics(STAGE, METHOD, "merges"))
    versions = exchange.versions()
    totals = {
        "alive": len(live),
        "learners": cfg.diloco.learners,
        "versions": versions,
        "merges": sum(versions),
        "tokens claimed": exchange.claimed_tokens,
        "tokens merged": round(sum(sum(r.get("tokens") or []) for r in merges) / max(len(versions), 1)),
        "bytes merged": int(sum(r.get("bytes_in") or 0 for r in merges)),
    }
    return rows, totals


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


def learners_gone(
    learners: dict[int, dict], num_learners: int, errors: dict[int, str] | None = None, retries: int | None = None
) -> str:
    """Why a DiLoCo stage's learners stopped before its budget was spent, in one phrase (for
    ``training.common.budget_status``): how each learner ended, from its last heartbeat
    (``learners``: the exchange's view, learner → status, attempt, step, reason) or, for a learner
    that never reported to the exchange (its worker could not even start the task), from
    ``errors`` (learner → the task's error). ``retries``: ``diloco.learner_retries``, named in the
    phrase. Learner order; no Prefect, no I/O."""
    errors = errors or {}
    parts = []
    for m in range(num_learners):
        info = learners.get(m)
        if info is None:
            parts.append(
                f"learner {m} failed before its first step, never reporting to the exchange "
                f"({errors.get(m, 'no reason recorded')})"
            )
            continue
        status = info.get("status")
        verb = "failed" if status == "down" else f"ended {status or 'without a status'}"
        step = int(info.get("step") or 0)
        at = f"at local step {step}" if step else "before its first step"
        n = int(info.get("attempt") or 1)
        reason = info.get("reason") or errors.get(m) or "no reason recorded"
        parts.append(f"learner {m} {verb} {at} after {n} attempt{'' if n == 1 else 's'} ({reason})")
    retried = "" if retries is None else f" (diloco.learner_retries {retries})"
    return f"every learner ended before the budget was spent{retried}: " + "; ".join(parts)
