"""Goodput at scale: a discrete-event failure simulator of a training cluster (paper Table 1).

Reproduces Table 1 of Decoupled DiLoCo (Douillard et al., arXiv 2604.21428, 2026): goodput of
data-parallel training without elasticity, elastic data-parallel training, and Decoupled DiLoCo with
M learners, on 150k … 2.4M chips whose chips are interrupted at random (per-chip mean time between
interruptions 1 year). Plain Python/NumPy/SciPy; no Prefect here (``flows/goodput.py`` wraps it).

Model (every constant is a field of :class:`GoodputConfig`; docs/goodput.md explains each)
-----------------------------------------------------------------------------------------
* **Cluster.** N chips in ``n = round(N / slice_chips)`` slices of ``N / n`` chips. A slice is the
  unit that fails, leaves and rejoins a job together.
* **Interruptions** strike a chip *while it runs a job*: a Poisson process of rate
  ``N_running / MTBI`` (MTBI = ``chip_mtbi_years``). Chips that sit idle during a pause are not
  interrupted (the pause in progress absorbs them). The trace is drawn once per (seed, N) at the full
  rate ``N / MTBI`` over the horizon and *thinned* by each system's state, so every system sees the
  same failure trace (common random numbers).
* **Recovery.** An interrupted slice is unavailable for R ~ exponentiated Weibull
  (``scipy.stats.exponweib(a, c, scale)``): the time until it (or a spare standing in for it) can be
  scheduled again.
* **Detection.** A failure is noticed ``detect_s`` after it happens; the job is hung until then.
* **Lost work.** Work since the last checkpoint is recomputed: elastic jobs and DiLoCo learners keep
  their state on the surviving replicas and lose the step in flight only (``step_s``); a non-elastic
  job rolls back to its last checkpoint (every ``checkpoint_every_steps`` steps).

Systems
-------
* ``dp`` (no elasticity): a failure stops the job; it restarts ``restart_s`` after the failed slice
  is back and the failure was detected: downtime = max(detect, R) + restart.
* ``elastic`` (slice-level elastic DP): a failure pauses the job for ``detect_s + downscale_s``, then
  it runs on the remaining slices. When a slice is back the job pauses ``upscale_s`` to take it in;
  a slice that comes back while the job is already paused joins at the end of that pause for free
  (the reconfiguration in progress takes it in). A job with no slice left waits for one.
* ``diloco-M``: M learners of N/M chips (``n/M`` slices each), each an elastic job on its own slices
  and its own failures; a learner's pause stops only that learner. The syncer (CPU) never fails.
  With quorum K, learner time is useful only while at least K learners run (below K the merges
  wait, and so, after their bounded staleness, do the learners).

Metrics
-------
* goodput = useful chip-seconds / allocated chip-seconds (N × horizon). Useful = chip-seconds spent
  running minus recomputed work; detection, pauses, waiting for slices, restarts and the capacity of
  slices out for recovery are not useful.
* uptime = fraction of the horizon during which the system as a whole advances: DP systems, the job
  runs; DiLoCo, at least K learners run (K = 1: at least one learner and the syncer).
* Confidence intervals over seeds (95 % by default): mean ± t(0.975, S−1) · sd / √S.

Closed forms the tests check: one slice, exponential failures, fixed repair: availability =
MTBF / (MTBF + MTTR); the number of interruptions in [0, T] has mean N·T / MTBI.
"""

from __future__ import annotations

import heapq
import math
import time
from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator
from scipy import optimize, stats

SECONDS_PER_YEAR = 365.0 * 24 * 3600

#: Table 1 of the paper: goodput (%) per system and chip count, per-chip MTBI = 1 year.
PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_TABLE1: dict[str, tuple[int, ...]] = {
    "dp": (72, 57, 38, 27, 18),
    "elastic": (88, 80, 69, 58, 40),
    "diloco-2": (94, 88, 80, 70, 54),
    "diloco-4": (96, 93, 89, 82, 73),
    "diloco-8": (98, 96, 94, 88, 80),
    "diloco-16": (99, 98, 96, 93, 86),
}
SYSTEM_LABELS = {"dp": "DP, no elasticity", "elastic": "DP, elastic (slice-level)"}
#: The rows calibration may use (the DiLoCo rows are predictions).
CALIBRATION_ROWS = ("dp", "elastic")
#: Constants fitted on the DP rows by :func:`calibrate`; the defaults below are its output.
CALIBRATED_FIELDS = ("restart_s", "downscale_s", "upscale_s")


def system_label(system: str) -> str:
    if system.startswith("diloco-"):
        return f"Decoupled DiLoCo M={system.split('-')[1]}"
    return SYSTEM_LABELS[system]


class GoodputConfig(BaseModel):
    """The simulator's knobs: cluster, failures, time constants (seconds), grid and statistics.

    Defaults: ``chip_mtbi_years`` is the paper's; ``restart_s``, ``downscale_s`` and ``upscale_s``
    are calibrated on the paper's two DP rows (:func:`calibrate`, ``calibrate=True`` reruns it);
    everything else is stated by us (docs/goodput.md gives the reasons).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Grid
    chips: list[PositiveInt] = Field(default_factory=lambda: list(PAPER_CHIPS),
                                     description="cluster sizes N (chips)")
    learners: list[PositiveInt] = Field(default_factory=lambda: [2, 4, 8, 16],
                                        description="Decoupled DiLoCo learner counts M")
    quorum: PositiveInt = Field(1, description="K: learners that must run for the global model to advance")
    # Failures and recovery (stated)
    chip_mtbi_years: PositiveFloat = Field(1.0, description="per-chip mean time between interruptions, years (paper)")
    slice_chips: PositiveInt = Field(256, description="chips per slice (fail, leave and rejoin together)")
    detect_s: float = Field(5.0, ge=0.0, description="failure detection time, s")
    recovery_a: PositiveFloat = Field(2.0, description="exponentiated Weibull exponent a (scipy exponweib)")
    recovery_c: PositiveFloat = Field(1.5, description="exponentiated Weibull Weibull shape c")
    recovery_scale_s: PositiveFloat = Field(24.0, description="exponentiated Weibull scale, s (mean 29.7 s)")
    step_s: PositiveFloat = Field(2.0, description="training step time, s (work in flight at a failure is lost)")
    checkpoint_every_steps: PositiveInt = Field(
        1, description="non-elastic DP rolls back to its last checkpoint, taken every this many steps")
    # Calibrated on the DP rows (see calibrate())
    restart_s: float = Field(46.59, ge=0.0, description="non-elastic restart (reschedule, re-compile, restore), s")
    downscale_s: float = Field(0.5, ge=0.0, description="elastic pause to drop a failed slice, s (after detection)")
    upscale_s: float = Field(22.37, ge=0.0, description="elastic pause to take a returned slice back, s")
    # Statistics
    failures_per_run: PositiveInt = Field(
        4000, description="horizon per run = this many expected interruptions of the full cluster")
    seeds: int = Field(10, ge=2, description="independent replications (confidence intervals need ≥ 2)")
    seed: int = Field(0, ge=0, description="base seed; the same seed gives the same numbers")
    confidence: float = Field(0.95, gt=0.0, lt=1.0, description="confidence level of the intervals")
    rule_of_thumb: bool = Field(True, description="also simulate elastic DP at N/M chips for each DiLoCo cell")
    calibrate: bool = Field(False, description="refit restart_s, downscale_s, upscale_s on the DP rows first")

    @model_validator(mode="after")
    def _check(self) -> "GoodputConfig":
        if not self.chips:
            raise ValueError("chips must list at least one cluster size")
        if len(set(self.chips)) != len(self.chips):
            raise ValueError(f"chips must not repeat a size: {self.chips}")
        if len(set(self.learners)) != len(self.learners):
            raise ValueError(f"learners must not repeat a count: {self.learners}")
        if self.quorum > min(self.learners, default=self.quorum):
            raise ValueError(f"quorum (K={self.quorum}) must be ≤ every entry of learners ({self.learners})")
        for n in self.chips:
            if round(n / self.slice_chips) < max(self.learners, default=1):
                raise ValueError(
                    f"chips: {n} chips make {round(n / self.slice_chips)} slices of slice_chips="
                    f"{self.slice_chips}, fewer than the largest learner count {max(self.learners)}")
        return self

    @property
    def systems(self) -> list[str]:
        return ["dp", "elastic"] + [f"diloco-{m}" for m in self.learners]

    @property
    def checkpoint_s(self) -> float:
        return self.step_s * self.checkpoint_every_steps

    @property
    def recovery(self):
        """The frozen recovery-delay distribution (seconds)."""
        return stats.exponweib(self.recovery_a, self.recovery_c, scale=self.recovery_scale_s)

    @property
    def mean_recovery_s(self) -> float:
        return float(self.recovery.mean())

    def horizon_s(self, chips: int) -> float:
        """Simulated time for one run at ``chips``: ``failures_per_run`` expected interruptions."""
        return self.failures_per_run * self.chip_mtbi_years * SECONDS_PER_YEAR / chips

    def constants(self) -> dict:
        """The time constants in one flat dict (for tables and the run directory)."""
        return {
            "chip_mtbi_years": self.chip_mtbi_years, "slice_chips": self.slice_chips,
            "detect_s": self.detect_s, "recovery_a": self.recovery_a, "recovery_c": self.recovery_c,
            "recovery_scale_s": self.recovery_scale_s, "mean_recovery_s": round(self.mean_recovery_s, 3),
            "step_s": self.step_s, "checkpoint_every_steps": self.checkpoint_every_steps,
            "restart_s": self.restart_s, "downscale_s": self.downscale_s, "upscale_s": self.upscale_s,
        }


# ---------------------------------------------------------------------------------------------
# Failure trace


@dataclass(frozen=True)
class Trace:
    """Interruptions of a cluster over [0, horizon_s): times (s, sorted), slice ids, recovery (s)."""

    times: np.ndarray
    slices: np.ndarray
    recovery: np.ndarray
    n_slices: int
    chips: int
    horizon_s: float

    @property
    def chips_per_slice(self) -> float:
        return self.chips / self.n_slices

    def subset(self, slice_ids: np.ndarray) -> "Trace":
        """The interruptions of ``slice_ids`` only, renumbered 0 … len(slice_ids)−1."""
        local = np.full(self.n_slices, -1, dtype=np.int64)
        local[slice_ids] = np.arange(len(slice_ids))
        keep = local[self.slices] >= 0
        return Trace(self.times[keep], local[self.slices[keep]], self.recovery[keep], len(slice_ids),
                     self.chips * len(slice_ids) / self.n_slices, self.horizon_s)


def n_slices(cfg: GoodputConfig, chips: int) -> int:
    return max(1, round(chips / cfg.slice_chips))


def failure_trace(cfg: GoodputConfig, chips: int, rng: np.random.Generator,
                  horizon_s: float | None = None) -> Trace:
    """Poisson interruptions of ``chips`` chips at the full rate N / MTBI, each on a uniformly drawn
    slice (slices have equal size), with a recovery delay drawn from ``cfg.recovery``."""
    horizon = cfg.horizon_s(chips) if horizon_s is None else horizon_s
    rate = chips / (cfg.chip_mtbi_years * SECONDS_PER_YEAR)
    count = rng.poisson(rate * horizon)
    times = np.sort(rng.uniform(0.0, horizon, count))
    n = n_slices(cfg, chips)
    slices = rng.integers(0, n, count)
    recovery = cfg.recovery.rvs(size=count, random_state=rng) if count else np.zeros(0)
    return Trace(times, slices, np.asarray(recovery, dtype=float), n, chips, horizon)


# ---------------------------------------------------------------------------------------------
# Jobs


@dataclass
class JobRun:
    """One job's timeline: running intervals [start, end) with the chips running in each, and the
    chip-seconds of work lost (recomputed) at the end of each interval."""

    starts: list = field(default_factory=list)
    ends: list = field(default_factory=list)
    chips: list = field(default_factory=list)
    lost: list = field(default_factory=list)
    failures: int = 0      # interruptions that hit the running job
    upscales: int = 0      # pauses taken only to take returned slices back
    coalesced: int = 0     # returned slices taken in by a pause already in progress

    def useful_chip_s(self) -> float:
        run = sum((e - s) * c for s, e, c in zip(self.starts, self.ends, self.chips))
        return run - sum(self.lost)

    def running_s(self) -> float:
        return sum(e - s for s, e in zip(self.starts, self.ends))


def simulate_dp(trace: Trace, cfg: GoodputConfig) -> JobRun:
    """Non-elastic DP on all of ``trace``'s chips: each interruption of the running job costs the work
    since the last checkpoint, then downtime max(detect, R) + restart. Interruptions while the job is
    down strike idle chips and are absorbed."""
    times = trace.times.tolist()
    rec = trace.recovery.tolist()
    horizon, chips, ckpt = trace.horizon_s, trace.chips, cfg.checkpoint_s
    detect, restart = cfg.detect_s, cfg.restart_s
    job = JobRun()
    resume, i, n = 0.0, 0, len(times)
    while resume < horizon:
        i = bisect_left(times, resume, i)
        if i >= n:
            end = horizon
        else:
            end = times[i]
        job.starts.append(resume)
        job.ends.append(end)
        job.chips.append(chips)
        if i >= n:
            job.lost.append(0.0)
            break
        job.lost.append(((end - resume) % ckpt) * chips)
        job.failures += 1
        resume = end + max(detect, rec[i]) + restart
        i += 1
    return job


def simulate_elastic(trace: Trace, cfg: GoodputConfig) -> JobRun:
    """Slice-level elastic DP on ``trace``'s slices (see the module docstring).

    Event loop over interruptions (pre-drawn, sorted), slice returns (a heap) and the end of the
    current pause. Slice states: in the job, out for recovery, or back and waiting to join.
    """
    times = trace.times.tolist()
    slices = trace.slices.tolist()
    rec = trace.recovery.tolist()
    horizon, cps, step = trace.horizon_s, trace.chips_per_slice, cfg.step_s
    detect, down, up = cfg.detect_s, cfg.downscale_s, cfg.upscale_s
    inf = math.inf
    in_job = [True] * trace.n_slices
    waiting: list[int] = []          # back from recovery, joining at the end of the current pause
    returns: list[tuple[float, int]] = []
    n_active = trace.n_slices
    running, run_start, pause_end = True, 0.0, inf
    job = JobRun()
    i, nf = 0, len(times)
    tf = times[0] if nf else inf
    while True:
        tr = returns[0][0] if returns else inf
        tp = inf if running else pause_end
        if tp <= tr and tp <= tf:                       # the pause ends
            if tp >= horizon:
                break
            for j in waiting:
                in_job[j] = True
            n_active += len(waiting)
            waiting.clear()
            if n_active:
                running, run_start = True, tp
            else:
                pause_end = inf                         # nothing to run on: wait for a slice
            continue
        if tr <= tf:                                    # a slice is back
            if tr >= horizon:
                break
            j = heapq.heappop(returns)[1]
            waiting.append(j)
            if running:
                job.starts.append(run_start)
                job.ends.append(tr)
                job.chips.append(n_active * cps)
                job.lost.append(0.0)                    # an upscale waits for the step boundary
                running, pause_end = False, tr + up
                job.upscales += 1
            elif pause_end == inf:                      # waiting with no slice: take this one in
                pause_end = tr + up
                job.upscales += 1
            else:
                job.coalesced += 1
            continue
        if tf >= horizon:
            break
        j = slices[i]
        r = rec[i]
        i += 1
        t, tf = tf, (times[i] if i < nf else inf)
        if not running or not in_job[j]:
            continue                                    # idle chips are not interrupted
        job.starts.append(run_start)
        job.ends.append(t)
        job.chips.append(n_active * cps)
        job.lost.append(((t - run_start) % step) * n_active * cps)
        job.failures += 1
        in_job[j] = False
        n_active -= 1
        heapq.heappush(returns, (t + r, j))
        running, pause_end = False, t + detect + down
    if running:
        job.starts.append(run_start)
        job.ends.append(horizon)
        job.chips.append(n_active * cps)
        job.lost.append(0.0)
    return job


def learner_slices(n: int, learners: int) -> list[np.ndarray]:
    """Slices 0 … n−1 split into ``learners`` contiguous groups whose sizes differ by at most one."""
    return np.array_split(np.arange(n), learners)


def _quorum_sweep(jobs: list[JobRun], quorum: int, horizon: float) -> tuple[float, float]:
    """(useful chip-seconds while ≥ quorum jobs run, seconds during which ≥ quorum jobs run)."""
    starts = np.concatenate([np.asarray(j.starts, float) for j in jobs])
    ends = np.concatenate([np.asarray(j.ends, float) for j in jobs])
    chips = np.concatenate([np.asarray(j.chips, float) for j in jobs])
    lost = np.concatenate([np.asarray(j.lost, float) for j in jobs])
    t = np.concatenate([starts, ends])
    dn = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
    dc = np.concatenate([chips, -chips])
    dl = np.concatenate([np.zeros_like(starts), lost])
    order = np.lexsort((dn, t))                       # ends before starts at equal times
    t, dn, dc, dl = t[order], dn[order], dc[order], dl[order]
    count = np.cumsum(dn)                             # jobs running after each boundary
    running_chips = np.cumsum(dc)
    dt = np.diff(t, append=horizon)
    up = count >= quorum
    up_s = float(dt[up].sum())
    useful = float((running_chips * dt)[up].sum())
    before = np.concatenate([[0.0], count[:-1]])      # jobs running just before each boundary
    useful -= float(dl[before >= quorum].sum())
    return useful, up_s


@dataclass
class Outcome:
    goodput: float
    uptime: float
    failures: int = 0
    upscales: int = 0
    coalesced: int = 0


def _job_outcome(job: JobRun, trace: Trace) -> Outcome:
    return Outcome(job.useful_chip_s() / (trace.chips * trace.horizon_s), job.running_s() / trace.horizon_s,
                   job.failures, job.upscales, job.coalesced)


def simulate_diloco(trace: Trace, cfg: GoodputConfig, learners: int, quorum: int | None = None) -> Outcome:
    """Decoupled DiLoCo: ``learners`` elastic jobs on disjoint slice groups of ``trace``."""
    k = cfg.quorum if quorum is None else quorum
    jobs = [simulate_elastic(trace.subset(ids), cfg) for ids in learner_slices(trace.n_slices, learners)]
    useful, up_s = _quorum_sweep(jobs, k, trace.horizon_s)
    return Outcome(useful / (trace.chips * trace.horizon_s), up_s / trace.horizon_s,
                   sum(j.failures for j in jobs), sum(j.upscales for j in jobs), sum(j.coalesced for j in jobs))


def simulate_system(system: str, trace: Trace, cfg: GoodputConfig) -> Outcome:
    if system == "dp":
        return _job_outcome(simulate_dp(trace, cfg), trace)
    if system == "elastic":
        return _job_outcome(simulate_elastic(trace, cfg), trace)
    if system.startswith("diloco-"):
        return simulate_diloco(trace, cfg, int(system.split("-")[1]))
    raise ValueError(f"unknown system {system!r}")


# ---------------------------------------------------------------------------------------------
# Grid, statistics, calibration


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


def simulate_grid(cfg: GoodputConfig, systems: list[str] | None = None,
                  chips: list[int] | None = None) -> dict[tuple[str, int], list[Outcome]]:
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
        cells.append({
            "system": system, "label": system_label(system), "chips": n,
            "goodput": g, "goodput_ci": g_ci, "uptime": u, "uptime_ci": u_ci,
            "goodput_seeds": _percent(o.goodput for o in outs),
            "failures_mean": float(np.mean([o.failures for o in outs])),
            "paper": pv, "diff": None if pv is None else g - pv,
            "role": "calibration" if system in CALIBRATION_ROWS else "prediction",
        })
    rule = []
    if cfg.rule_of_thumb:
        # Elastic DP at N/M: reuse the grid's cells where N/M is a grid size, simulate the rest.
        small = sorted({n // m for n in cfg.chips for m in cfg.learners if n % m == 0} - set(cfg.chips))
        elastic = simulate_grid(cfg.model_copy(update={"learners": [1], "quorum": 1}),
                                systems=["elastic"], chips=small)
        by = {c["chips"]: c for c in cells if c["system"] == "elastic"}
        for m in cfg.learners:
            for n in cfg.chips:
                if n % m:
                    continue
                dl = next(c for c in cells if c["system"] == f"diloco-{m}" and c["chips"] == n)
                e = by.get(n // m)
                eg = (e["goodput"], e["goodput_ci"]) if e else confidence_interval(
                    _percent(o.goodput for o in elastic[("elastic", n // m)]), cfg.confidence)
                rule.append({"learners": m, "chips": n, "diloco": dl["goodput"], "diloco_ci": dl["goodput_ci"],
                             "elastic_chips": n // m, "elastic": eg[0], "elastic_ci": eg[1],
                             "diff": dl["goodput"] - eg[0]})
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
    res2 = optimize.minimize(el_loss, x0=start, method="Nelder-Mead", bounds=[(0.0, 600.0), (0.0, 600.0)],
                             options={"xatol": 0.05, "fatol": 1e-3, "maxfev": 120, "initial_simplex": simplex})
    down, up = (float(v) for v in res2.x)
    fitted = base.model_copy(update={"restart_s": restart, "downscale_s": down, "upscale_s": up})
    return {
        "constants": {"restart_s": round(restart, 2), "downscale_s": round(down, 2), "upscale_s": round(up, 2)},
        "rmse": {"dp": math.sqrt(res.fun), "elastic": math.sqrt(res2.fun)},
        "fitted": {"dp": _row_goodputs(fitted, "dp", seeds).round(2).tolist(),
                   "elastic": _row_goodputs(fitted, "elastic", seeds).round(2).tolist()},
        "seeds": seeds, "failures_per_run": failures_per_run,
        "wall_s": time.perf_counter() - t0,
    }


# ---------------------------------------------------------------------------------------------
# Report text


def _pm(mean: float, half: float) -> str:
    """``mean ± half`` with one decimal, two for half-widths under 0.1 (so a tight interval is not 0.0)."""
    return f"{mean:.1f} ± {half:.2f}" if half < 0.095 else f"{mean:.1f} ± {half:.1f}"


def _chips_label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def markdown_report(result: dict) -> str:
    """The study as markdown: goodput (predicted ± CI, paper, difference), uptime, the rule of thumb,
    the constants (stated or calibrated) and the worst DiLoCo cell."""
    cfg = GoodputConfig.model_validate(result["config"])
    chips = sorted(cfg.chips)
    cell = {(c["system"], c["chips"]): c for c in result["cells"]}
    head = "| system | role | " + " | ".join(_chips_label(n) for n in chips) + " |"
    rule = "|---|---|" + "---|" * len(chips)
    lines = [
        "# Goodput at scale: simulated Table 1 of Decoupled DiLoCo (arXiv 2604.21428)",
        "",
        f"Per-chip MTBI {cfg.chip_mtbi_years:g} year(s); {cfg.seeds} seeds (base seed {cfg.seed}) × "
        f"{cfg.failures_per_run} expected interruptions per run; ± is the {cfg.confidence:.0%} confidence "
        f"interval over seeds. Grid wall time {result['wall_s']:.1f} s.",
        "",
        "## Goodput (%): predicted ± CI (paper, predicted − paper)",
        "",
        "Calibration rows were fitted to the paper (only `restart_s`, `downscale_s`, `upscale_s`); the "
        "Decoupled DiLoCo rows are predictions.",
        "",
        head, rule,
    ]
    fields = GoodputConfig.model_fields
    changed = [k for k in (*result["constants"], "quorum") if k in fields
               and k not in (CALIBRATED_FIELDS if result.get("calibration") else ())
               and getattr(cfg, k) != fields[k].default]
    if changed:
        lines[-3:-3] = ["", f"This run changes {', '.join(f'`{k}`' for k in changed)} from the defaults, so the "
                        "differences from the paper show the effect of that change, not the model's error."]
    for s in cfg.systems:
        row = []
        for n in chips:
            c = cell[(s, n)]
            txt = _pm(c["goodput"], c["goodput_ci"])
            if c["paper"] is not None:
                txt += f" ({c['paper']}, {c['diff']:+.1f})"
            row.append(txt)
        role = "calibration" if s in CALIBRATION_ROWS else "prediction"
        lines.append(f"| {system_label(s)} | {role} | " + " | ".join(row) + " |")
    w = result.get("worst")
    lines.append("")
    if w:
        lines.append(f"**Worst Decoupled DiLoCo cell:** {system_label(w['system'])} at {_chips_label(w['chips'])} "
                     f"chips: predicted {w['goodput']:.1f} vs paper {w['paper']} ({w['diff']:+.1f} points).")
    if result.get("calibration_rmse") is not None:
        lines.append(f"RMS error on the two calibration rows: {result['calibration_rmse']:.1f} points.")
    lines += ["", "## Uptime (%): time the system as a whole advances", "",
              f"DP: the job runs. Decoupled DiLoCo: at least K = {cfg.quorum} learner(s) run.", "", head, rule]
    for s in cfg.systems:
        row = [_pm(cell[(s, n)]["uptime"], cell[(s, n)]["uptime_ci"]) for n in chips]
        lines.append(f"| {system_label(s)} | | " + " | ".join(row) + " |")
    if result.get("rule_of_thumb"):
        lines += ["", "## Rule of thumb: M learners at N chips ≈ one elastic job at N/M chips", "",
                  "| M | N | Decoupled DiLoCo at N | elastic DP at N/M | difference |", "|---|---|---|---|---|"]
        for r in result["rule_of_thumb"]:
            lines.append(f"| {r['learners']} | {_chips_label(r['chips'])} | {_pm(r['diloco'], r['diloco_ci'])} | "
                         f"{_pm(r['elastic'], r['elastic_ci'])} ({_chips_label(r['elastic_chips'])}) | "
                         f"{r['diff']:+.1f} |")
    lines += ["", "## Constants", "", "| constant | value | source |", "|---|---|---|"]
    calibrated = set(result.get("calibrated", ()))
    for k, v in result["constants"].items():
        if k == "mean_recovery_s":
            src = "derived from the recovery distribution"
        elif k in calibrated and result.get("calibration"):
            src = "calibrated on the DP rows in this run"
        elif v != fields[k].default:
            src = f"set for this run (default {fields[k].default:g})"
        elif k in calibrated:
            src = "calibrated on the DP rows (shipped default)"
        else:
            src = "paper" if k == "chip_mtbi_years" else "stated"
        lines.append(f"| `{k}` | {v:g} | {src} |")
    if result.get("calibration"):
        cal = result["calibration"]
        lines += ["", f"Calibration ran in this job ({cal['wall_s']:.1f} s, {cal['seeds']} seeds × "
                      f"{cal['failures_per_run']} interruptions): RMS {cal['rmse']['dp']:.2f} (DP) and "
                      f"{cal['rmse']['elastic']:.2f} (elastic) points."]
    return "\n".join(lines) + "\n"
