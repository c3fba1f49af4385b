"""The mixture-of-experts part of the report: how evenly each MoE layer routes, per method, from the
held-out evaluations (``metrics/eval.jsonl``: ``val/moe/<block>/load/<e>``, the share of routing
choices that picked expert e; ``val/moe/<block>/dropped``; ``val/moe/aux``, the Switch Transformer
load-balancing loss E·Σ f·P, 1 for a uniform router). DiLoCo: Θ, the syncer's global parameters.
"""

from __future__ import annotations

import re

from matplotlib.figure import Figure

from reports.common import label, num
from reports.plots import finish_axes, new_figure
from reports.read import MethodRecords

_LOAD = re.compile(r"^val/moe/(\d+)/load/(\d+)$")


def _loads(row: dict) -> dict[int, dict[int, float]]:
    """block → expert → load fraction, from one eval row."""
    out: dict[int, dict[int, float]] = {}
    for key, value in row.items():
        m = _LOAD.match(key)
        if m and num(value) is not None:
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = float(value)
    return out


def expert_figures(records: dict[str, MethodRecords]) -> dict | None:
    """Per method with MoE metrics: ``layers`` (block → ``loads`` [E] at the last evaluation,
    ``busiest`` = max load × E, the busiest expert's load over the mean; ``dropped`` fraction), ``aux``
    (``first``, ``peak``, ``last`` load-balancing loss) and ``tokens``. None without expert loads."""
    out = {}
    for m, rec in records.items():
        rows = [r for r in (rec.curve or []) if _loads(r)]
        if not rows:
            continue
        last = rows[-1]
        layers = {}
        for block, loads in sorted(_loads(last).items()):
            vec, dropped = [loads[e] for e in sorted(loads)], num(last.get(f"val/moe/{block}/dropped"))
            layers[block] = {"loads": vec, "busiest": max(vec) * len(vec), "dropped": dropped}
        aux = [float(r["val/moe/aux"]) for r in rows if num(r.get("val/moe/aux")) is not None]
        aux_fig = {"first": aux[0], "peak": max(aux), "last": aux[-1]} if aux else None
        out[m] = {"layers": layers, "tokens": last.get("tokens"), "aux": aux_fig}
    return out or None


def expert_load_figure(records: dict[str, MethodRecords], unit: str = "tokens") -> Figure | None:
    """Expert load (fraction of routing choices) against training tokens: one panel per method and
    MoE layer, one line per expert, the uniform share 1/E dashed. None without MoE metrics."""
    panels = []
    for m, rec in records.items():
        rows = [r for r in (rec.curve or []) if _loads(r) and num(r.get("tokens")) is not None]
        if rows:
            for block in sorted(_loads(rows[-1])):
                panels.append((m, block, rows))
    if not panels:
        return None
    methods = list(dict.fromkeys(m for m, _, _ in panels))
    blocks = sorted({b for _, b, _ in panels})
    fig = new_figure(3.6 * len(blocks), 2.9 * len(methods))
    axes = fig.subplots(len(methods), len(blocks), squeeze=False, sharey=True)
    for m, block, rows in panels:
        ax = axes[methods.index(m)][blocks.index(block)]
        xs = [float(r["tokens"]) for r in rows]
        per_expert = sorted(_loads(rows[-1])[block])
        for e in per_expert:
            ax.plot(xs, [_loads(r).get(block, {}).get(e) for r in rows], lw=1.2, label=f"expert {e}")
        ax.axhline(1.0 / len(per_expert), color="black", lw=0.8, ls="--")
        finish_axes(ax, f"training {unit}", "share of routing choices", f"{label(m)}: block {block + 1}", title_size=9)
    axes[0][-1].legend(fontsize=7, ncol=2)
    return fig
