"""A device mesh per learner (training/mesh.py): device slices, the checks that refuse a batch the
devices cannot split, and the data-parallel step on 2 simulated CPU devices against 1 device.

The 2-device check runs tests/mesh_process.py in a process of its own, because
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` only counts before JAX starts. The whole
pipeline with 2 learners × 2 devices on 4 simulated devices is tests/mesh_pipeline.py (a script,
about 75 s: too slow for the suite).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from configs.load import load_config
from configs.schema import ExperimentConfig
from training.dp import dp_devices
from training.mesh import BATCH, batch_mesh, learner_devices

ROOT = Path(__file__).resolve().parents[1]
EIGHT = [f"dev{i}" for i in range(8)]  # stand-ins: learner_devices only slices the list


# -- learner_devices ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "learner, per, want",
    [
        (0, 2, ["dev0", "dev1"]),
        (1, 2, ["dev2", "dev3"]),
        (3, 2, ["dev6", "dev7"]),
        (4, 2, ["dev0", "dev1"]),
        (5, 2, ["dev2", "dev3"]),  # M·d > 8: the slices wrap round
        (0, 8, EIGHT),
        (2, 8, EIGHT),
        (7, 1, ["dev7"]),
        (9, 1, ["dev1"]),
        (1, 4, ["dev4", "dev5", "dev6", "dev7"]),
    ],
)
def test_learner_devices_slices_and_wraps(learner, per, want):
    assert learner_devices(learner, per, EIGHT) == want


def test_learner_devices_one_device_is_shared_by_all():
    assert [learner_devices(m, 1, ["cpu0"]) for m in range(3)] == [["cpu0"]] * 3


@pytest.mark.parametrize(
    "learner, per, devices, match",
    [
        (0, 3, EIGHT, r"runtime.devices_per_learner \(3\) must divide the 8 devices .* pick one of \[1, 2, 4, 8\]"),
        (0, 9, EIGHT, r"runtime.devices_per_learner \(9\) exceeds the 8 device\(s\) .* at most 8"),
        (0, 2, ["cpu0"], r"runtime.devices_per_learner \(2\) exceeds the 1 device"),
        (0, 0, EIGHT, r"runtime.devices_per_learner must be ≥ 1"),
        (-1, 1, EIGHT, r"learner index must be ≥ 0"),
    ],
)
def test_learner_devices_refuses(learner, per, devices, match):
    with pytest.raises(ValueError, match=match):
        learner_devices(learner, per, devices)


def test_learner_devices_default_is_this_process():
    import jax

    assert learner_devices(0, 1) == jax.devices()[:1]


def test_batch_mesh():
    import jax

    mesh = batch_mesh(jax.devices()[:1])
    assert mesh.axis_names == (BATCH,) and mesh.size == 1
    with pytest.raises(ValueError, match="at least one device"):
        batch_mesh([])
    with pytest.raises(ValueError, match="distinct devices"):
        batch_mesh(jax.devices()[:1] * 2)


# -- the config refuses batches a learner's devices cannot split ---------------------------------
def _tiny(**overrides):
    return load_config(ROOT / "configs" / "tiny.yaml", overrides)


def test_devices_per_learner_defaults_to_one():
    assert ExperimentConfig().runtime.devices_per_learner == 1
    assert _tiny(**{"runtime.devices_per_learner": 2}).runtime.devices_per_learner == 2  # batch 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"runtime.devices_per_learner": 3},  # tiny: diloco.batch_size 4
            r"diloco.batch_size \(4\) must be divisible by runtime.devices_per_learner \(3\)",
        ),
        (
            {"runtime.devices_per_learner": 4, "diloco.batch_size": 8, "dp.batch_size": 16, "train.microbatch_size": 2},
            r"train.microbatch_size \(2\) must be divisible by runtime.devices_per_learner \(4\)",
        ),
        ({"runtime.devices_per_learner": 0}, r"runtime.devices_per_learner\s+Input should be greater than 0"),
    ],
)
def test_devices_per_learner_must_split_the_batch(overrides, message):
    with pytest.raises(ValidationError, match=message):
        _tiny(**overrides)


def test_preflight_refuses_more_devices_than_the_process_has(tmp_path):
    """Refused before Prefect starts (``ddiloco run`` prints it as one line), nothing written."""
    import jax

    from flows.preflight import preflight
    from tests.conftest import SMALL_DATA

    n = len(jax.devices())
    cfg = _tiny(**SMALL_DATA, **{"runtime.devices_per_learner": 2 * n, "diloco.batch_size": 2 * n})
    with pytest.raises(ValueError, match=rf"runtime.devices_per_learner \({2 * n}\) exceeds the {n} device"):
        preflight(cfg, tmp_path / "R")
    assert not (tmp_path / "R").exists()


def test_dp_devices():
    cfg = _tiny()  # dp.batch_size 12
    assert dp_devices(cfg, ["cpu0"]) is None  # one device: the plain step
    assert dp_devices(cfg, EIGHT[:4]) == EIGHT[:4]
    with pytest.raises(ValueError, match=r"dp.batch_size \(12\) must be divisible by the 8 devices"):
        dp_devices(cfg, EIGHT)
    with pytest.raises(ValueError, match=r"train.microbatch_size \(2\) must be divisible by the 4 devices"):
        dp_devices(_tiny(**{"train.microbatch_size": 2}), EIGHT[:4])


# -- 2 devices against 1 -------------------------------------------------------------------------
# Per-step loss tolerance, nats. Measured on 2 CPU cores (jax 0.10.2): the largest difference over
# the 10 steps was 4.8e-7 (one float32 ulp at a loss of 6.2), with and without microbatches; the
# final parameters differed by at most 1.2e-7. The two programs sum the batch in a different order
# (two halves, then an all-reduce), so the losses agree to float32 rounding, not bit for bit.
LOSS_TOL = 5e-6
PARAM_TOL = 1e-5


@pytest.fixture(scope="module")
def two_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "mesh_process.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("G", [1, 2])
def test_two_devices_step_like_one(two_devices, G):
    r = two_devices[f"G{G}"]
    one, two = np.array(r["one"]["losses"]), np.array(r["two"]["losses"])
    assert one.shape == two.shape == (10,)
    assert np.all(np.isfinite(one)) and np.ptp(one) > 1e-3  # it trained: the losses move
    worst = float(np.max(np.abs(one - two)))
    assert worst <= LOSS_TOL, f"G={G}: per-step losses differ by up to {worst:.2e} nats > {LOSS_TOL:.0e}"
    assert r["final_param_max_abs_diff"] <= PARAM_TOL
    # the outputs live on both devices, whole on each (params, optimizer state, metrics)
    assert r["two"]["param_devices"] == r["two"]["opt_devices"] == r["two"]["metric_devices"] == [0, 1]
    assert r["two"]["params_replicated"] and r["two"]["leaf_shards"] == 2
    # G = 1: the default device's plain step; G = 2: one other device (inputs placed there)
    assert r["one"]["param_devices"] == r["one"]["opt_devices"] == [0 if G == 1 else 1]


@pytest.mark.process
@pytest.mark.slow
def test_two_devices_evaluate_like_one(two_devices):
    one, two = two_devices["G1"]["one"], two_devices["G1"]["two"]
    assert abs(one["eval"] - two["eval"]) <= LOSS_TOL  # 4 rows: split over the 2 devices
    assert abs(one["eval_odd_rows"] - two["eval_odd_rows"]) <= LOSS_TOL  # 3 rows: whole on each


@pytest.mark.process
@pytest.mark.slow
def test_microbatches_stay_on_their_devices(two_devices):
    """Each device accumulates the microbatches of its own rows, so no row moves between them: the
    compiled step's only collective is the all-reduce of the summed gradients and metrics, once a
    step, outside the microbatch loop (inside it, it would move G times the gradient's bytes)."""
    ops = two_devices["G2"]["collectives"]
    assert ops["all-reduce"] >= 1 and ops["all-reduce in loops"] == 0, ops
    assert ops["all-to-all"] == ops["all-gather"] == ops["collective-permute"] == 0, ops


def test_thread_learners_take_turns_per_accelerator_slice_but_all_together_on_cpu(small_cfg, tmp_path):
    """Learner m on its own GPU computes while the others do (turns per slice); learners wrapped
    round onto one GPU share its turns; CPU devices are the same cores: one set of turns for all."""
    from types import SimpleNamespace

    from training.decoupled.plan import DiLoCoPlan
    from training.decoupled.setup import learner_turns

    gpu = [SimpleNamespace(platform="gpu", id=i) for i in range(2)]
    cpu = [SimpleNamespace(platform="cpu", id=i) for i in range(2)]
    run, plan = tmp_path / "run", DiLoCoPlan.of(small_cfg)
    on_gpu = [learner_turns(plan, run, [gpu[m % 2]]) for m in range(3)]
    assert on_gpu[0] is not on_gpu[1] and on_gpu[0] is on_gpu[2]  # learner 2 shares GPU 0 with learner 0
    on_cpu = [learner_turns(plan, tmp_path / "other", [cpu[m % 2]]) for m in range(3)]
    assert on_cpu[0] is on_cpu[1] is on_cpu[2] is learner_turns(plan, tmp_path / "other")
    assert on_cpu[0] is not None and on_gpu[0] is not on_cpu[0]
