"""Sweeps: the spec and its cells (plain functions), the checks before anything starts, and one real
2 × 2 sweep of the tiny config through the ``sweep`` flow, re-run to show that finished cells are
not started again."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from configs.specs import load_spec
from configs.sweep import SweepSpec, cell_config, config_digest, expand_cells, shipped_sweeps
from tests.conftest import ROOT, SMALL_DATA, squash

REPO = Path(__file__).resolve().parent.parent


def spec(**kw) -> SweepSpec:
    return SweepSpec.model_validate({"name": "t", "base": "tiny", **kw})


def test_grid_cells_are_every_combination_named_from_their_overrides():
    s = spec(
        grid={"diloco.learners": [2, 4], "diloco.quorum": [1, 2]},
        cells=[{"diloco.inner.lr": 0.01, "finetune.optimizer.lr": 0.1}],
    )
    cells = expand_cells(s)
    assert [c.name for c in cells] == [
        "learners-2_quorum-1",
        "learners-2_quorum-2",
        "learners-4_quorum-1",
        "learners-4_quorum-2",
        "inner-lr-0.01_optimizer-lr-0.1",
    ]
    assert cells[2].overrides == {"diloco.learners": 4, "diloco.quorum": 1}  # the first key varies slowest
    cfg = cell_config(s, cells[3])
    assert (cfg.name, cfg.diloco.learners, cfg.diloco.quorum) == ("learners-4_quorum-2", 4, 2)
    assert cfg.model.d_model == 32  # the rest is the base's (configs/tiny.yaml)
    s2 = spec(grid={"model.kind": ["dense_lm", "moe_lm"]}, overrides={"model.n_experts": 4})
    with pytest.raises(ValueError, match=r"cell kind-dense-lm: model.n_experts: Extra inputs are not permitted"):
        cell_config(s2, expand_cells(s2)[0])  # the shared override does not fit the dense kind
    assert cell_config(s2, expand_cells(s2)[1]).model.n_experts == 4


def test_a_cell_is_identified_by_its_resolved_config():
    s = spec(grid={"diloco.learners": [2, 3]})
    a, b = (cell_config(s, c) for c in expand_cells(s))
    assert config_digest(a.model_dump(mode="json")) != config_digest(b.model_dump(mode="json"))
    again = cell_config(spec(grid={"diloco.learners": [2]}, overrides={"diloco.quorum": 2}), expand_cells(s)[0])
    # tiny's quorum is 2: the same run
    assert config_digest(again.model_dump(mode="json")) == config_digest(a.model_dump(mode="json"))


@pytest.mark.parametrize(
    "kw, message",
    [
        ({}, "grid: the sweep is empty"),
        ({"grid": {"diloco.learners": []}}, "grid.diloco.learners: no values"),
        ({"grid": {"diloco.learners": [2, 2]}}, "listed twice"),
        ({"grid": {"run_root": ["a"]}}, "grid.run_root: the sweep names and places"),
        ({"grid": {"diloco learners": [2]}}, "is not a dotted config key"),
        ({"cells": [{}]}, r"cells\[0\]: an empty cell"),
        ({"grid": {"diloco.learners": [2]}, "concurrency": 0}, "concurrency"),
        ({"grid": {"diloco.learners": [2]}, "launch": "ray"}, "launch"),
        ({"grid": {"diloco.learners": [2]}, "extra": 1}, "extra"),
        (
            {"grid": {"diloco.learners": [2, 4]}, "overrides": {"diloco.learners": 8}},
            "overrides.diloco.learners: also set by the grid's axis diloco.learners",
        ),
        (
            {"grid": {"diloco.learners": [2, 4]}, "overrides": {"diloco": {"learners": 8}}},
            "overrides.diloco: also set by the grid's axis diloco.learners",
        ),
    ],
)
def test_bad_sweeps_are_refused_naming_the_field(kw, message):
    with pytest.raises(ValidationError, match=message):
        spec(**kw)


def test_two_cells_with_the_same_overrides_are_refused():
    with pytest.raises(ValueError, match="cell 2 sets the same overrides as cell 1"):
        expand_cells(spec(grid={"diloco.learners": [2]}, cells=[{"diloco.learners": 2}]))


def test_shipped_sweeps_load_and_their_cells_validate():
    names = {p.stem for p in shipped_sweeps()}
    assert {"tiny_grid", "nightly"} <= names
    for name in names:
        s = load_spec("sweep", name)
        assert [cell_config(s, c).name for c in expand_cells(s)]
    tiny = load_spec("sweep", "tiny_grid")
    assert len(expand_cells(tiny)) == 4 and tiny.base == "tiny" and tiny.resume
    assert not load_spec("sweep", "nightly").resume  # a new folder each night


def test_preflight_plans_new_completed_and_stopped_cells(tmp_path):
    from flows.preflight import sweep_preflight

    s = spec(grid={"diloco.learners": [2, 3]}, overrides=SMALL_DATA)
    plan = sweep_preflight(s, tmp_path / "sw")
    assert [(c.cell.name, c.action) for c in plan.cells] == [("learners-2", "run"), ("learners-3", "run")]
    assert not (tmp_path / "sw").exists()  # writes nothing
    done, stopped = plan.cells[0].run_dir, plan.cells[1].run_dir
    done.mkdir(parents=True)
    (done / "config.json").write_text(json.dumps(plan.cells[0].cfg.model_dump(mode="json")))
    (done / "status.json").write_text(json.dumps({"status": "completed"}))
    _write_results(done)
    stopped.mkdir(parents=True)
    (stopped / "status.json").write_text(json.dumps({"status": "interrupted"}))
    (tmp_path / "sw" / "sweep.json").write_text("{}")
    plan = sweep_preflight(s, tmp_path / "sw")
    assert [(c.action, c.previous) for c in plan.cells] == [("skip", "completed"), ("rerun", "interrupted")]
    # the same name with another config: the completed cell is not silently reused or overwritten
    other = spec(grid={"diloco.learners": [2, 3]}, overrides={**SMALL_DATA, "train.token_budget": 12288})
    with pytest.raises(
        ValueError,
        match=r"cell learners-2: .* holds a completed run of another config "
        r"\(train.token_budget: 24576 there, 12288 now\)",
    ):
        sweep_preflight(other, tmp_path / "sw")
    (tmp_path / "notsweep").mkdir()
    (tmp_path / "notsweep" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="holds no sweep.json"):
        sweep_preflight(s, tmp_path / "notsweep")
    bad = spec(grid={"diloco.quorum": [1, 5]}, overrides=SMALL_DATA)
    with pytest.raises(ValueError, match=r"cell quorum-5: diloco.quorum \(K=5\) must be ≤ diloco.learners"):
        sweep_preflight(bad, tmp_path / "sw2")
    missing = spec(grid={"diloco.learners": [2]}, overrides={"data.source": "local", "data.paths": ["/nope.jsonl"]})
    with pytest.raises(FileNotFoundError, match="cell learners-2: data.paths: file not found: /nope.jsonl"):
        sweep_preflight(missing, tmp_path / "sw3")
    assert not (tmp_path / "sw2").exists() and not (tmp_path / "sw3").exists()


def _write_results(run_dir: Path, methods=("diloco", "dp")) -> None:
    """What a completed pipeline run holds besides config.json and status.json, as the sweep checks
    it: report/report.json (schema 3, only the keys a comparison reads) and pretrain/<m>/summary.json."""
    (run_dir / "report").mkdir(parents=True, exist_ok=True)
    ms = {
        m: {
            "status": "ok",
            "final_val_loss": 4.1 + 0.2 * i,
            "wall_s": 100.0,
            "tokens": 24576,
            "tokens_per_s": 245.0,
            "goodput": None,
            "bytes": {"total": 1000, "sent": 500},
            "eval": {},
        }
        for i, m in enumerate(methods)
    }
    (run_dir / "report" / "report.json").write_text(
        json.dumps(
            {"schema": 3, "stages": {"pretrain": {"unit": "tokens", "methods": ms, "loss_gaps": {}}}, "finetune": None}
        )
    )
    for m in methods:
        (run_dir / "pretrain" / m).mkdir(parents=True, exist_ok=True)
        (run_dir / "pretrain" / m / "summary.json").write_text(json.dumps({"tokens": 24576}))


def _completed_cell(pc, results: bool, methods=("diloco", "dp")) -> None:
    pc.run_dir.mkdir(parents=True)
    (pc.run_dir / "config.json").write_text(json.dumps(pc.cfg.model_dump(mode="json")))
    (pc.run_dir / "status.json").write_text(json.dumps({"status": "completed", "completed_stages": ["data"]}))
    if results:
        _write_results(pc.run_dir, methods)


def test_a_completed_cell_without_its_results_is_run_again(tmp_path):
    """status.json says completed, but the report or a method's summary is gone (a damaged or
    half-copied sweep): the cell is planned as a rerun naming what is missing, never skipped."""
    from flows.preflight import sweep_preflight

    s = spec(grid={"diloco.learners": [2, 3, 4]}, overrides=SMALL_DATA)
    plan = sweep_preflight(s, tmp_path / "sw")
    _completed_cell(plan.cells[0], results=True)
    _completed_cell(plan.cells[1], results=False)  # config.json + status.json only
    _completed_cell(plan.cells[2], results=True, methods=("diloco",))  # DP's summary is gone
    (tmp_path / "sw" / "sweep.json").write_text("{}")
    plan = sweep_preflight(s, tmp_path / "sw")
    assert [c.action for c in plan.cells] == ["skip", "rerun", "rerun"]
    assert plan.cells[1].previous == (
        "completed without its results (missing report/report.json, "
        "pretrain/diloco/summary.json, pretrain/dp/summary.json)"
    )
    assert plan.cells[2].previous == "completed without its results (missing pretrain/dp/summary.json)"
    # with the DP baseline off, DiLoCo's summary and the report are all a completed run holds
    s_nodp = spec(grid={"diloco.learners": [4]}, overrides={**SMALL_DATA, "dp.enabled": False})
    plan = sweep_preflight(s_nodp, tmp_path / "sw_nodp")
    _completed_cell(plan.cells[0], results=True, methods=("diloco",))
    (tmp_path / "sw_nodp" / "sweep.json").write_text("{}")
    assert [c.action for c in sweep_preflight(s_nodp, tmp_path / "sw_nodp").cells] == ["skip"]


def test_the_sweep_comparison_lists_every_cell_and_says_which_have_no_results(tmp_path):
    from flows.preflight import sweep_preflight
    from flows.sweep import sweep_report

    s = spec(grid={"diloco.learners": [2, 3, 4]}, overrides=SMALL_DATA)
    plan = sweep_preflight(s, tmp_path / "sw")
    _completed_cell(plan.cells[0], results=True)
    plan.cells[1].run_dir.mkdir(parents=True)  # a cell that failed before its report
    (plan.cells[1].run_dir / "status.json").write_text(json.dumps({"status": "failed", "reason": "OOM"}))
    _completed_cell(plan.cells[2], results=True)
    (plan.cells[2].run_dir / "report" / "report.json").write_text('{"schema": 3, "sta')  # damaged
    comparison = sweep_report.fn(plan, {})  # outside a flow run: written, not published
    assert [r["label"] for r in comparison["runs"]] == ["learners-2"]
    assert comparison["no_results"][0] == {
        "label": "learners-3",
        "run_dir": str(plan.cells[1].run_dir),
        "status": "failed",
        "reason": "OOM",
        "why": "no report/report.json",
    }
    assert comparison["no_results"][1]["label"] == "learners-4"
    assert comparison["no_results"][1]["why"].endswith(
        "learners-4/report/report.json: corrupt JSON (Unterminated string starting at at line 1, column 15)"
    )
    md = squash((tmp_path / "sw" / "report" / "comparison.md").read_text())
    assert "1 run directories compared (of 3; 2 with no results)" in md
    assert f"| learners-3 | no results (failed: OOM) | — | `{plan.cells[1].run_dir}` |" in md
    assert "- learners-3: no results (no report/report.json); status failed (OOM)" in md


@pytest.fixture
def prefect_imported():
    """Prefect configures logging on its first import, which drops caplog's handler: import it first."""
    import flows.sweep  # noqa: F401


def test_a_corrupt_sweep_record_is_kept_aside_with_a_warning(tmp_path, prefect_imported, caplog):
    from flows.sweep import _prior_results

    sw = tmp_path / "sw"
    sw.mkdir()
    (sw / "sweep.json").write_text('{"cells": [{"name": "learners-2", "wall_s": 1')  # cut short
    with caplog.at_level("WARNING"):
        assert _prior_results(sw) == {}
    kept = list(sw.glob("sweep.json.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_text() == '{"cells": [{"name": "learners-2", "wall_s": 1'
    assert not (sw / "sweep.json").exists()
    assert f"sweep.json is not a sweep record (not valid JSON); kept as {kept[0].name}" in caplog.text
    (sw / "sweep.json").write_text(json.dumps({"cells": [{"name": "learners-2", "wall_s": 3.0, "state": "x"}]}))
    assert _prior_results(sw) == {"learners-2": {"wall_s": 3.0}}  # a sound record is read, not moved


# ---------------------------------------------------------------------------------------------
# One real sweep through the flow (the session's Prefect test server)

FAST = {
    **SMALL_DATA,
    "train.token_budget": 3072,
    "train.eval_every_tokens": 3072,
    "eval.enabled": False,
    "finetune.enabled": False,
}


def _pipeline_runs(client, sweep_dir: Path) -> list:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["pipeline"])), limit=200)
    return [r for r in runs if str(r.parameters.get("run_dir", "")).startswith(str(sweep_dir))]


@pytest.mark.slow
def test_a_2x2_sweep_runs_every_cell_at_most_two_at_once_and_a_rerun_starts_none(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.sweep import sweep

    s = spec(
        name="e2e",
        grid={"diloco.quorum": [1, 2], "diloco.merge": ["token_weighted", "mean"]},
        overrides=FAST,
        concurrency=2,
    )
    sweep_dir = tmp_path / "sw"
    # a cell whose process died earlier: its folder is moved aside (kept) and the cell runs anew
    dead = sweep_dir / "cells" / "quorum-2_merge-mean"
    dead.mkdir(parents=True)
    (dead / "status.json").write_text(json.dumps({"status": "running"}))
    (sweep_dir / "sweep.json").write_text("{}")

    assert sweep(spec=s, sweep_dir=str(sweep_dir)) == str(sweep_dir)
    record = json.loads((sweep_dir / "sweep.json").read_text())
    cells = {c["name"]: c for c in record["cells"]}
    assert list(cells) == [
        "quorum-1_merge-token-weighted",
        "quorum-1_merge-mean",
        "quorum-2_merge-token-weighted",
        "quorum-2_merge-mean",
    ]
    assert all(c["status"] == "completed" and c["skipped"] is False for c in cells.values())
    assert cells["quorum-2_merge-mean"]["action"] == "rerun"
    assert (
        json.loads((sweep_dir / "attempts" / "quorum-2_merge-mean-1" / "status.json").read_text())["status"]
        == "running"
    )

    # the report: one row per cell, its numbers those of the cell's own report
    comparison = json.loads((sweep_dir / "report" / "comparison.json").read_text())
    assert comparison["axes"] == ["diloco.quorum", "diloco.merge"]
    assert [r["label"] for r in comparison["rows"]] == list(cells)
    for row in comparison["rows"]:
        config = json.loads((Path(row["run_dir"]) / "config.json").read_text())
        assert (row["diloco.quorum"], row["diloco.merge"]) == (config["diloco"]["quorum"], config["diloco"]["merge"])
        methods = json.loads((Path(row["run_dir"]) / "report" / "report.json").read_text())["stages"]["pretrain"][
            "methods"
        ]
        # the whole validation split (what selection reads); the gap is the test split's
        assert row["diloco/final_val_loss"] == methods["diloco"]["val_loss_whole"] is not None
        assert row["dp/final_val_loss"] == methods["dp"]["val_loss_whole"]
        assert row["dp/test_loss"] == methods["dp"]["test_loss"] is not None
        assert row["diloco/loss_gap_pct"] == pytest.approx(
            100 * (methods["diloco"]["test_loss"] / methods["dp"]["test_loss"] - 1)
        )
    assert (sweep_dir / "report" / comparison["plots"]["loss"]).is_file()
    assert "| quorum-1_merge-mean | 1 | mean |" in squash((sweep_dir / "report" / "comparison.md").read_text())
    # DP once: the four cells differ in DiLoCo's settings only, so one of them trained DP and the
    # others copied its result from the sweep's dp/ (one entry; the same figures everywhere)
    reused = [
        json.loads((Path(r["run_dir"]) / "pretrain" / "dp" / "summary.json").read_text()).get("reused_from")
        for r in comparison["rows"]
    ]
    (entry,) = [p for p in (sweep_dir / "dp").iterdir() if p.is_dir()]
    assert sorted(map(bool, reused)) == [False, True, True, True] and {r for r in reused if r} == {str(entry)}
    assert len({r["dp/final_val_loss"] for r in comparison["rows"]}) == 1
    for r, came in zip(comparison["rows"], reused):
        notes = json.loads((Path(r["run_dir"]) / "report" / "report.json").read_text())["stages"]["pretrain"]["notes"]
        assert any(f"reused from {came}" in n for n in notes) == bool(came)

    # Prefect's global concurrency limit held the cells to two at once
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("sweep-e2e").limit == 2
        runs = _pipeline_runs(client, sweep_dir)
        assert len(runs) == 4 and all(r.state.is_completed() for r in runs)
        events = sorted([(r.start_time, 1) for r in runs] + [(r.end_time, -1) for r in runs])
        running = peak = 0
        for _, step in events:
            running += step
            peak = max(peak, running)
        assert peak == 2
        # the live progress artifact ends at every cell finished, the report's artifacts are there
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        keys = ["sweep-progress-e2e", "compare-e2e", "compare-table-e2e"]
        found = {
            a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
        }
        assert set(found) == set(keys) and float(found["sweep-progress-e2e"].data) == 100.0

    # a re-run finds every cell completed with its config: no pipeline run starts
    assert sweep(spec=s, sweep_dir=str(sweep_dir)) == str(sweep_dir)
    again = json.loads((sweep_dir / "sweep.json").read_text())
    assert all(c["action"] == "skip" and c["skipped"] is True for c in again["cells"])
    with get_client(sync_client=True) as client:
        assert len(_pipeline_runs(client, sweep_dir)) == 4


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "error: no sweep given: name a sweep file or a shipped sweep (mixed_hardware, nightly, size_ladder, "),
        (
            ["--set", "diloco.learners=2"],
            "error: no sweep given: name a sweep file or a shipped sweep (",
        ),
        (
            ["tiny_grid", "--axis", "diloco.lerners=[2,4]"],
            "error: sweep tiny-grid, cell learners-2_quorum-1_lerners-2: "
            "diloco.lerners: Extra inputs are not permitted",
        ),
        (["tiny_grid", "--axis", "diloco.learners=4"], "error: --axis diloco.learners=4: give a list of values"),
        (
            ["tiny_grid", "--concurrency", "0"],
            "error: invalid sweep tiny_grid: concurrency: Input should be greater than 0 (cells running at once, ",
        ),
        (["nosuch"], "error: sweep file not found: nosuch (neither a file nor a shipped sweep; shipped: "),
        (
            ["tiny_grid", "--launch", "deployment"],
            "error: sweep tiny-grid: launch: deployment runs each cell through a "
            "deployment's worker, which needs a Prefect server",
        ),
    ],
)
def test_sweep_cli_refuses_bad_input_in_one_line(args, message, tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # no server, even beside the test harness
        result = CliRunner().invoke(app, ["sweep", *args, "--sweep-dir", str(tmp_path / "sw")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert not (tmp_path / "sw").exists()


@pytest.mark.slow
def test_a_stop_while_a_cell_waits_for_a_worker_cancels_it_and_ends_the_sweep(prefect_harness, tmp_path):
    """`launch: deployment` with no worker: the cell's flow run waits, scheduled. A stop signal (as
    SIGINT/SIGTERM would set it) cancels that run, the cell waiting for a slot never starts, and the
    sweep ends Cancelled within seconds instead of waiting for ever."""
    import threading
    import time

    from prefect.client.orchestration import get_client

    from flows.sweep import sweep
    from run.control import request_stop, reset

    with get_client(sync_client=True) as client:  # a pipeline deployment that no worker serves
        client.create_deployment(
            flow_id=client.create_flow_from_name("pipeline"), name="nobody", entrypoint="flows/pipeline.py:pipeline"
        )
    s = spec(
        name="stop", grid={"diloco.quorum": [1, 2]}, overrides=FAST, launch="deployment", deployment="pipeline/nobody"
    )
    timer = threading.Timer(10, request_stop)
    timer.start()
    try:
        t0 = time.monotonic()
        state = sweep(spec=s, sweep_dir=str(tmp_path / "sw"), return_state=True)
        took = time.monotonic() - t0 - 10
    finally:
        timer.cancel()
        reset()
    assert state.is_cancelled() and took < 30, (state, took)
    cells = json.loads((tmp_path / "sw" / "sweep.json").read_text())["cells"]
    assert cells[0]["state"] in ("CANCELLING", "CANCELLED") and cells[1]["state"] == "NOT_STARTED"
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(cells[0]["flow_run_id"])
    assert run.state.name in ("Cancelling", "Cancelled") and run.parameters["run_dir"] == cells[0]["run_dir"]


def test_sweep_cli_refuses_a_deployment_that_is_not_there(prefect_harness, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(
        app,
        [
            "sweep",
            "tiny_grid",
            "--launch",
            "deployment",
            "--deployment",
            "pipeline/none",
            "--sweep-dir",
            str(tmp_path / "sw"),
        ],
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "deployment: pipeline/none is not deployed on the Prefect server" in lines[0], lines
    assert not (tmp_path / "sw").exists()


# A process that holds one slot of a sweep's concurrency limit the way a sweep cell does
# (flows.slots.slot), with short heartbeat timings so the test takes seconds: it prints
# "waiting", then "held" once it has the slot, and keeps it until its stdin closes.
SLOT_HOLDER = """
import sys
import flows.slots as slots
slots.SLOT_HEARTBEAT_S, slots.SLOT_STALE_S = 0.5, 8.0
print("waiting", flush=True)
with slots.slot(sys.argv[1], poll_s=0.5) as held:
    print("held" if held else "stopped", flush=True)
    sys.stdin.read()
print("released", flush=True)
"""


class _Holder:
    """A :data:`SLOT_HOLDER` process and the lines it printed (read by a thread)."""

    def __init__(self, limit: str):
        import os
        import queue
        import subprocess
        import sys
        import threading

        from prefect.settings import PREFECT_API_URL

        env = {
            **os.environ,
            "PREFECT_API_URL": PREFECT_API_URL.value(),
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(REPO),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SLOT_HOLDER, limit],
            cwd=REPO,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(x.rstrip("\n")) for x in self.proc.stdout], daemon=True).start()

    def wait_for(self, line: str, within_s: float) -> bool:
        """True once the process printed ``line``; False if it did not within ``within_s`` seconds."""
        import queue
        import time

        end = time.monotonic() + within_s
        while line not in self.seen:
            try:
                self.seen.append(self.lines.get(timeout=max(0.0, end - time.monotonic())))
            except queue.Empty:
                return False
        return True

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _active_slots(limit: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(limit).active_slots


@pytest.mark.slow
def test_a_dead_cells_slot_comes_back_and_a_living_one_keeps_it(prefect_harness):
    """A sweep of one name shares ``concurrency`` slots wherever it runs (a persistent server). A
    holder killed with SIGKILL cannot release its slot; a cell waiting for one frees it once the
    holder's heartbeat stops (here 8 s, 16 heartbeats, so that a loaded machine's slow server calls do not
    pass for a death; as shipped SLOT_STALE_S, well within a minute) instead of
    Prefect's lease keeping it for minutes. A living holder whose work outlasts that window keeps
    its slot (its heartbeat and Prefect lease are renewed) until it releases it."""
    import signal

    from flows.slots import set_concurrency_limit

    limit = "sweep-slot-test"
    set_concurrency_limit(limit, 1)
    holders: list[_Holder] = []
    try:
        # a living holder keeps its slot while a waiter watches it for longer than the stale window
        a = _Holder(limit)
        holders.append(a)
        assert a.wait_for("held", 120), a.seen
        b = _Holder(limit)
        holders.append(b)
        assert b.wait_for("waiting", 120), b.seen
        assert not b.wait_for("held", 20), b.seen  # 2.5 stale windows: A's heartbeat is renewed
        assert _active_slots(limit) == 1
        a.proc.stdin.close()  # A ends its work: the slot goes to B
        assert a.wait_for("released", 60), a.seen
        assert b.wait_for("held", 30), b.seen
        assert _active_slots(limit) == 1

        # B dies holding the slot: C, waiting for it, gets it well within a minute
        c = _Holder(limit)
        holders.append(c)
        assert c.wait_for("waiting", 120), c.seen
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(timeout=30)
        assert c.wait_for("held", 45), f"the dead holder's slot was not freed within 45 s: {c.seen[-2:]}"
        assert _active_slots(limit) == 1  # C's slot; B's lease was released, not leaked or counted twice
        c.proc.stdin.close()
        assert c.wait_for("released", 60), c.seen
        assert _active_slots(limit) == 0
        from prefect.client.orchestration import get_client

        from flows.slots import _heartbeats

        with get_client(sync_client=True) as client:
            assert _heartbeats(client, limit) == {}  # no holder's record is left behind
    finally:
        for h in holders:
            h.close()


def test_the_dp_digest_follows_what_dp_depends_on():
    """DiLoCo's settings, the runtime and the network leave DP's digest alone; DP's, the model's, the
    data's, the seed and the budget change it."""
    from configs.load import load_config
    from configs.sweep import dp_digest

    tiny = load_config(ROOT / "configs" / "tiny.yaml")
    same = [
        {"diloco.outer_lr": 0.5},
        {"diloco.quorum": 1},
        {"runtime.engine": "dask"},
        {"network.latency_ms": 5.0},
        {"name": "other"},
        {"eval.enabled": False},
        {"finetune.enabled": False},
    ]
    for o in same:
        assert dp_digest(load_config(ROOT / "configs" / "tiny.yaml", o)) == dp_digest(tiny), o
    for o in (
        {"dp.inner.lr": 0.001},
        {"seed": 1},
        {"train.token_budget": 49152},
        {"model.d_model": 64},
        {"data.val_docs": 3},
        {"precision.compute": "bfloat16"},
    ):
        assert dp_digest(load_config(ROOT / "configs" / "tiny.yaml", o)) != dp_digest(tiny), o


@pytest.mark.slow
def test_runs_that_share_dp_train_and_evaluate_it_once(prefect_harness, small_data, tmp_path, monkeypatch):
    """Two runs of the same DP settings through one ``dp_cache``: the first trains DP, runs lm-eval
    and stores both; the second copies both (lm-eval does not run again) with the same figures."""
    import shutil

    import flows.pipeline as P
    from configs.load import load_config
    from run.layout import RunLayout

    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        {
            **SMALL_DATA,
            "diloco.enabled": False,
            "finetune.enabled": False,
            "train.token_budget": 3072,
            "train.eval_every_tokens": 3072,
        },
    )
    cache, runs = tmp_path / "dp", [tmp_path / "a", tmp_path / "b"]
    for rd in runs:
        shutil.copytree(small_data, rd)
    assert P.pipeline(config=cfg, run_dir=str(runs[0]), dp_cache=str(cache)) == str(runs[0])

    def lm_eval_again(*args, **kwargs):
        raise AssertionError("DP was evaluated again")

    monkeypatch.setattr(P, "evaluate_task", lm_eval_again)
    assert P.pipeline(config=cfg, run_dir=str(runs[1]), dp_cache=str(cache)) == str(runs[1])
    first, second = (json.loads(RunLayout(rd).eval_result("pretrain", "dp").read_text()) for rd in runs)
    (entry,) = [p for p in (cache / "eval").iterdir() if p.is_dir()]
    assert "reused_from" not in first and second.pop("reused_from") == str(entry)
    assert second == first and 0.0 <= first["heldout_nextline/acc"] <= 1.0
    assert sorted(p.name for p in RunLayout(runs[1]).eval_outputs("pretrain", "dp").iterdir()) == sorted(
        p.name for p in RunLayout(runs[0]).eval_outputs("pretrain", "dp").iterdir()
    )
    notes = json.loads((RunLayout(runs[1]).report / "report.json").read_text())["stages"]["pretrain"]["notes"]
    assert any("its evaluation too" in n for n in notes)
