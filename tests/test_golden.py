"""The golden losses (tests/golden/): two tiny deterministic runs reproduce their recorded losses.

Tolerance: 1e-4 nats absolute on every loss. Both runs are deterministic on one machine (same
XLA programs, one thread for the lock-step run); a refactor may change XLA's fusion and summation
order, which moves float32 losses by ~1e-6 per step, growing slowly over the 32 steps. A change
in the algorithm or the data moves them by far more (the first merge alone moves the held-out loss
by ~1e-2). Refresh deliberately: ``python -m tests.golden.record --write`` (tests/golden/record.py).
"""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.golden.record import run_all

GOLDEN = Path(__file__).parent / "golden"
TOL = 1e-4


@pytest.fixture(scope="module")
def runs():
    return run_all()


@pytest.mark.parametrize("name", ["dp", "lockstep"])
def test_golden_losses(runs, name):
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    got = runs[name]
    for key in ("train_loss", "heldout_loss"):
        a, b = np.asarray(got[key]), np.asarray(want[key])
        assert a.shape == b.shape, f"{name} {key}: {a.shape} steps, recorded {b.shape}"
        worst = float(np.max(np.abs(a - b)))
        assert worst <= TOL, f"{name} {key}: largest deviation {worst:.2e} nats > {TOL:.0e}"
    if name == "lockstep":
        assert [(m["step"], m["fragment"]) for m in got["merges"]] == [
            (m["step"], m["fragment"]) for m in want["merges"]
        ]
