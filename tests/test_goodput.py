"""The goodput failure simulator (sim/) against closed forms and hand-made traces, plus
one end-to-end run of the ``goodput`` Prefect flow on a small grid."""

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import integrate

from sim import (
    SECONDS_PER_YEAR,
    GoodputConfig,
    JobRun,
    Trace,
    failure_trace,
    quorum_sweep,
    run_goodput,
    simulate_diloco,
    simulate_dp,
    simulate_elastic,
)


def _mtbi_years(chips: int, mtbf_s: float) -> float:
    """Per-chip MTBI that gives a cluster of ``chips`` chips a mean time between failures ``mtbf_s``."""
    return mtbf_s * chips / SECONDS_PER_YEAR


def _fixed_repair_cfg(chips: int, mtbf_s: float, mttr_s: float, **kw) -> GoodputConfig:
    # Recovery ~0 s, detection = the whole repair, no restart, negligible step: downtime = MTTR exactly.
    return GoodputConfig(
        chips=[chips],
        learners=[1],
        slice_chips=chips,
        chip_mtbi_years=_mtbi_years(chips, mtbf_s),
        detect_s=mttr_s,
        recovery_scale_s=1e-9,
        restart_s=0.0,
        downscale_s=0.0,
        upscale_s=0.0,
        step_s=1e-6,
        **kw,
    )


def _goodput(job: JobRun, trace: Trace) -> float:
    return job.useful_chip_s() / (trace.chips * trace.horizon_s)


def test_one_slice_availability_is_mtbf_over_mtbf_plus_mttr():
    """One slice, exponential failures (MTBF 1000 s), fixed repair 250 s: A = 1000 / 1250 = 0.8, for the
    non-elastic job (downtime = max(detect, R) + restart) and the elastic one (detect + downscale, the
    slice is back before the pause ends)."""
    cfg = _fixed_repair_cfg(256, mtbf_s=1000.0, mttr_s=250.0, failures_per_run=20000)
    trace = failure_trace(cfg, 256, np.random.default_rng(1))
    assert trace.n_slices == 1
    for job in (simulate_dp(trace, cfg), simulate_elastic(trace, cfg)):
        assert job.running_s() / trace.horizon_s == pytest.approx(0.8, abs=0.005)
        assert _goodput(job, trace) == pytest.approx(0.8, abs=0.005)


def test_dp_matches_the_renewal_reward_closed_form():
    """Non-elastic DP at 150k chips is an alternating renewal process: up ~ Exp(λN), down = max(detect, R)
    + restart, and each failure loses U mod C of the up time U (C = checkpoint interval), so
    goodput = (1/λN − E[U mod C]) / (1/λN + E[max(detect, R)] + restart)."""
    cfg = GoodputConfig(chips=[150_000], learners=[1], checkpoint_every_steps=10, failures_per_run=30000)
    lam = 150_000 / (cfg.chip_mtbi_years * SECONDS_PER_YEAR)
    rec = cfg.recovery
    e_max = cfg.detect_s + integrate.quad(rec.sf, cfg.detect_s, np.inf)[0]
    e_down = e_max + cfg.restart_s
    c = cfg.checkpoint_s
    e_lost = 1 / lam - c * math.exp(-lam * c) / (1 - math.exp(-lam * c))
    trace = failure_trace(cfg, 150_000, np.random.default_rng(2))
    job = simulate_dp(trace, cfg)
    assert job.running_s() / trace.horizon_s == pytest.approx((1 / lam) / (1 / lam + e_down), abs=0.004)
    assert _goodput(job, trace) == pytest.approx((1 / lam - e_lost) / (1 / lam + e_down), abs=0.004)


def test_poisson_failure_count_and_slices():
    """Interruptions in [0, T] are Poisson with mean N·T / MTBI (variance = mean), on uniform slices."""
    cfg = GoodputConfig(chips=[4096], learners=[1], slice_chips=256, failures_per_run=50)
    counts, slices = [], []
    for r in range(400):
        tr = failure_trace(cfg, 4096, np.random.default_rng([7, r]))
        counts.append(len(tr.times))
        slices.append(tr.slices)
        assert np.all(np.diff(tr.times) >= 0) and np.all((tr.times >= 0) & (tr.times < tr.horizon_s))
    mean = 4096 * cfg.horizon_s(4096) / (cfg.chip_mtbi_years * SECONDS_PER_YEAR)
    assert mean == pytest.approx(50.0)
    assert np.mean(counts) == pytest.approx(mean, abs=4 * math.sqrt(mean / 400))
    assert np.var(counts, ddof=1) == pytest.approx(mean, rel=0.25)
    per_slice = np.bincount(np.concatenate(slices), minlength=16)
    assert per_slice.min() > 0.8 * per_slice.mean()


def test_zero_failures_give_full_goodput():
    cfg = GoodputConfig(chips=[150_000], learners=[1, 4], chip_mtbi_years=1e12, seeds=2, rule_of_thumb=False)
    res = run_goodput(cfg)
    for c in res["cells"]:
        assert c["goodput"] == pytest.approx(100.0) and c["uptime"] == pytest.approx(100.0), c["system"]


def test_elastic_by_hand():
    """2 slices × 100 chips, horizon 100 s, detect 2 s, downscale 1 s, upscale 3 s, step 1 s.
    Slice 0 fails at t = 10 with R = 5: run [0,10) on 200 chips, pause to 13, run [13,15) on 100 chips,
    slice back at 15 → upscale pause to 18, run [18,100) on 200 chips → goodput (2000 + 200 + 16400)/20000.
    A failure at t = 11 (job paused, chips idle) is absorbed. With R = 2 the slice is back at 12, inside
    the pause, and joins for free: goodput (2000 + 200·87)/20000."""
    cfg = GoodputConfig(
        chips=[200], learners=[1], slice_chips=100, detect_s=2.0, downscale_s=1.0, upscale_s=3.0, step_s=1.0
    )
    trace = Trace(np.array([10.0, 11.0]), np.array([0, 1]), np.array([5.0, 7.0]), 2, 200, 100.0)
    job = simulate_elastic(trace, cfg)
    assert list(zip(job.starts, job.ends, job.chips)) == [(0.0, 10.0, 200.0), (13.0, 15.0, 100.0), (18.0, 100.0, 200.0)]
    assert (job.failures, job.upscales, job.coalesced) == (1, 1, 0)
    assert _goodput(job, trace) == pytest.approx(18600 / 20000)
    quick = Trace(np.array([10.0]), np.array([0]), np.array([2.0]), 2, 200, 100.0)
    job = simulate_elastic(quick, cfg)
    assert (job.upscales, job.coalesced) == (0, 1)
    assert _goodput(job, quick) == pytest.approx(19400 / 20000)
    # A failure 0.5 s into a step loses that half step on the 200 running chips.
    half = Trace(np.array([10.5]), np.array([0]), np.array([2.0]), 2, 200, 100.0)
    assert _goodput(simulate_elastic(half, cfg), half) == pytest.approx((200 * 10.5 - 100 + 200 * 86.5) / 20000)


def test_quorum_sweep_by_hand():
    """Learner A runs [0,10) on 2 chips, B runs [5,15) on 1 chip, horizon 20 s.
    K=1: useful 2·10 + 1·10 = 30 chip-s, up 15 s. K=2: only [5,10) counts: 3·5 = 15 chip-s, up 5 s."""
    a = JobRun(starts=[0.0], ends=[10.0], chips=[2.0], lost=[0.0])
    b = JobRun(starts=[5.0], ends=[15.0], chips=[1.0], lost=[0.0])
    assert quorum_sweep([a, b], 1, 20.0) == pytest.approx((30.0, 15.0))
    assert quorum_sweep([a, b], 2, 20.0) == pytest.approx((15.0, 5.0))


def test_one_learner_diloco_is_elastic_dp_on_the_same_trace():
    cfg = GoodputConfig(chips=[300_000], learners=[1], failures_per_run=1500)
    trace = failure_trace(cfg, 300_000, np.random.default_rng(3))
    el = simulate_elastic(trace, cfg)
    dl = simulate_diloco(trace, cfg, 1)
    assert dl.goodput == pytest.approx(_goodput(el, trace), rel=1e-12)
    assert dl.uptime == pytest.approx(el.running_s() / trace.horizon_s, rel=1e-12)
    assert (dl.failures, dl.upscales, dl.coalesced) == (el.failures, el.upscales, el.coalesced)


@pytest.fixture(scope="module")
def small_grid():
    cfg = GoodputConfig(chips=[150_000, 600_000, 2_400_000], seeds=3, failures_per_run=800, rule_of_thumb=False)
    return cfg, run_goodput(cfg)


def test_goodput_falls_with_chips_and_rises_with_learners(small_grid):
    cfg, res = small_grid
    g = {(c["system"], c["chips"]): c["goodput"] for c in res["cells"]}
    for s in cfg.systems:
        assert g[(s, 150_000)] > g[(s, 600_000)] > g[(s, 2_400_000)], s
    for n in cfg.chips:
        assert [g[(s, n)] for s in cfg.systems] == sorted(g[(s, n)] for s in cfg.systems), n
    assert {c["role"] for c in res["cells"] if c["system"].startswith("diloco")} == {"prediction"}


def test_same_seed_same_numbers(small_grid):
    cfg, res = small_grid
    again = run_goodput(cfg)
    assert [c["goodput_seeds"] for c in again["cells"]] == [c["goodput_seeds"] for c in res["cells"]]
    other = run_goodput(cfg.model_copy(update={"seed": 1, "chips": [150_000]}))
    assert other["cells"][0]["goodput_seeds"] != res["cells"][0]["goodput_seeds"]


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"detect_s": -1}, "detect_s"),
        ({"chip_mtbi_years": 0}, "chip_mtbi_years"),
        ({"seeds": 1}, "seeds"),
        ({"confidence": 1.5}, "confidence"),
        ({"learners": [2, 4], "quorum": 3}, "quorum"),
        ({"slice_chips": 20_000}, "slice_chips"),
        ({"chips": [150_000, 150_000]}, "chips"),
        ({"restart_minutes": 10}, "restart_minutes"),
    ],
)
def test_bad_settings_are_rejected_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as exc:
        GoodputConfig.model_validate(bad)
    assert field in str(exc.value)


def test_goodput_flow_end_to_end(prefect_harness, tmp_path):
    """The Prefect flow on a small grid: files in the run directory, paper values and differences in
    the table, and the two artifacts attached to this flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.goodput import goodput

    cfg = GoodputConfig(chips=[150_000, 300_000], learners=[2], seeds=2, failures_per_run=300)
    out = tmp_path / "gp"
    state = goodput(config=cfg, out_dir=str(out), return_state=True)
    md_path = state.result()
    assert md_path == str(out / "goodput.md")
    for name in ("goodput.json", "goodput.md", "goodput.png", "config.json"):
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "goodput.json").read_text())
    assert len(res["cells"]) == 3 * 2 and len(res["rule_of_thumb"]) == 2
    md = (out / "goodput.md").read_text()
    assert "Decoupled DiLoCo M=2" in md and "(94, " in md and "Worst Decoupled DiLoCo cell" in md
    assert f"| `restart_s` | {GoodputConfig().restart_s:g} | calibrated on the DP rows (shipped default) |" in md
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    by_key = {a.key: a for a in arts}
    assert {"goodput-report", "goodput-table"} <= set(by_key)
    assert str(out / "goodput.png") in by_key["goodput-report"].data
    table = by_key["goodput-table"].data
    table = json.loads(table) if isinstance(table, str) else table
    assert len(table) == 6 and {r["role"] for r in table} == {"calibration", "prediction"}
    with pytest.raises(FileExistsError):  # results are never overwritten
        goodput(config=cfg, out_dir=str(out))
