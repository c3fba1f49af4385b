"""The goodput study's files: ``goodput.json`` (everything), ``goodput.md`` (the tables) and
``goodput.png`` (goodput against chips), drawn with the report's plot style (:mod:`reports.plots`).
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from reports.plots import cycle_colors, finish_axes, new_figure, save_png
from run.layout import GoodputLayout
from sim.config import PAPER_TABLE1, GoodputConfig, system_label
from sim.markdown import chips_label, markdown_report


def goodput_figure(result: dict) -> Figure:
    """Goodput (%) against chips (log axis) for a :func:`sim.study.run_goodput` result: one line
    per system with its confidence interval as error bars, the paper's Table 1 values as hollow
    squares of the same colour."""
    cfg = GoodputConfig.model_validate(result["config"])
    fig = new_figure(7.5, 5.0)
    ax = fig.add_subplot()
    colors = cycle_colors()
    for i, system in enumerate(cfg.systems):
        cells = sorted((c for c in result["cells"] if c["system"] == system), key=lambda c: c["chips"])
        color = colors[i % len(colors)]
        ax.errorbar(
            [c["chips"] for c in cells],
            [c["goodput"] for c in cells],
            yerr=[c["goodput_ci"] for c in cells],
            color=color,
            marker="o",
            ms=4,
            capsize=3,
            label=f"{system_label(system)} (sim)",
        )
        paper = [(c["chips"], c["paper"]) for c in cells if c["paper"] is not None]
        if paper and system in PAPER_TABLE1:
            ax.plot(*zip(*paper), linestyle="none", marker="s", ms=8, mfc="none", mec=color)
    ax.plot([], [], linestyle="none", marker="s", ms=8, mfc="none", mec="gray", label="paper, Table 1")
    ax.set_xscale("log")
    chips = sorted(cfg.chips)
    ax.set_xticks(chips)
    ax.set_xticklabels([chips_label(n) for n in chips])
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    finish_axes(
        ax,
        "chips",
        "goodput (%)",
        f"Goodput under failures (per-chip MTBI {cfg.chip_mtbi_years:g} y; "
        f"{cfg.confidence:.0%} CI over {cfg.seeds} seeds)",
        title_size=10,
    )
    ax.legend(fontsize=8, loc="lower left")
    return fig


def plot_goodput(result: dict, path: Path) -> Path:
    """:func:`goodput_figure` saved as PNG to ``path``; returns ``path``."""
    return save_png(goodput_figure(result), Path(path))


def write_outputs(result: dict, out_dir: Path) -> dict[str, Path]:
    """Write goodput.json (everything), goodput.md (the tables) and goodput.png into ``out_dir``
    (created with its parents); returns file name → path.

    Refuses (``FileExistsError``) to overwrite a directory that already holds a goodput.json.
    """
    lay = GoodputLayout(Path(out_dir))
    if lay.result.exists():
        raise FileExistsError(f"{lay.result} exists; choose another --out directory")
    lay.root.mkdir(parents=True, exist_ok=True)
    lay.result.write_text(json.dumps(result, indent=2))
    lay.markdown.write_text(markdown_report(result))
    plot_goodput(result, lay.figure)
    return {p.name: p for p in (lay.result, lay.markdown, lay.figure)}
