"""Run one learner attempt in this process from pickled task inputs (tests/test_learner.py).

    python tests/learner_process.py INPUTS.pkl ATTEMPT

INPUTS.pkl holds the learner task's inputs exactly as Prefect would pass them: a dict with
``config`` (ExperimentConfig), ``run_dir`` (str) and ``learner`` (int). The learner runs alone,
against an exchange holding Θ₀ (``training.decoupled.setup.initial_exchange``), and saves its resume points
in the run directory.
"""

import os
import pickle
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.decoupled.plan import DiLoCoPlan  # noqa: E402
from training.decoupled.setup import initial_exchange, learner_attempt  # noqa: E402

if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        inputs = pickle.load(f)
    attempt = int(sys.argv[2])
    ex = initial_exchange(DiLoCoPlan.of(inputs["config"]), inputs["run_dir"])
    out = learner_attempt(inputs["config"], inputs["run_dir"], inputs["learner"], attempt, exchange=ex)
    print(out)
