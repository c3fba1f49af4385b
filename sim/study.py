"""The goodput study: every (system, N) cell over seeds, confidence intervals, the comparison with
the paper's Table 1, the rule of thumb (M learners at N chips vs elastic DP at N/M), and the
calibration of the three unknown pauses on the paper's DP rows.
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy import optimize, stats

from sim.config import CALIBRATED_FIELDS, CALIBRATION_ROWS, PAPER_CHIPS, PAPER_TABLE1, GoodputConfig, system_label
from sim.jobs import Outcome, simulate_system
from sim.trace import failure_trace


def _rng(cfg: GoodputConfig, replica: int, chips: int) -> np.random.Generator:
    # One stream per (base seed, replica, cluster size): every system at that size sees the same trace.
    return np.random.default_rng([cfg.seed, replica, chips])


def confidence_interval(values, confidence: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of a Student-t interval over replications."""
    x = np.asarray(values, float)
    if len(x) < 2:
        return float(x.mean()), float("nan")
    half = stats.t.ppf(0.5 + confidence / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean()), float(half)


def simulate_grid(
    cfg: GoodputConfig, systems: list[str] | None = None, chips: list[int] | None = None
) -> dict[tuple[str, int], list[Outcome]]:
    """Every (system, N) cell, ``cfg.seeds`` replications each; the same trace for all systems."""
    systems = cfg.systems if systems is None else systems
    out: dict[tuple[str, int], list[Outcome]] = {(s, n): [] for s in systems for n in (chips or cfg.chips)}
    for n in chips or cfg.chips:
        for r in range(cfg.seeds):
            trace = failure_trace(cfg, n, _rng(cfg, r, n))
            for s in systems:
                out[(s, n)].append(simulate_system(s, trace, cfg))
    return out


def _percent(values) -> list[float]:
    return [100.0 * v for v in values]


def run_goodput(cfg: GoodputConfig) -> dict:
    """The whole study: calibrate if asked, simulate the grid, compare with Table 1.

    Returns a JSON-ready dict: ``config``, ``constants`` (+ which are calibrated), ``cells`` (one per
    system and N: goodput and uptime in %, CI half-widths, per-seed values, the paper's value and
    the difference), ``rule_of_thumb`` (DiLoCo M at N vs elastic DP at N/M), ``worst`` (largest
    |predicted − paper| over the DiLoCo cells that have a paper value) and ``wall_s``.
    """
    t0 = time.perf_counter()
    calibration = None
    if cfg.calibrate:
        calibration = calibrate(cfg)
        cfg = cfg.model_copy(update={**calibration["constants"], "calibrate": False})
    grid = simulate_grid(cfg)
    paper_col = {n: i for i, n in enumerate(PAPER_CHIPS)}
    cells = []
    for (system, n), outs in grid.items():
        g, g_ci = confidence_interval(_percent(o.goodput for o in outs), cfg.confidence)
        u, u_ci = confidence_interval(_percent(o.uptime for o in outs), cfg.confidence)
        paper = PAPER_TABLE1.get(system, ())
        pv = paper[paper_col[n]] if n in paper_col and paper else None
        cells.append(
            {
                "system": system,
                "label": system_label(system),
                "chips": n,
                "goodput": g,
                "goodput_ci": g_ci,
                "uptime": u,
                "uptime_ci": u_ci,
                "goodput_seeds": _percent(o.goodput for o in outs),
                "failures_mean": float(np.mean([o.failures for o in outs])),
                "paper": pv,
                "diff": None if pv is None else g - pv,
                "role": "calibration" if system in CALIBRATION_ROWS else "prediction",
            }
        )
    rule = []
    if cfg.rule_of_thumb:
        # Elastic DP at N/M: reuse the grid's cells where N/M is a grid size, simulate the rest.
        small = sorted({n // m for n in cfg.chips for m in cfg.learners if n % m == 0} - set(cfg.chips))
        elastic = simulate_grid(cfg.model_copy(update={"learners": [1], "quorum": 1}), systems=["elastic"], chips=small)
        by = {c["chips"]: c for c in cells if c["system"] == "elastic"}
        for m in cfg.learners:
            for n in cfg.chips:
                if n % m:
                    continue
                dl = next(c for c in cells if c["system"] == f"diloco-{m}" and c["chips"] == n)
                e = by.get(n // m)
                eg = (
                    (e["goodput"], e["goodput_ci"])
                    if e
                    else confidence_interval(_percent(o.goodput for o in elastic[("elastic", n // m)]), cfg.confidence)
                )
                rule.append(
                    {
                        "learners": m,
                        "chips": n,
                        "diloco": dl["goodput"],
                        "diloco_ci": dl["goodput_ci"],
                        "elastic_chips": n // m,
                        "elastic": eg[0],
                        "elastic_ci": eg[1],
                        "diff": dl["goodput"] - eg[0],
                    }
                )
    preds = [c for c in cells if c["role"] == "prediction" and c["paper"] is not None]
    worst = max(preds, key=lambda c: abs(c["diff"]), default=None)
    calib = [c for c in cells if c["role"] == "calibration" and c["paper"] is not None]
    return {
        "config": cfg.model_dump(mode="json"),
        "constants": cfg.constants(),
        "calibrated": list(CALIBRATED_FIELDS),
        "calibration": calibration,
        "cells": cells,
        "rule_of_thumb": rule,
        "worst": None if worst is None else {k: worst[k] for k in ("system", "chips", "goodput", "paper", "diff")},
        "calibration_rmse": (float(np.sqrt(np.mean([c["diff"] ** 2 for c in calib]))) if calib else None),
        "wall_s": time.perf_counter() - t0,
    }


def _row_goodputs(cfg: GoodputConfig, system: str, seeds: int) -> np.ndarray:
    """Mean goodput (%) of ``system`` at the paper's sizes, over ``seeds`` fixed traces."""
    grid = simulate_grid(cfg.model_copy(update={"seeds": seeds}), systems=[system], chips=list(PAPER_CHIPS))
    return np.asarray([100.0 * float(np.mean([o.goodput for o in grid[(system, n)]])) for n in PAPER_CHIPS])


def calibrate(cfg: GoodputConfig, seeds: int = 8, failures_per_run: int = 4000) -> dict:
    """Fit ``restart_s`` on the non-elastic DP row and (``downscale_s``, ``upscale_s``) on the elastic
    row of Table 1, by least squares in goodput points, with every other constant as stated.

    The two fits are independent (restart_s only affects ``dp``; the elastic pauses only ``elastic``):
    a bounded scalar search for the first, a 5 × 5 grid then Nelder-Mead for the second.
    Common random numbers (fixed traces) make the objectives deterministic. The DiLoCo rows are never
    looked at. Returns ``{"constants": {...}, "rmse": {...}, "fitted": {...}, "wall_s": ...}``.
    """
    t0 = time.perf_counter()
    base = cfg.model_copy(update={"failures_per_run": failures_per_run})
    dp_target = np.asarray(PAPER_TABLE1["dp"], float)
    el_target = np.asarray(PAPER_TABLE1["elastic"], float)

    def dp_loss(restart):
        c = base.model_copy(update={"restart_s": float(restart)})
        return float(np.mean((_row_goodputs(c, "dp", seeds) - dp_target) ** 2))

    res = optimize.minimize_scalar(dp_loss, bounds=(0.0, 600.0), method="bounded", options={"xatol": 0.05})
    restart = float(res.x)

    def el_loss(x):
        down, up = x
        c = base.model_copy(update={"downscale_s": float(down), "upscale_s": float(up)})
        return float(np.mean((_row_goodputs(c, "elastic", seeds) - el_target) ** 2))

    # The elastic objective is bumpy (a pause that moves a few events changes it in steps), so a
    # coarse grid picks the basin and Nelder-Mead refines it.
    coarse = [(d, u) for d in (0.0, 3.0, 6.0, 9.0, 12.0) for u in (0.0, 8.0, 16.0, 24.0, 32.0)]
    start = min(coarse, key=el_loss)
    simplex = [start, (start[0] + 1.5, start[1]), (start[0], start[1] + 4.0)]
    res2 = optimize.minimize(
        el_loss,
        x0=start,
        method="Nelder-Mead",
        bounds=[(0.0, 600.0), (0.0, 600.0)],
        options={"xatol": 0.05, "fatol": 1e-3, "maxfev": 120, "initial_simplex": simplex},
    )
    down, up = (float(v) for v in res2.x)
    fitted = base.model_copy(update={"restart_s": restart, "downscale_s": down, "upscale_s": up})
    return {
        "constants": {"restart_s": round(restart, 2), "downscale_s": round(down, 2), "upscale_s": round(up, 2)},
        "rmse": {"dp": math.sqrt(res.fun), "elastic": math.sqrt(res2.fun)},
        "fitted": {
            "dp": _row_goodputs(fitted, "dp", seeds).round(2).tolist(),
            "elastic": _row_goodputs(fitted, "elastic", seeds).round(2).tolist(),
        },
        "seeds": seeds,
        "failures_per_run": failures_per_run,
        "wall_s": time.perf_counter() - t0,
    }


def simulate_goodput(knobs: dict, systems: list[str]) -> dict:
    """The simulator on one run's knobs, for a report's Resilience section: ``knobs`` are
    :class:`GoodputConfig` fields (``reports.resilience.simulator_knobs`` derives them from a chaos
    run); per system in ``systems`` its mean goodput and uptime (fractions) over the seeds, with
    half-widths of the ``confidence`` interval (Student t), and the mean number of interruptions."""
    cfg = GoodputConfig(**knobs)
    out = {}
    for (system, _), runs in simulate_grid(cfg, systems=systems).items():
        g, g_ci = confidence_interval([o.goodput for o in runs], cfg.confidence)
        u, u_ci = confidence_interval([o.uptime for o in runs], cfg.confidence)
        out[system] = {
            "goodput": g,
            "goodput_ci": g_ci,
            "uptime": u,
            "uptime_ci": u_ci,
            "failures_mean": sum(o.failures for o in runs) / len(runs),
        }
    return out
