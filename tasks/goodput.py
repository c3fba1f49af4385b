"""Prefect tasks for the goodput study (``flows/goodput.py``) over plain functions: simulate the grid
(``sim.run_goodput``) and write the run directory (``sim.outputs``: goodput.json, goodput.md,
goodput.png)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from sim import GoodputConfig, run_goodput
from sim.outputs import write_outputs


@task(name="simulate-goodput", cache_policy=NO_CACHE)
def simulate_task(cfg: GoodputConfig) -> dict:
    return run_goodput(cfg)


@task(name="write-goodput", cache_policy=NO_CACHE)
def write_task(result: dict, out_dir: str) -> dict[str, str]:
    return {k: str(v) for k, v in write_outputs(result, Path(out_dir)).items()}
