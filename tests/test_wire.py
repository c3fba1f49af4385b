"""Wire formats (diloco/wire.py) and what the syncer does with them.

Round trips stay within each format's stated bound (per tensor and per block, random and
adversarial inputs); payloads have the stated bytes; a non-finite value is never decoded to a
finite one; a syncer fed int4 updates rebuilds θ within the bound and merges; a tiny pretrain with
int4 on the fsspec exchange completes and sends about 1/8 of float32's bytes per submission.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid

import numpy as np
import pytest

from diloco.exchange.base import Submission
from diloco.exchange.fsspec import FsspecExchange
from diloco.syncer import Syncer, SyncerSettings
from diloco.wire import SCALE_SUFFIX, WireFormat

FORMATS = [
    WireFormat("float32"),
    WireFormat("bfloat16"),
    WireFormat("int8"),
    WireFormat("int8", 64),
    WireFormat("int8", 7),
    WireFormat("int4"),
    WireFormat("int4", 64),
    WireFormat("int4", 5),
]
IDS = [f.spec for f in FORMATS]


def _inputs() -> dict[str, np.ndarray]:
    """Random tensors of odd and even sizes plus the adversarial cases."""
    rng = np.random.default_rng(0)
    outlier = (1e-3 * rng.standard_normal(301)).astype(np.float32)
    outlier[123] = 1e4  # one huge value: per tensor, everything else rounds to 0 and stays in the bound
    return {
        "normal": rng.standard_normal((17, 33)).astype(np.float32),
        "odd": rng.standard_normal(7).astype(np.float32),  # an odd count: int4 pads one nibble
        "one": np.array([-0.37], np.float32),
        "zeros": np.zeros((4, 5), np.float32),
        "outlier": outlier,
        "tiny": (1e-20 * rng.standard_normal(64)).astype(np.float32),
        "wide": (rng.standard_normal(200) * np.logspace(-6, 3, 200)).astype(np.float32),
    }


def _shapes(tensors):
    return {k: v.shape for k, v in tensors.items()}


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_round_trip_within_the_stated_bound(fmt):
    x = _inputs()
    payload = fmt.encode(x)
    out = fmt.decode(payload, _shapes(x))
    for name, a in x.items():
        got = out[name]
        assert got.dtype == np.float32 and got.shape == a.shape, name
        err = np.abs(got.astype(np.float64) - a.astype(np.float64))
        # the bound, plus the float32 rounding of the decoded value (relative 2⁻²⁴)
        allowed = fmt.error_bound(a) + np.abs(a.astype(np.float64)) * 2.0**-23
        assert (err <= allowed).all(), (name, float(np.max(err - allowed)))
    np.testing.assert_array_equal(out["zeros"], 0.0)  # a zero block decodes to exact zeros
    if fmt.dtype == "float32":
        assert all(out[k] is x[k] for k in x)  # θ itself, bit-identical and uncopied


def test_stated_bounds_by_hand():
    """int8 per tensor: absmax 127 → scale 1, codes = round(x); int4 per block of 2: scales 3/7, 7/7."""
    x = {"a": np.array([127.0, -0.5, 1.5, 2.49], np.float32)}
    out = WireFormat("int8").decode(WireFormat("int8").encode(x), {"a": (4,)})["a"]
    np.testing.assert_array_equal(out, [127.0, -0.0, 2.0, 2.0])  # half to even: −0.5 → 0, 1.5 → 2
    y = {"a": np.array([3.0, 1.0, 7.0, -0.4], np.float32)}
    fmt = WireFormat("int4", 2)
    payload = fmt.encode(y)
    np.testing.assert_allclose(payload["a" + SCALE_SUFFIX], [3 / 7, 1.0], rtol=1e-7)
    out = fmt.decode(payload, {"a": (4,)})["a"]
    np.testing.assert_allclose(out, [3.0, 2 * 3 / 7, 7.0, 0.0], rtol=1e-6)  # 1.0 → code 2.33 → 2
    np.testing.assert_allclose(fmt.error_bound(y["a"]), [3 / 14, 3 / 14, 0.5, 0.5])


@pytest.mark.parametrize(
    "fmt, per_value, scales",
    [
        (WireFormat("float32"), 4.0, 0),
        (WireFormat("bfloat16"), 2.0, 0),
        (WireFormat("int8"), 1.0, 1),
        (WireFormat("int8", 64), 1.0, 64),
        (WireFormat("int4"), 0.5, 1),
        (WireFormat("int4", 64), 0.5, 64),
    ],
)
def test_payload_bytes(fmt, per_value, scales):
    """n values: 4n, 2n, n + 4·blocks, ⌈n/2⌉ + 4·blocks (one tensor of 4096, one of 7)."""
    x = {"big": np.ones((64, 64), np.float32), "odd": np.ones(7, np.float32)}
    payload = fmt.encode(x)
    nbytes = sum(a.nbytes for a in payload.values())
    blocks = {"big": 4096 // scales if scales > 1 else scales, "odd": 1 if scales else 0}
    want = sum(math.ceil(a.size * per_value) + 4 * blocks[k] for k, a in x.items())
    assert nbytes == want == fmt.payload_nbytes(_shapes(x))
    sub = Submission(0, 0, payload, 8, 1, 0, 1, wire=fmt.spec)
    assert sub.nbytes == want  # what crosses the wire, codes and scales
    if fmt.spec == "int4":
        assert payload["odd"].shape == (4,) and payload["big"].dtype == np.uint8  # 7 codes → 4 bytes


@pytest.mark.parametrize("fmt", FORMATS[1:], ids=IDS[1:])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_stay_non_finite(fmt, bad):
    x = {"a": np.arange(10, dtype=np.float32)}
    x["a"][3] = bad
    out = fmt.decode(fmt.encode(x), {"a": (10,)})["a"]
    assert not np.isfinite(out[3])
    if fmt.block_size is None:  # the whole tensor shares the non-finite scale
        assert fmt.dtype == "bfloat16" or not np.isfinite(out).any()


def test_specs_parse_and_bad_formats_are_refused():
    for fmt in FORMATS:
        assert WireFormat.parse(fmt.spec) == fmt
    for spec in ("int2", "int8:0", "int8:x", "float32:64", "bfloat16:8"):
        with pytest.raises(ValueError):
            WireFormat.parse(spec)
    fmt = WireFormat("int4")
    good = fmt.encode({"a": np.ones(5, np.float32)})
    with pytest.raises(ValueError, match="expected"):
        fmt.decode(good, {"a": (7,)})  # 7 values need 4 bytes of codes, 5 only 3
    with pytest.raises(ValueError, match="missing"):
        fmt.decode({"a": good["a"]}, {"a": (5,)})


# -- the syncer rebuilds θ from quantised updates ----------------------------------------------------
def _int4_syncer(max_staleness=1):
    theta0 = {"w": np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6), "b": np.full(5, 0.5, np.float32)}
    settings = SyncerSettings(
        num_learners=2, quorum=2, outer_lr=1.0, outer_momentum=0.0, max_staleness=max_staleness, wire="int4:4"
    )
    return theta0, Syncer(theta0, [["w"], ["b"]], settings)


def _int4_sub(m, theta, base_theta, base_version, step, fragment=0):
    names = ["w"] if fragment == 0 else ["b"]
    fmt = WireFormat("int4", 4)
    payload = fmt.encode({k: theta[k] - base_theta[k] for k in names})
    return Submission(m, fragment, payload, 64, 8, base_version, step, wire=fmt.spec)


def test_syncer_rebuilds_int4_updates_within_the_bound_and_merges():
    theta0, s = _int4_syncer()
    rng = np.random.default_rng(1)
    thetas = [{"w": theta0["w"] + 0.01 * rng.standard_normal((4, 6)).astype(np.float32)} for _ in range(2)]
    for m in range(2):
        assert s.receive(_int4_sub(m, thetas[m], theta0, 0, 8), 0.0)
        rebuilt = s.pending_params[0][m]["w"]
        bound = WireFormat("int4", 4).error_bound(thetas[m]["w"] - theta0["w"]) + 1e-6
        assert (np.abs(rebuilt - thetas[m]["w"]) <= bound).all()
    (rec,) = s.poll(0.0, live={0, 1})
    # equal tokens and steps: Θ₁ = the mean of the rebuilt copies (outer lr 1, no momentum)
    want = np.mean([thetas[m]["w"] for m in range(2)], axis=0)
    assert rec["version"] == 1 and np.max(np.abs(s.global_params[0]["w"] - want)) <= 0.01 * 4 / 14 + 1e-6
    # bytes_in counts the payloads: 24 codes → 12 bytes + 6 scales of 4 bytes, per learner
    assert rec["bytes_in"] == 2 * (12 + 6 * 4) and rec["fragment_bytes"] == 24 * 4
    # a learner that has not yet pulled v1 sends an update against v0: still decoded (kept base)
    assert s.receive(_int4_sub(0, thetas[0], theta0, 0, 16), 1.0)
    np.testing.assert_allclose(s.pending_params[0][0]["w"], thetas[0]["w"], atol=0.01)


def test_syncer_drops_int4_nan_wrong_payloads_and_overflow():
    theta0, s = _int4_syncer()
    bad = {"w": theta0["w"].copy()}
    bad["w"][1, 2] = np.nan
    assert not s.receive(_int4_sub(0, bad, theta0, 0, 8), 0.0)
    assert s.ledger[0].drop_reasons == {"non-finite": 64}
    wrong = Submission(1, 0, {"w": theta0["w"]}, 64, 8, 0, 8, wire="int4:4")  # float32 arrays announced as int4
    assert not s.receive(wrong, 0.0)
    unknown = Submission(1, 0, {"w": theta0["w"]}, 128, 16, 0, 9, wire="int3")  # 64 more tokens
    assert not s.receive(unknown, 0.0) and s.ledger[1].drop_reasons == {"wrong-tensors": 128}
    # a finite update whose sum with the base overflows float32 is non-finite
    edge = Syncer(
        {"w": np.full(4, 3e38, np.float32)}, [["w"]], SyncerSettings(num_learners=1, outer_momentum=0.0, wire="int8")
    )
    huge = Submission(0, 0, WireFormat("int8").encode({"w": np.full(4, 1e38, np.float32)}), 64, 8, 0, 8, wire="int8")
    assert not edge.receive(huge, 0.0) and edge.ledger[0].drop_reasons == {"non-finite": 64}


def test_a_float32_syncer_decodes_quantised_updates_against_its_current_version_only():
    """With wire float32 configured the syncer keeps no older bases: a quantised update against the
    current version decodes, one against an older version (within max_staleness) is "stale"."""
    theta0 = {"w": np.zeros(6, np.float32)}
    s = Syncer(theta0, [["w"]], SyncerSettings(num_learners=1, outer_lr=1.0, outer_momentum=0.0))
    fmt = WireFormat("int8")
    payload = fmt.encode({"w": np.full(6, 0.5, np.float32)})
    assert s.receive(Submission(0, 0, payload, 64, 8, 0, 8, wire="int8"), 0.0) and s.poll(0.0, live={0})
    np.testing.assert_allclose(s.global_params[0]["w"], 0.5)
    assert s.settings.max_staleness == 1  # one version behind is not too stale, but its base is gone
    assert not s.receive(Submission(0, 0, payload, 128, 16, 0, 16, wire="int8"), 1.0)
    assert s.ledger[0].drop_reasons == {"stale": 64}
    assert s.receive(Submission(0, 0, payload, 64, 8, 1, 24, wire="int8"), 2.0)


def test_kept_bases_window_follows_max_staleness():
    theta0, s = _int4_syncer(max_staleness=2)
    for v in range(1, 5):
        for m in range(2):
            base = s.bases[0][s.versions[0]]
            assert s.receive(_int4_sub(m, {"w": base["w"] + 0.01}, base, s.versions[0], 8 * v + m), float(v))
        assert s.poll(float(v), live={0, 1})
        assert sorted(s.bases[0]) == list(range(max(0, v - 2), v + 1))  # current and 2 before
    assert sorted(s.bases[1]) == [0]
    # float32 keeps only the current version (it sends θ, not Δ)
    assert SyncerSettings(num_learners=1, wire="float32", max_staleness=3).kept_bases == 0
    assert SyncerSettings(num_learners=1, wire="bfloat16", max_staleness=3).kept_bases == 3


def test_state_dict_round_trip_with_int4_pending_submissions():
    """The bases are saved with the state; a fresh syncer loaded from it decodes the pending int4
    submissions (re-read by name) to the same θ and merges bit-identically."""
    url = f"memory://wire-{uuid.uuid4().hex}"
    theta0, s = _int4_syncer(max_staleness=1)
    ex = FsspecExchange.create(
        url, initial=[{"w": theta0["w"]}, {"b": theta0["b"]}], num_learners=2, token_budget=10**6, grant_tokens=64
    )
    rng = np.random.default_rng(2)

    def send(m, v, step):
        base = s.bases[0][v]
        sub = _int4_sub(m, {"w": base["w"] + 0.02 * rng.standard_normal((4, 6)).astype(np.float32)}, base, v, step)
        ex.submit(sub)
        return sub

    for m in range(2):
        send(m, 0, 8)
    for sub in ex.drain():
        s.receive(sub, 0.0)
    s.poll(0.0, live={0, 1})
    send(0, 0, 16)  # one version behind: decoded against the kept v0
    send(1, 1, 17)
    for sub in ex.drain():
        assert sub.wire == "int4:4"
        assert s.receive(sub, 1.0)
    arrays, meta = s.state_dict()
    assert set(arrays["bases"]["fragment_000"]) == {"back_01"}
    json.dumps(meta)
    _, fresh = _int4_syncer(max_staleness=1)
    fresh.load_state_dict(arrays, meta, ex.read_submission)
    for m in range(2):
        np.testing.assert_array_equal(fresh.pending_params[0][m]["w"], s.pending_params[0][m]["w"])
    a, b = s.poll(2.0, live={0, 1}), fresh.poll(2.0, live={0, 1})
    assert a == b and s.global_params[0]["w"].tobytes() == fresh.global_params[0]["w"].tobytes()


def test_config_names_the_wire_format():
    from pydantic import ValidationError

    from configs.load import load_config
    from configs.schema import ExperimentConfig
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs" / "default.yaml", {"diloco.wire.dtype": "int4", "diloco.wire.block_size": 64})
    assert cfg.diloco.wire.spec == "int4:64" and WireFormat.parse(cfg.diloco.wire.spec) == WireFormat("int4", 64)
    assert ExperimentConfig().diloco.wire.spec == "float32"  # the default changes no existing run
    for bad in ({"dtype": "int2"}, {"dtype": "bfloat16", "block_size": 8}, {"dtype": "int8", "block_size": 0}):
        with pytest.raises(ValidationError, match="wire"):
            ExperimentConfig.model_validate({"diloco": {"wire": bad}})


# -- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_pretrain_with_int4_on_the_fsspec_exchange(prefect_harness, small_cfg, small_data, tmp_path):
    """The tiny config with ``diloco.wire.dtype: int4`` on the durable exchange: the run completes and
    trains, every merged submission carries about 1/8 of its float32 bytes (codes ½ byte a value
    plus one float32 scale per tensor), and the learners' ``bytes_to_syncer`` counts those payloads."""
    from configs.schema import ExperimentConfig
    from flows.pretrain import pretrain_diloco
    from run.layout import RunLayout
    from run.metrics import read_jsonl

    run_dir = tmp_path / "run"
    shutil.copytree(small_data, run_dir)
    layout = RunLayout(run_dir)
    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "diloco": {**small_cfg.diloco.model_dump(), "grace_s": 0.05, "wire": {"dtype": "int4"}},
            "train": {**small_cfg.train.model_dump(), "token_budget": 6144, "eval_every_tokens": 6144},
            "runtime": {"exchange": "fsspec"},
        }
    )
    summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=1.0)
    assert summary["tokens"] == cfg.dp_steps * cfg.tokens_per_dp_step
    assert summary["hyperparameters"]["wire format (learner→syncer)"] == "int4"
    curve = read_jsonl(layout.metrics("pretrain", "diloco", "eval"))
    assert np.isfinite(summary["final_val_loss"]) and curve[-1]["val/loss"] < curve[0]["val/loss"]
    merges = read_jsonl(layout.metrics("pretrain", "diloco", "merges"))
    # none refused for its payload (the tiny model's 3 ms steps can let a newer copy supersede one
    # not merged yet, or a copy arrive stale, on this exchange with any wire format: README, "What
    # it costs here"); a payload the syncer could not decode would be non-finite or wrong-tensors
    assert merges and set(summary["work_lost"]["reasons"]) <= {"superseded", "stale"}
    as_float32 = sum(m["fragment_bytes"] * len(m["contributors"]) for m in merges)
    merged = sum(m["bytes_in"] for m in merges)
    assert merged == summary["bytes_merged"] <= summary["bytes_to_syncer"]
    ratio = merged / as_float32
    print(
        f"\nint4: {merged:,} bytes merged in {len(merges)} merges, {ratio:.4f} of float32's {as_float32:,}; "
        f"bytes_to_syncer {summary['bytes_to_syncer']:,}, final loss {summary['final_val_loss']:.4f}"
    )
    assert 1 / 8 < ratio < 0.13  # ½ byte a value, plus 4 bytes a tensor
