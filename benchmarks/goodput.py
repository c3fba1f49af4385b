"""Wall time of the goodput simulator's full grid (6 systems × 5 sizes × seeds) and the table it gives.

    python benchmarks/goodput.py [--set key=value ...] [--calibrate] [--sensitivity]

Prints the seconds the default study takes (``sim.run_goodput``: the 6 × 5 grid, 10 seeds,
plus the rule-of-thumb runs of elastic DP at N/M chips), then the markdown table. ``--calibrate`` also
times the calibration on the DP rows. ``--sensitivity`` changes one *stated* constant at a time,
recalibrates on the DP rows, and prints the worst Decoupled DiLoCo cell for each (about 20 s a
variant). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import scipy  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from configs.load import parse_overrides, validation_lines  # noqa: E402
from sim import GoodputConfig, calibrate, markdown_report, run_goodput  # noqa: E402

SENSITIVITY = [
    {},
    {"slice_chips": 64},
    {"slice_chips": 4096},
    {"detect_s": 2.0},
    {"detect_s": 10.0},
    {"detect_s": 12.0},
    {"recovery_scale_s": 12.0},
    {"recovery_scale_s": 48.0},
    {"recovery_a": 1.0, "recovery_c": 1.0, "recovery_scale_s": 29.7},  # exponential, same mean
    {"step_s": 10.0},
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], help="a GoodputConfig field, key=value")
    ap.add_argument("--calibrate", action="store_true", help="also time the calibration")
    ap.add_argument("--sensitivity", action="store_true", help="recalibrate under other stated constants")
    args = ap.parse_args()
    try:
        cfg = GoodputConfig.model_validate(parse_overrides(args.set))
    except ValidationError as exc:
        ap.error("invalid goodput settings: " + "; ".join(validation_lines(exc)))
    except ValueError as exc:
        ap.error(str(exc))
    print(
        f"# goodput  {time.strftime('%Y-%m-%d')}  {platform.machine()}  {os.cpu_count()} cores  "
        f"python {platform.python_version()}  numpy {np.__version__}  scipy {scipy.__version__}"
    )
    t = time.perf_counter()
    result = run_goodput(cfg)
    wall = time.perf_counter() - t
    w = result["worst"]
    print(
        f"full grid: {len(cfg.systems)} systems × {len(cfg.chips)} sizes × {cfg.seeds} seeds "
        f"({cfg.failures_per_run} expected interruptions per run) + rule of thumb: {wall:.2f} s"
    )
    print(
        f"worst Decoupled DiLoCo cell: {w['system']} at {w['chips']:,} chips, {w['goodput']:.1f} vs paper "
        f"{w['paper']} ({w['diff']:+.1f})\n"
    )
    print(markdown_report(result))
    if args.calibrate:
        t = time.perf_counter()
        cal = calibrate(cfg)
        print(f"calibration: {time.perf_counter() - t:.1f} s -> {cal['constants']}, RMS {cal['rmse']}")
    if args.sensitivity:
        print("\n| stated change | restart_s | downscale_s | upscale_s | RMS dp / elastic | worst DiLoCo cell |")
        print("|---|---|---|---|---|---|")
        for change in SENSITIVITY:
            c = cfg.model_copy(update=change)
            cal = calibrate(c)
            res = run_goodput(c.model_copy(update=cal["constants"]))
            k = cal["constants"]
            w = res["worst"]
            print(
                f"| {change or 'none (defaults)'} | {k['restart_s']:.1f} | {k['downscale_s']:.2f} | "
                f"{k['upscale_s']:.2f} | {cal['rmse']['dp']:.1f} / {cal['rmse']['elastic']:.1f} | "
                f"{w['system']} at {w['chips'] / 1e6:g}M: {w['diff']:+.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
