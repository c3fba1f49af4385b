"""The goodput simulator's knobs (:class:`GoodputConfig`) and the paper's Table 1.

Table 1 of Decoupled DiLoCo (Douillard et al., arXiv 2604.21428, 2026): goodput (%) of each system
at 150k … 2.4M chips with a per-chip mean time between interruptions of 1 year. Times are seconds
unless a name says otherwise (``chip_mtbi_years``); docs/goodput.md gives every constant's source.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator
from scipy import stats

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
    chips: list[PositiveInt] = Field(default_factory=lambda: list(PAPER_CHIPS), description="cluster sizes N (chips)")
    learners: list[PositiveInt] = Field(
        default_factory=lambda: [2, 4, 8, 16], description="Decoupled DiLoCo learner counts M"
    )
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
        1, description="non-elastic DP rolls back to its last checkpoint, taken every this many steps"
    )
    # Calibrated on the DP rows (see calibrate())
    restart_s: float = Field(46.59, ge=0.0, description="non-elastic restart (reschedule, re-compile, restore), s")
    downscale_s: float = Field(0.5, ge=0.0, description="elastic pause to drop a failed slice, s (after detection)")
    upscale_s: float = Field(22.37, ge=0.0, description="elastic pause to take a returned slice back, s")
    # Statistics
    failures_per_run: PositiveInt = Field(
        4000, description="horizon per run = this many expected interruptions of the full cluster"
    )
    seeds: int = Field(10, ge=2, description="independent replications (confidence intervals need ≥ 2)")
    seed: int = Field(0, ge=0, description="base seed; the same seed gives the same numbers")
    confidence: float = Field(0.95, gt=0.0, lt=1.0, description="confidence level of the intervals")
    rule_of_thumb: bool = Field(True, description="also simulate elastic DP at N/M chips for each DiLoCo cell")
    calibrate: bool = Field(False, description="refit restart_s, downscale_s, upscale_s on the DP rows first")

    @model_validator(mode="after")
    def _check(self) -> GoodputConfig:
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
                    f"{self.slice_chips}, fewer than the largest learner count {max(self.learners)}"
                )
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
            "chip_mtbi_years": self.chip_mtbi_years,
            "slice_chips": self.slice_chips,
            "detect_s": self.detect_s,
            "recovery_a": self.recovery_a,
            "recovery_c": self.recovery_c,
            "recovery_scale_s": self.recovery_scale_s,
            "mean_recovery_s": round(self.mean_recovery_s, 3),
            "step_s": self.step_s,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "restart_s": self.restart_s,
            "downscale_s": self.downscale_s,
            "upscale_s": self.upscale_s,
        }
