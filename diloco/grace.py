"""The grace window after quorum: fixed, or adaptive (Douillard et al., "Decoupled DiLoCo", arXiv
2604.21428, Eq. 3).

Once K learners have submitted fragment p, the syncer may wait a little for more of them. The
adaptive rule waits only while waiting costs no learner any time:

    slack = τ·t_step − (t_quorum + t_sync),   grace = clamp(γ·slack, 0, cap)

* t_step: the learners' inner-step time (seconds), a moving median of the step times the
  submissions show: between two submissions of one learner, Δ sent_at / Δ local_step;
* t_quorum: how long the round took to reach quorum, from the earliest send among the round's
  submissions to the syncer's clock at quorum;
* t_sync: the time to bring the merged fragment back to the learners: the merge and publish
  (measured by the loop) plus the exchange's latency both ways (twice the moving median of
  receive time − send time);
* τ (``overlap_steps``): inner steps a fragment's round trip may overlap. Our learners never block
  on a fragment; the merged fragment must be back before the learner sends that fragment again, H
  steps later, or its next copy is based on the old version: τ = H by default (the paper's τ is
  its overlap setting, 1-2 steps with P = H);
* γ (``gamma``) < 1 is a safety margin; the paper does not publish its value. Ours is 0.5;
* cap (``cap_s``): at most one step (the measured t_step) unless set.

Until ``min_samples`` step times have been seen (the first rounds, or a restarted syncer) the
window is the fixed one. Pure and clock-free: every time is passed in, so the arithmetic is tested
in microseconds. The estimates are not part of the syncer's checkpointed state: a restarted syncer
measures afresh and uses the fixed window meanwhile.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class GraceWindow:
    """Grace window in seconds after quorum (see the module docstring for Eq. 3).

    ``mode``: ``fixed`` (always ``fixed_s``) or ``adaptive``. ``window``: samples per moving median.
    Raises ``ValueError`` for an unknown mode, γ ≤ 0, τ ≤ 0 or a negative cap.
    """

    mode: Literal["fixed", "adaptive"] = "fixed"
    fixed_s: float = 0.0
    gamma: float = 0.5
    overlap_steps: float = 1.0
    cap_s: float | None = None
    window: int = 64
    min_samples: int = 8
    _steps: collections.deque = field(init=False, repr=False)
    _latency: collections.deque = field(init=False, repr=False)
    _quorum: collections.deque = field(init=False, repr=False)
    _merge: collections.deque = field(init=False, repr=False)
    _last: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("fixed", "adaptive"):
            raise ValueError(f"grace mode {self.mode!r} unknown; choose fixed or adaptive")
        if self.gamma <= 0 or self.overlap_steps <= 0:
            raise ValueError(f"grace γ ({self.gamma}) and τ ({self.overlap_steps}) must be > 0")
        if self.cap_s is not None and self.cap_s < 0:
            raise ValueError(f"grace cap ({self.cap_s}) must be ≥ 0 seconds")
        self._steps, self._latency, self._quorum, self._merge = (
            collections.deque(maxlen=self.window) for _ in range(4)
        )

    # -- measurements ---------------------------------------------------------------------------
    def observe_submission(
        self, learner: int, attempt: int, local_step: int, sent_at: float, received_at: float
    ) -> None:
        """One received submission: its learner, attempt, local step, send and receive times (s)."""
        self._latency.append(max(received_at - sent_at, 0.0))
        last = self._last.get(learner)
        if last is not None and last[0] == attempt and local_step > last[1] and sent_at > last[2]:
            self._steps.append((sent_at - last[2]) / (local_step - last[1]))
        if last is None or (attempt, local_step) > (last[0], last[1]):
            self._last[learner] = (attempt, local_step, sent_at)

    def observe_quorum(self, first_sent_at: float, quorum_at: float) -> None:
        """A round reached quorum at ``quorum_at``; its earliest submission was sent at ``first_sent_at``."""
        self._quorum.append(max(quorum_at - first_sent_at, 0.0))

    def observe_merge(self, seconds: float) -> None:
        """One merge and its publish took ``seconds`` (the loop's wall clock)."""
        self._merge.append(max(seconds, 0.0))

    # -- the window -----------------------------------------------------------------------------
    def estimates(self) -> dict[str, float | None]:
        """The moving medians (seconds; None before any sample): t_step, t_quorum, t_sync."""
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        latency, merge = med(self._latency), med(self._merge)
        t_sync = None if latency is None else 2 * latency + (merge or 0.0)
        return {"t_step": med(self._steps), "t_quorum": med(self._quorum), "t_sync": t_sync}

    def cap(self) -> float | None:
        """The bound the window is clamped to now (seconds): one measured step, or ``cap_s`` when set;
        None while the window is the fixed one (``fixed`` mode, or still warming up)."""
        if self.mode == "fixed" or len(self._steps) < self.min_samples:
            return None
        return self.estimates()["t_step"] if self.cap_s is None else self.cap_s

    def seconds(self, t_quorum: float | None = None) -> float:
        """The grace window to use now (seconds). ``t_quorum``: this round's own time to quorum
        (default: the moving median). The fixed window in ``fixed`` mode and while warming up."""
        if self.mode == "fixed" or len(self._steps) < self.min_samples:
            return self.fixed_s
        est = self.estimates()
        t_step = est["t_step"]
        t_q = t_quorum if t_quorum is not None else (est["t_quorum"] or 0.0)
        slack = self.overlap_steps * t_step - (t_q + (est["t_sync"] or 0.0))
        cap = t_step if self.cap_s is None else self.cap_s
        return min(max(self.gamma * slack, 0.0), cap)
