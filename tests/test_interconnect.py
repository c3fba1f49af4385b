"""Time under a stated interconnect (reports/interconnect.py): the ring all-reduce and the fragment
round trip by hand, a same-host network giving back the measured figures, and the report's section."""

import json

import pytest
from pydantic import ValidationError

from reports.common import settings
from reports.interconnect import Link, diloco_step_s, dp_step_s, interconnect_figures, ring_allreduce_s, time_to_loss
from tests.test_report import PRE, _layout, _make_run

DC = Link(1.0, 20.0, "links between datacenters")  # 1.25e8 bytes/s, 0.02 s


def test_the_ring_all_reduce_and_dp_overlap_by_hand():
    # 2(W−1)·(latency + G/(W·B)) = 6·(0.02 + 4e6/(4·1.25e8)) = 6·0.028
    assert ring_allreduce_s(4e6, 4, DC) == pytest.approx(0.168)
    assert ring_allreduce_s(4e6, 1, DC) == 0.0
    step = dp_step_s(0.2, 4e6, 4, DC, dp_overlap=0.5)  # half the compute (0.1 s) hides the all-reduce
    assert step["step_s"] == pytest.approx(0.2 + 0.068)
    assert step["keep_up_gbps"] == pytest.approx(2 * 3 / 4 * 4e6 / 0.2 / 1.25e8)  # 0.24 Gbit/s
    assert dp_step_s(0.2, 4e6, 4, DC)["step_s"] == pytest.approx(0.368)


def test_a_learner_pays_its_transfers_and_request_round_trips_in_line():
    slow = Link(0.1, 20.0)  # 1.25e7 bytes/s
    # P = 2, H = 8: a send every 4 steps of 4e6 bytes up, 8e6 down: round trip 0.04 + 12e6/1.25e7 = 1.0 s
    step = diloco_step_s(1.0, 1e6, 2e6, fragments=2, sync_every=8, link=slow)
    assert step["comm_s"] == pytest.approx(1.0)
    # (1e6 + 2e6)/1.25e7 = 0.24 s of bytes a step, and 3 + 2/4 round trips of 0.04 s
    assert step["transfer_s"] == pytest.approx(0.24 + 0.14) and step["step_s"] == pytest.approx(1.38)
    thin = diloco_step_s(1.0, 1e6, 2e6, 2, 8, Link(0.01, 0.0))  # 1.25e6 B/s, no latency
    assert thin["step_s"] == pytest.approx(3.4) and thin["keep_up_gbps"] == pytest.approx(2e6 / 1.25e8)
    with pytest.raises(ValueError, match="network.bandwidth_gbps must be > 0"):
        Link(0.0, 1.0)


def test_time_to_a_loss_interpolates_between_evaluations():
    curve = [
        {"modelled_s": 0.0, "val/loss": 6.0},
        {"modelled_s": 10.0, "val/loss": 4.0},
        {"modelled_s": 20.0, "val/loss": 3.0},
    ]
    assert time_to_loss(curve, 3.5) == pytest.approx(15.0)
    assert time_to_loss(curve, 6.5) == 0.0 and time_to_loss(curve, 2.0) is None


def _records(run):
    lay = _layout(run)

    def rec(m):
        rows = [json.loads(x) for x in lay.metrics(PRE, m, "eval").read_text().splitlines()]
        return {"summary": json.loads(lay.summary(PRE, m).read_text()), "curve": rows}

    return json.loads(lay.config.read_text()), rec("dp"), rec("diloco")


def test_a_same_host_network_gives_back_the_measured_figures_and_links_add_to_them(tmp_path):
    config, dp, dl = _records(_make_run(tmp_path))
    assert interconnect_figures(settings(config), dp, dl) is None  # a run from before the network section
    config["network"] = {"bandwidth_gbps": None, "latency_ms": 20.0, "dp_overlap": 0.0}
    same = interconnect_figures(settings(config), dp, dl)
    assert same["same_host"] and "no network" in same["assumption"]
    for m, f in same["methods"].items():
        assert f["modelled_wall_s"] == f["measured_wall_s"] and f["extra_s"] == 0.0
        assert [r["modelled_s"] for r in f["curve"]] == [r["wall_s"] for r in (dp if m == "dp" else dl)["curve"]]
    config["network"] = {
        "label": "links between datacenters",
        "bandwidth_gbps": 1.0,
        "latency_ms": 20.0,
        "dp_overlap": 0.0,
    }
    config["dp"]["workers"] = 1  # one worker: no traffic
    net = interconnect_figures(settings(config), dp, dl)
    assert net["assumption"].startswith("modelled: links between datacenters, 1 Gbit/s each way, 20 ms one way")
    f = net["methods"]["dp"]
    assert f["compute_s"] == pytest.approx(28.0 / 64) and f["extra_s"] == 0.0
    config["dp"]["workers"] = 2
    f = interconnect_figures(settings(config), dp, dl)["methods"]["dp"]
    grad = 63_209_472 / (2 * 1 * 64)  # bytes_to_syncer: the ring's sends (allreduce_bytes counts both ways)
    assert f["comm_s"] == pytest.approx(ring_allreduce_s(grad, 2, DC))
    assert f["modelled_wall_s"] == pytest.approx(28.0 + 64 * f["comm_s"])
    assert f["curve"][-1]["modelled_s"] == pytest.approx(f["modelled_wall_s"])
    times = interconnect_figures(settings(config), dp, dl)["time_to_dp_final_s"]
    assert times["dp"] == pytest.approx(f["modelled_wall_s"]) and times["diloco"] is None  # 3.30 never reaches 3.00


def test_the_config_section_refuses_bad_links_naming_the_field():
    from pathlib import Path

    from configs.load import load_config

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    assert load_config(tiny).network.bandwidth_gbps == 1.0
    for key, value in (("network.bandwidth_gbps", 0), ("network.latency_ms", -1), ("network.dp_overlap", 2)):
        with pytest.raises(ValidationError, match=key.split(".")[1]):
            load_config(tiny, {key: value})
    assert load_config(tiny, {"network.bandwidth_gbps": None}).network.bandwidth_gbps is None


def test_the_report_states_the_interconnect_beside_its_figures(tmp_path):
    from reports import build_report

    run = _make_run(tmp_path)
    lay = _layout(run)
    config = json.loads(lay.config.read_text())
    config["network"] = {
        "label": "links between datacenters",
        "bandwidth_gbps": 0.5,
        "latency_ms": 30.0,
        "dp_overlap": 0.0,
    }
    config["dp"]["workers"] = 2
    lay.config.write_text(json.dumps(config))
    report = build_report(run)
    net = report["stages"][PRE]["interconnect"]
    assert net["methods"]["dp"]["extra_s"] > 0 and net["short"] == "0.5 Gbit/s, 30 ms links"
    md = lay.report_md.read_text()
    assert "### Time under a stated interconnect" in md and net["assumption"] in md
    plot = report["stages"][PRE]["plots"]["loss_vs_modelled_time"]
    assert (lay.report / plot).stat().st_size > 0 and f"]({plot})" in md
