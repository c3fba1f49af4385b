"""The goodput flow: simulate the paper's failure study (Table 1) and publish table and plot.

Parameters are the simulator's knobs (:class:`sim.GoodputConfig`, a form in the UI), e.g. chips
failing twice as often (``chip_mtbi_years: 0.5``) or 10-minute restarts (``restart_s: 600``). Writes
``goodput.json``, ``goodput.md``, ``goodput.png`` and ``config.json`` to ``runs/goodput-<UTC time>/``
by default.
"""

# No `from __future__ import annotations` here: Prefect validates flow parameters from the
# annotations, and `flow.serve()` cloudpickles the flow function by value into its run process,
# keeping only the globals the body uses; string annotations (ExperimentConfig, Optional) then
# cannot be resolved there and every run is refused (tests/test_deployments.py).

import datetime as dt
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from run import atomic
from run.layout import GoodputLayout
from sim import GoodputConfig, n_slices
from tasks.goodput import simulate_task, write_task


@flow(name="goodput", log_prints=True)
def goodput(config: GoodputConfig = GoodputConfig(), out_dir: str | None = None) -> str:
    """Goodput and uptime of DP, elastic DP and Decoupled DiLoCo (M learners) under chip failures,
    against the paper's Table 1; returns the path of ``goodput.md``."""
    logger = get_run_logger()
    out = Path(out_dir or f"runs/goodput-{dt.datetime.now(dt.UTC).strftime('%Y%m%d-%H%M%S')}").absolute()
    lay = GoodputLayout(out)
    if lay.result.exists():
        raise FileExistsError(f"{lay.result} exists; choose another out_dir")
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_json(lay.config, config.model_dump(mode="json"))
    logger.info(
        "goodput: %d systems × %d sizes × %d seeds, %d expected interruptions per run; "
        "slices per size %s; constants %s%s",
        len(config.systems),
        len(config.chips),
        config.seeds,
        config.failures_per_run,
        {n: n_slices(config, n) for n in config.chips},
        config.constants(),
        " (recalibrating restart_s, downscale_s, upscale_s first)" if config.calibrate else "",
    )
    result = simulate_task(config)
    paths = write_task(result, str(out))
    w = result["worst"]
    logger.info(
        "grid simulated in %.1f s; calibration rows RMS %.1f points; worst DiLoCo cell %s",
        result["wall_s"],
        result["calibration_rmse"] or float("nan"),
        "n/a"
        if w is None
        else f"{w['system']} at {w['chips']:,} chips: {w['goodput']:.1f} vs paper {w['paper']} ({w['diff']:+.1f})",
    )
    markdown = Path(paths["goodput.md"]).read_text()
    markdown += f"\n\nFigure: `{paths['goodput.png']}`\n\nRun directory: `{out}`\n"
    create_markdown_artifact(markdown, key="goodput-report", description=f"Goodput study, {out}")
    rows = [
        {
            "system": c["label"],
            "chips": c["chips"],
            "goodput_pct": round(c["goodput"], 2),
            "ci_pct": round(c["goodput_ci"], 2),
            "uptime_pct": round(c["uptime"], 2),
            "paper_pct": c["paper"],
            "diff_pts": None if c["diff"] is None else round(c["diff"], 2),
            "role": c["role"],
        }
        for c in result["cells"]
    ]
    create_table_artifact(rows, key="goodput-table", description=f"Goodput per system and size, {out}")
    logger.info("table: %s  figure: %s", paths["goodput.md"], paths["goodput.png"])
    return paths["goodput.md"]
