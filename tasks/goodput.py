"""Prefect tasks for the goodput study (``flows/goodput.py``) over plain functions: simulate the grid
(``diloco.goodput``) and write the run directory (goodput.json, goodput.md, goodput.png)."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from diloco.goodput import PAPER_TABLE1, GoodputConfig, markdown_report, run_goodput, system_label

OUTPUTS = ("goodput.json", "goodput.md", "goodput.png")


def plot_goodput(result: dict, path: Path) -> Path:
    """Goodput vs chips (log axis), one line per system with its confidence interval; the paper's
    Table 1 values as hollow markers of the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = GoodputConfig.model_validate(result["config"])
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, system in enumerate(cfg.systems):
        cells = sorted((c for c in result["cells"] if c["system"] == system), key=lambda c: c["chips"])
        x = [c["chips"] for c in cells]
        color = colors[i % len(colors)]
        ax.errorbar(x, [c["goodput"] for c in cells], yerr=[c["goodput_ci"] for c in cells], color=color,
                    marker="o", ms=4, capsize=3, label=f"{system_label(system)} (sim)")
        paper = [(c["chips"], c["paper"]) for c in cells if c["paper"] is not None]
        if paper and system in PAPER_TABLE1:
            ax.plot(*zip(*paper), linestyle="none", marker="s", ms=8, mfc="none", mec=color)
    ax.plot([], [], linestyle="none", marker="s", ms=8, mfc="none", mec="gray", label="paper, Table 1")
    ax.set_xscale("log")
    ax.set_xticks(sorted(cfg.chips))
    ax.set_xticklabels([f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k" for n in sorted(cfg.chips)])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(f"Goodput under failures (per-chip MTBI {cfg.chip_mtbi_years:g} y; "
                 f"{cfg.confidence:.0%} CI over {cfg.seeds} seeds)", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: dict, out_dir: Path) -> dict[str, Path]:
    """Write goodput.json (everything), goodput.md (the tables) and goodput.png into ``out_dir``.

    Refuses (``FileExistsError``) to overwrite a directory that already holds a goodput.json.
    """
    out = Path(out_dir)
    if (out / "goodput.json").exists():
        raise FileExistsError(f"{out / 'goodput.json'} exists; choose another --out directory")
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in OUTPUTS}
    paths["goodput.json"].write_text(json.dumps(result, indent=2))
    paths["goodput.md"].write_text(markdown_report(result))
    plot_goodput(result, paths["goodput.png"])
    return paths


@task(name="simulate-goodput", cache_policy=NO_CACHE)
def simulate_task(cfg: GoodputConfig) -> dict:
    return run_goodput(cfg)


@task(name="write-goodput", cache_policy=NO_CACHE)
def write_task(result: dict, out_dir: str) -> dict[str, str]:
    return {k: str(v) for k, v in write_outputs(result, Path(out_dir)).items()}
