"""What a learner does with its own copy of fragment p when a newer global Θ_p arrives.

Each rule maps (received Θ_p, the learner's current θ_p, its reference) to the new θ_p. The
reference is what θ_p's unsent progress is measured against: the copy last sent, or, if the
fragment was not sent since the last receipt, the Θ_p received then. Rules by name
(``diloco.receipt`` in the config):

* ``overwrite`` (the paper): θ ← Θ. The inner steps taken while the fragment was in flight are
  discarded: about τ/H of every learner's compute, τ being the steps a fragment spends in flight.
* ``mix`` (Streaming DiLoCo, arXiv 2501.18512): θ ← α·θ_local + (1 − α)·Θ.
* ``keep_in_flight`` (ours): θ ← Θ + (θ_local − reference). The steps taken while in flight are
  kept and go into the next submission, whose counters then start at those kept steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

Tensors = Mapping[str, np.ndarray]


class ReceiptRule(Protocol):
    """``apply`` returns new float32 arrays (inputs untouched); ``keeps_progress``: the unsent steps
    survive receipt (so their counters carry over); ``needs_local``: ``apply`` reads θ_local."""

    name: str
    keeps_progress: bool
    needs_local: bool

    def apply(self, received: Tensors, local: Tensors, reference: Tensors) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Overwrite:
    name: str = "overwrite"
    keeps_progress: bool = False
    needs_local: bool = False

    def apply(self, received, local, reference):
        return dict(received)


@dataclass(frozen=True)
class Mix:
    alpha: float
    name: str = "mix"
    keeps_progress: bool = False
    needs_local: bool = True

    def __post_init__(self):
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"mix α must be in [0, 1), got {self.alpha}")

    def apply(self, received, local, reference):
        a = self.alpha
        return {k: (a * local[k] + (1 - a) * v).astype(np.float32) for k, v in received.items()}


@dataclass(frozen=True)
class KeepInFlight:
    name: str = "keep_in_flight"
    keeps_progress: bool = True
    needs_local: bool = True

    def apply(self, received, local, reference):
        return {k: (v + (local[k] - reference[k])).astype(np.float32) for k, v in received.items()}


RECEIPT_RULES = ("overwrite", "mix", "keep_in_flight")


def receipt_rule(name: str, mix_alpha: float = 0.0) -> ReceiptRule:
    """The rule called ``name``; ``ValueError`` naming the known rules for any other."""
    if name == "overwrite":
        return Overwrite()
    if name == "mix":
        return Mix(mix_alpha)
    if name == "keep_in_flight":
        return KeepInFlight()
    raise ValueError(f"unknown receipt rule {name!r}; choose one of {', '.join(RECEIPT_RULES)}")
