"""Experiment tracking: TensorBoard event files and Weights & Biases runs, fed from the metric records.

Every record a run appends to a ``metrics/<log>.jsonl`` file also goes to that writer's sink
(``run.metrics.JsonlWriter(path, sink=...)``): a :class:`Tracker` (one per stage, method and
process) turns it into scalars (:func:`scalars`) and writes them to each backend the ``tracking``
config section enables. One fan-out, no second bookkeeping: the JSONL files stay the record the
reports read, the trackers display the same numbers. Layout (paths from ``run.layout``)::

    RUN/<stage>/<method>/tensorboard/               the method: train/*, val/*, merge/*, throughput/*
    RUN/<stage>/<method>/tensorboard/learner-<m>/   DiLoCo learner m: its train/* and throughput/*
    RUN/pretrain/diloco/tensorboard/progress/       learners/alive, resilience/goodput and /uptime (live)
    RUN/finetune/<method>/tensorboard/seed-<s>/     fine-tuning seed s (its x axis: optimizer steps)
    RUN/tensorboard/                                the run's settings and final losses (HParams tab)
    RUN/wandb/                                      W&B runs, one per method and per learner, grouped by run

``tensorboard --logdir runs/`` overlays every run under ``runs/`` (a sweep's cells, a run's seeds).
The TensorBoard step (x axis) of ``train/*``, ``val/*`` and ``throughput/*`` is tokens: those the
writer trained on (DP: every token; a learner: its own), for the syncer's held-out evaluation those of
every learner; for ``merge/*`` it is the merge's ordinal (1, 2, ... over the run, resumed syncers
included). Tags:

* ``train/loss``, ``train/grad_norm`` (global L2 norm of the gradient before clipping), ``train/lr``
  (the inner learning rate of the step), and the model's other ``train/*`` metrics;
* ``val/loss`` and the model's other held-out ``val/*`` metrics; ``syncer/merges`` (merges so far);
* ``throughput/tokens_per_s`` between two train records; ``throughput/mfu`` (model FLOPs
  utilisation, PaLM's definition: Chowdhery et al. 2022, appendix B) when one device's peak FLOP/s is
  known (``tracking.peak_tflops`` or ``training.peaks``: not on a CPU);
* ``merge/quorum`` (learners merged), ``merge/staleness_max`` and ``merge/staleness_mean`` (versions
  behind), ``merge/grace_s`` (the grace window the merge was given, seconds; not on the final
  flush's merges), ``merge/wait_s`` (seconds from quorum to merge), ``merge/tokens``,
  ``merge/bytes_in`` and ``merge/bytes_out`` (bytes), ``merge/outer_grad_norm``;
* ``summary/*``: a method's end-of-training figures (tokens/s, wall seconds, goodput when measured).

A backend that fails (a full disk, W&B refusing a value) is logged once and switched off: tracking
never stops training. No JAX here; TensorBoard's writer is ``tensorboardX``, W&B's is ``wandb``
(optional: ``uv sync --extra wandb``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METHOD_KEY = ""  # the writer of the method itself (its tensorboard/ folder); learners get "learner-<m>"
PROGRESS_KEY = "progress"  # the DiLoCo flow's live view (learners alive, goodput), written in the flow's process
TOKENS_AXIS, MERGE_AXIS = "tokens", "merge/index"  # W&B step metrics (TensorBoard's step is the same number)


def _number(v: Any) -> float | None:
    """``v`` as a finite float, or None (strings, lists, bools, NaN and inf are not scalars to plot)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _slashed(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's metrics: its numeric fields whose names hold a slash (``train/loss``, ``val/accuracy``)."""
    out = {}
    for k, v in record.items():
        if "/" in k and (x := _number(v)) is not None:
            out[k] = x
    return out


def _merge_scalars(rec: Mapping[str, Any]) -> dict[str, float]:
    """``merge/*`` of one ``merges.jsonl`` record (``diloco.syncer.Syncer.merge``'s, with ``merge``)."""
    stale = [float(s) for s in rec.get("stale") or []]
    tokens = rec.get("tokens") or []
    out = {
        "merge/quorum": float(len(rec.get("contributors") or [])),
        "merge/tokens": float(sum(tokens)) if isinstance(tokens, list) else _number(tokens),
        "merge/bytes_in": _number(rec.get("bytes_in")),
        "merge/bytes_out": _number(rec.get("bytes_out")),
        "merge/outer_grad_norm": _number(rec.get("outer_grad_norm")),
    }
    if stale:
        out["merge/staleness_max"], out["merge/staleness_mean"] = max(stale), sum(stale) / len(stale)
    q, m = _number(rec.get("quorum_at_s")), _number(rec.get("merged_at_s"))
    if q is not None and m is not None:
        out["merge/wait_s"] = max(m - q, 0.0)
    if (g := _number(rec.get("grace_s"))) is not None:
        out["merge/grace_s"] = g
    return {k: v for k, v in out.items() if v is not None}


def scalars(log_name: str, record: Mapping[str, Any]) -> tuple[str, int, dict[str, float]] | None:
    """``(writer key, step, {tag: value})`` for one record of ``metrics/<log_name>.jsonl``, or None
    when the record holds nothing to plot (events other than a learner's step, a merge refusal).

    Writer key: :data:`METHOD_KEY`, ``learner-<m>`` for a learner's step record, ``seed-<s>`` for a
    fine-tuning record of seed s. Step: the
    record's ``tokens`` (``train``, ``eval``, learner steps; a fine-tuning record without tokens:
    its ``step``), or ``merge`` (the ordinal) for a merge. Raises nothing on unknown fields: only
    numeric ones are taken.
    """
    if log_name == "merges":
        if "merge" not in record or "contributors" not in record:
            return None
        values = _merge_scalars(record)
        values[MERGE_AXIS] = float(record["merge"])
        return METHOD_KEY, int(record["merge"]), values
    key = f"seed-{int(record['seed'])}" if _number(record.get("seed")) is not None else METHOD_KEY
    if log_name == "learners":
        if record.get("event") != "step" or "learner" not in record:
            return None
        key = f"learner-{int(record['learner'])}"
    elif log_name not in ("train", "eval"):
        return None
    axis = record.get("tokens", record.get("step"))
    if _number(axis) is None:
        return None
    values = _slashed(record)
    if log_name == "eval" and (m := _number(record.get("merges"))) is not None:
        values["syncer/merges"] = m
    return (key, int(axis), values) if values else None


class _Throughput:
    """tokens/s (and MFU) between consecutive train records of one writer: Δtokens ÷ Δt."""

    def __init__(self, flops_per_token: float | None, peak_flops: float | None) -> None:
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.last: tuple[float, float] | None = None

    def __call__(self, tokens: float, t: float | None) -> dict[str, float]:
        if t is None:
            return {}
        last, self.last = self.last, (tokens, t)
        if last is None or t <= last[1] or tokens <= last[0]:
            return {}  # the first record, or a clock that went back (a rejoined learner's resume point)
        rate = (tokens - last[0]) / (t - last[1])
        out = {"throughput/tokens_per_s": rate}
        if self.flops_per_token and self.peak_flops:
            out["throughput/mfu"] = rate * self.flops_per_token / self.peak_flops
        return out


class Tracker:
    """The tracking backends of one method of one run in this process.

    ``tensorboard_dir``: the method's ``tensorboard/`` folder (None: no TensorBoard). ``wandb``:
    keyword arguments of ``wandb.init`` shared by this tracker's W&B runs (``project``, ``entity``,
    ``group``, ``dir``, ``mode``, ``config``, ``name``: the method's run name; None: no W&B).
    ``flops_per_token`` (training FLOPs per token, ``ModelSpec.flops_per_unit``) and ``peak_flops``
    (the peak FLOP/s of the devices one writer trains on, all of them together) give MFU; either
    None: no MFU. ``flush_s``: seconds between event-file flushes. Writers open on first use, one per
    writer key (the method, each learner); :meth:`close` flushes and closes them all.
    """

    def __init__(
        self,
        tensorboard_dir: Path | None,
        wandb: Mapping[str, Any] | None = None,
        *,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        flush_s: float = 10.0,
    ) -> None:
        self.tensorboard_dir, self.wandb_args = tensorboard_dir, dict(wandb) if wandb else None
        self.flops_per_token, self.peak_flops, self.flush_s = flops_per_token, peak_flops, flush_s
        self._tb: dict[str, Any] = {}
        self._wb: dict[str, Any] = {}
        self._rates: dict[str, _Throughput] = {}
        self._lock = threading.Lock()
        self._failed: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.tensorboard_dir is not None or self.wandb_args is not None

    def sink(self, log_name: str) -> Callable[[dict], None] | None:
        """The callable ``run.metrics.JsonlWriter`` hands each record of ``metrics/<log_name>.jsonl``
        to; None when no backend is enabled."""
        if not self.enabled:
            return None
        return lambda record: self.write(log_name, record)

    def write(self, log_name: str, record: Mapping[str, Any]) -> None:
        """Write one metrics record's scalars (:func:`scalars`) to every enabled backend."""
        got = scalars(log_name, record)
        if got is None:
            return
        key, step, values = got
        if "tokens" in record and any(k.startswith("train/") for k in values):
            rate = self._rates.setdefault(key, _Throughput(self.flops_per_token, self.peak_flops))
            values = {**values, **rate(float(step), _number(record.get("t")))}
        self.scalars(key, step, values)

    def scalars(self, key: str, step: int, values: Mapping[str, float]) -> None:
        """Write ``values`` at ``step`` to writer ``key`` (:data:`METHOD_KEY` or ``learner-<m>``)."""
        with self._lock:
            if self.tensorboard_dir is not None and "tensorboard" not in self._failed:
                self._guard("tensorboard", self._tb_write, key, step, values)
            if self.wandb_args is not None and "wandb" not in self._failed:
                self._guard("wandb", self._wb_write, key, step, values)

    def _guard(self, backend: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # tracking never stops training
            self._failed.add(backend)
            log.warning("tracking: %s switched off for this method after %s: %s", backend, type(exc).__name__, exc)

    def _tb_write(self, key: str, step: int, values: Mapping[str, float]) -> None:
        writer = self._tb.get(key)
        if writer is None:
            from tensorboardX import SummaryWriter

            logdir = self.tensorboard_dir / key if key else self.tensorboard_dir
            writer = self._tb[key] = SummaryWriter(logdir=str(logdir), flush_secs=self.flush_s)
        for tag, v in values.items():
            if tag != MERGE_AXIS:
                writer.add_scalar(tag, v, global_step=step)

    def _wb_write(self, key: str, step: int, values: Mapping[str, float]) -> None:
        run = self._wb.get(key)
        if run is None:
            import wandb

            args = dict(self.wandb_args)
            args["name"] = f"{args.get('name', 'run')}/{key}" if key else args.get("name")
            args["job_type"] = key or args.get("job_type")
            # several runs at once in one process (the threads engine's learners); nothing on the console
            settings = wandb.Settings(silent=True, console="off")
            run = self._wb[key] = wandb.init(**args, reinit="create_new", settings=settings)
            run.define_metric(TOKENS_AXIS)
            run.define_metric(MERGE_AXIS)
            run.define_metric("merge/*", step_metric=MERGE_AXIS)
            for prefix in ("train", "val", "throughput", "syncer", "summary"):
                run.define_metric(f"{prefix}/*", step_metric=TOKENS_AXIS)
        row = dict(values)
        if MERGE_AXIS not in row:
            row[TOKENS_AXIS] = step
        run.log(row)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def flush(self) -> None:
        with self._lock:
            for w in self._tb.values():
                self._guard("tensorboard", w.flush)

    def close(self) -> None:
        """Flush and close every writer (W&B runs are finished: their offline files complete)."""
        with self._lock:
            for w in self._tb.values():
                self._guard("tensorboard", w.close)
            for r in self._wb.values():
                self._guard("wandb", r.finish)
            self._tb.clear()
            self._wb.clear()


NO_TRACKING = Tracker(None)


def write_hparams(logdir: Path, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> Path:
    """The run's settings and final figures for TensorBoard's HParams tab, in ``logdir`` (the run's
    ``tensorboard/`` folder): ``hparams`` (flat; values kept if str, bool, int or float, others
    dropped) and ``metrics`` (flat; finite numbers only, as scalars at step 0). Returns ``logdir``."""
    from tensorboardX import SummaryWriter
    from tensorboardX.summary import hparams as hparams_summaries

    hp = {k: v for k, v in hparams.items() if isinstance(v, str | bool | int | float)}
    mv = {k: float(v) for k, v in metrics.items() if _number(v) is not None}
    with SummaryWriter(logdir=str(logdir)) as writer:  # one session: the experiment, its start and end
        for summary in hparams_summaries(hp, mv):
            writer.file_writer.add_summary(summary)
        for k, v in mv.items():
            writer.add_scalar(k, v, global_step=0)
    return logdir
