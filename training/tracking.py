"""A method's :class:`run.tracking.Tracker` from the run's config (``tracking`` section).

The trainers call :func:`method_tracker` once per stage, method and process, hand its sinks to their
``JsonlWriter``s and close it when they end; :func:`run_hparams` writes the run's settings and final
figures for TensorBoard's HParams tab when the report is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from configs.schema import ExperimentConfig
from configs.tracking import TrackingConfig
from run.layout import RunLayout
from run.tracking import NO_TRACKING, Tracker, write_hparams
from training.peaks import device_peak_flops


def run_label(run_dir: str | Path) -> str:
    """The run's name as trackers show it: the run directory's name, or ``<run>/seed-<s>`` for one
    seed of a run of several seeds (``RUN/seeds/seed-<s>``)."""
    p = Path(run_dir)
    return f"{p.parent.parent.name}/{p.name}" if p.parent.name == "seeds" else p.name


def peak_flops(tracking: TrackingConfig, compute: str, devices: int = 1) -> float | None:
    """Peak FLOP/s of ``devices`` devices like JAX's first one: ``tracking.peak_tflops`` if set, else
    the datasheet figure for the ``compute`` dtype (``precision.compute``, ``training.peaks``); None
    when unknown (a CPU)."""
    if tracking.peak_tflops is not None:
        return tracking.peak_tflops * 1e12 * devices
    import jax

    got = device_peak_flops(jax.devices()[0].device_kind, compute)
    return None if got is None else got[0] * devices


def method_tracker(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    stage: str,
    method: str,
    *,
    flops_per_token: float | None = None,
    devices: int = 1,
) -> Tracker:
    """The tracker of ``<stage>/<method>`` of the run in ``run_dir``: TensorBoard under
    ``RunLayout.tensorboard(stage, method)`` when ``tracking.tensorboard``, W&B runs (group: the run,
    name ``<run>/<stage>-<method>``, the config as W&B config) under ``RUN/wandb/`` when
    ``tracking.wandb``; :data:`run.tracking.NO_TRACKING` when neither. ``flops_per_token`` and
    ``devices`` (how many devices one writer trains on) give the logged MFU (:func:`peak_flops`)."""
    t = cfg.tracking
    if not (t.tensorboard or t.wandb):
        return NO_TRACKING
    layout = RunLayout(run_dir)
    wandb = None
    if t.wandb:
        Path(layout.wandb).mkdir(parents=True, exist_ok=True)
        label = run_label(run_dir)
        wandb = {
            "project": t.wandb_project,
            "entity": t.wandb_entity,
            "group": label,
            "name": f"{label}/{stage}-{method}",
            "job_type": f"{stage}-{method}",
            "dir": str(layout.root),  # W&B writes into <dir>/wandb/
            "mode": t.wandb_mode,
            "config": cfg.model_dump(mode="json"),
        }
    return Tracker(
        Path(layout.tensorboard(stage, method)) if t.tensorboard else None,
        wandb,
        flops_per_token=flops_per_token,
        peak_flops=peak_flops(t, cfg.precision.compute, devices) if flops_per_token else None,
        flush_s=t.flush_s,
    )


def flat_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config's scalar settings (``config``: its JSON form, ``model_dump(mode="json")``) as dotted
    keys (``diloco.sync_every``: 8), the hyperparameters TensorBoard's HParams tab compares runs by;
    lists and unset values left out."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, str | bool | int | float):
            out[prefix] = value

    walk("", config)
    return out


def report_figures(report: Mapping[str, Any]) -> dict[str, float]:
    """The headline figures of a built report (``reports.build_report``'s ``verdict``) as flat
    metrics for the HParams tab: ``final/test_loss/<method>`` (nats per token or image, the mean over
    seeds), ``final/gap_pct`` (DiLoCo − DP, %), ``final/bytes_per_token/<method>``,
    ``final/modelled_wall_s/<method>`` (seconds), ``final/goodput`` and ``final/uptime`` (fractions),
    ``final/post/<method>`` (the post-training score). Figures the report lacks are left out."""
    v = report.get("verdict") or {}
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)

    for m, stats in (v.get("loss") or {}).items():
        put(f"final/test_loss/{m}", (stats or {}).get("mean"))
    put("final/gap_pct", (v.get("gap_pct") or {}).get("mean"))
    for key in ("bytes_per_token", "modelled_wall_s"):
        for m, x in (v.get(key) or {}).items():
            put(f"final/{key}/{m}", x)
    put("final/goodput", v.get("goodput"))
    put("final/uptime", v.get("uptime"))
    for m, x in ((v.get("post") or {}).get("scores") or {}).items():
        put(f"final/post/{m}", x)
    return out


def run_hparams(
    tracking: TrackingConfig, config: Mapping[str, Any], run_dir: str | Path, metrics: Mapping[str, float]
) -> Path | None:
    """Write the run's settings (``config``, its JSON form, through :func:`flat_settings`) and
    ``metrics`` (final figures, e.g. ``final/diloco/test_loss``) to ``RUN/tensorboard/`` for the
    HParams tab; None when ``tracking.tensorboard`` is off."""
    if not tracking.tensorboard:
        return None
    return write_hparams(Path(RunLayout(run_dir).run_tensorboard), flat_settings(config), metrics)
