"""The simulated systems: non-elastic DP, slice-level elastic DP and Decoupled DiLoCo with M learners.

Each job is an event loop over a pre-drawn :class:`sim.trace.Trace` (interruptions), slice returns
(a heap) and the end of the current pause; its timeline (:class:`JobRun`) gives the useful
chip-seconds and the running time. Times in seconds, capacity in chips. The model is in :mod:`sim`.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

from sim.config import GoodputConfig
from sim.trace import Trace


@dataclass
class JobRun:
    """One job's timeline: running intervals [start, end) with the chips running in each, and the
    chip-seconds of work lost (recomputed) at the end of each interval."""

    starts: list = field(default_factory=list)
    ends: list = field(default_factory=list)
    chips: list = field(default_factory=list)
    lost: list = field(default_factory=list)
    failures: int = 0  # interruptions that hit the running job
    upscales: int = 0  # pauses taken only to take returned slices back
    coalesced: int = 0  # returned slices taken in by a pause already in progress

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
    waiting: list[int] = []  # back from recovery, joining at the end of the current pause
    returns: list[tuple[float, int]] = []
    n_active = trace.n_slices
    running, run_start, pause_end = True, 0.0, inf
    job = JobRun()
    i, nf = 0, len(times)
    tf = times[0] if nf else inf
    while True:
        tr = returns[0][0] if returns else inf
        tp = inf if running else pause_end
        if tp <= tr and tp <= tf:  # the pause ends
            if tp >= horizon:
                break
            for j in waiting:
                in_job[j] = True
            n_active += len(waiting)
            waiting.clear()
            if n_active:
                running, run_start = True, tp
            else:
                pause_end = inf  # nothing to run on: wait for a slice
            continue
        if tr <= tf:  # a slice is back
            if tr >= horizon:
                break
            j = heapq.heappop(returns)[1]
            waiting.append(j)
            if running:
                job.starts.append(run_start)
                job.ends.append(tr)
                job.chips.append(n_active * cps)
                job.lost.append(0.0)  # an upscale waits for the step boundary
                running, pause_end = False, tr + up
                job.upscales += 1
            elif pause_end == inf:  # waiting with no slice: take this one in
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
            continue  # idle chips are not interrupted
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


def quorum_sweep(jobs: list[JobRun], quorum: int, horizon: float) -> tuple[float, float]:
    """(useful chip-seconds while ≥ quorum jobs run, seconds during which ≥ quorum jobs run)."""
    starts = np.concatenate([np.asarray(j.starts, float) for j in jobs])
    ends = np.concatenate([np.asarray(j.ends, float) for j in jobs])
    chips = np.concatenate([np.asarray(j.chips, float) for j in jobs])
    lost = np.concatenate([np.asarray(j.lost, float) for j in jobs])
    t = np.concatenate([starts, ends])
    dn = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
    dc = np.concatenate([chips, -chips])
    dl = np.concatenate([np.zeros_like(starts), lost])
    order = np.lexsort((dn, t))  # ends before starts at equal times
    t, dn, dc, dl = t[order], dn[order], dc[order], dl[order]
    count = np.cumsum(dn)  # jobs running after each boundary
    running_chips = np.cumsum(dc)
    dt = np.diff(t, append=horizon)
    up = count >= quorum
    up_s = float(dt[up].sum())
    useful = float((running_chips * dt)[up].sum())
    before = np.concatenate([[0.0], count[:-1]])  # jobs running just before each boundary
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
    return Outcome(
        job.useful_chip_s() / (trace.chips * trace.horizon_s),
        job.running_s() / trace.horizon_s,
        job.failures,
        job.upscales,
        job.coalesced,
    )


def simulate_diloco(trace: Trace, cfg: GoodputConfig, learners: int, quorum: int | None = None) -> Outcome:
    """Decoupled DiLoCo: ``learners`` elastic jobs on disjoint slice groups of ``trace``."""
    k = cfg.quorum if quorum is None else quorum
    jobs = [simulate_elastic(trace.subset(ids), cfg) for ids in learner_slices(trace.n_slices, learners)]
    useful, up_s = quorum_sweep(jobs, k, trace.horizon_s)
    return Outcome(
        useful / (trace.chips * trace.horizon_s),
        up_s / trace.horizon_s,
        sum(j.failures for j in jobs),
        sum(j.upscales for j in jobs),
        sum(j.coalesced for j in jobs),
    )


def simulate_system(system: str, trace: Trace, cfg: GoodputConfig) -> Outcome:
    if system == "dp":
        return _job_outcome(simulate_dp(trace, cfg), trace)
    if system == "elastic":
        return _job_outcome(simulate_elastic(trace, cfg), trace)
    if system.startswith("diloco-"):
        return simulate_diloco(trace, cfg, int(system.split("-")[1]))
    raise ValueError(f"unknown system {system!r}")
