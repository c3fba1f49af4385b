"""Goodput at scale: a discrete-event failure simulator of a training cluster (paper Table 1).

Reproduces Table 1 of Decoupled DiLoCo (Douillard et al., arXiv 2604.21428, 2026): goodput of
data-parallel training without elasticity, elastic data-parallel training, and Decoupled DiLoCo with
M learners, on 150k … 2.4M chips whose chips are interrupted at random (per-chip mean time between
interruptions 1 year). Plain Python/NumPy/SciPy; no Prefect here (``flows/goodput.py`` wraps it),
and nothing of the training runtime (``diloco/``): the simulator models the systems, it does not run
them.

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

Modules
-------
``config`` (:class:`GoodputConfig`, the paper's Table 1), ``trace`` (failure traces), ``jobs`` (the
systems), ``study`` (the grid, statistics, calibration: :func:`run_goodput`), ``markdown``
(``goodput.md``) and ``outputs`` (writes goodput.json, goodput.md and goodput.png, the figure drawn
with the report's plot style, ``reports.plots``; import it as ``sim.outputs``).
"""

from sim.config import (
    CALIBRATED_FIELDS,
    CALIBRATION_ROWS,
    PAPER_CHIPS,
    PAPER_TABLE1,
    SECONDS_PER_YEAR,
    GoodputConfig,
    system_label,
)
from sim.jobs import (
    JobRun,
    Outcome,
    learner_slices,
    quorum_sweep,
    simulate_diloco,
    simulate_dp,
    simulate_elastic,
    simulate_system,
)
from sim.markdown import markdown_report
from sim.study import calibrate, confidence_interval, run_goodput, simulate_grid
from sim.trace import Trace, failure_trace, n_slices

__all__ = [
    "CALIBRATED_FIELDS",
    "CALIBRATION_ROWS",
    "PAPER_CHIPS",
    "PAPER_TABLE1",
    "SECONDS_PER_YEAR",
    "GoodputConfig",
    "JobRun",
    "Outcome",
    "Trace",
    "calibrate",
    "confidence_interval",
    "failure_trace",
    "learner_slices",
    "markdown_report",
    "n_slices",
    "quorum_sweep",
    "run_goodput",
    "simulate_diloco",
    "simulate_dp",
    "simulate_elastic",
    "simulate_grid",
    "simulate_system",
    "system_label",
]
