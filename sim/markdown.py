"""The goodput study as markdown (``goodput.md``): goodput and uptime tables against the paper's
Table 1, the rule of thumb and the constants with their sources. Pure: reads the dict that
:func:`sim.study.run_goodput` returns.
"""

from __future__ import annotations

from sim.config import CALIBRATED_FIELDS, CALIBRATION_ROWS, GoodputConfig, system_label


def _pm(mean: float, half: float) -> str:
    """``mean ± half`` with one decimal, two for half-widths under 0.1 (so a tight interval is not 0.0)."""
    return f"{mean:.1f} ± {half:.2f}" if half < 0.095 else f"{mean:.1f} ± {half:.1f}"


def chips_label(n: int) -> str:
    """A cluster size as text: 150000 → "150k", 2400000 → "2.4M"."""
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def markdown_report(result: dict) -> str:
    """The study as markdown: goodput (predicted ± CI, paper, difference), uptime, the rule of thumb,
    the constants (stated or calibrated) and the worst DiLoCo cell."""
    cfg = GoodputConfig.model_validate(result["config"])
    chips = sorted(cfg.chips)
    cell = {(c["system"], c["chips"]): c for c in result["cells"]}
    head = "| system | role | " + " | ".join(chips_label(n) for n in chips) + " |"
    rule = "|---|---|" + "---|" * len(chips)
    lines = [
        "# Goodput at scale: simulated Table 1 of Decoupled DiLoCo (arXiv 2604.21428)",
        "",
        f"Per-chip MTBI {cfg.chip_mtbi_years:g} year(s); {cfg.seeds} seeds (base seed {cfg.seed}) × "
        f"{cfg.failures_per_run} expected interruptions per run; ± is the {cfg.confidence:.0%} confidence "
        f"interval over seeds. Grid wall time {result['wall_s']:.1f} s.",
        "",
        "## Goodput (%): predicted ± CI (paper, predicted − paper)",
        "",
        "Calibration rows were fitted to the paper (only `restart_s`, `downscale_s`, `upscale_s`); the "
        "Decoupled DiLoCo rows are predictions.",
        "",
        head,
        rule,
    ]
    changed = _changed_from_defaults(cfg, result)
    if changed:
        lines[-3:-3] = [
            "",
            f"This run changes {', '.join(f'`{k}`' for k in changed)} from the defaults, so the "
            "differences from the paper show the effect of that change, not the model's error.",
        ]
    lines += _goodput_rows(cfg, chips, cell)
    w = result.get("worst")
    lines.append("")
    if w:
        lines.append(
            f"**Worst Decoupled DiLoCo cell:** {system_label(w['system'])} at {chips_label(w['chips'])} "
            f"chips: predicted {w['goodput']:.1f} vs paper {w['paper']} ({w['diff']:+.1f} points)."
        )
    if result.get("calibration_rmse") is not None:
        lines.append(f"RMS error on the two calibration rows: {result['calibration_rmse']:.1f} points.")
    lines += [
        "",
        "## Uptime (%): time the system as a whole advances",
        "",
        f"DP: the job runs. Decoupled DiLoCo: at least K = {cfg.quorum} learner(s) run.",
        "",
        head,
        rule,
    ]
    for s in cfg.systems:
        row = [_pm(cell[(s, n)]["uptime"], cell[(s, n)]["uptime_ci"]) for n in chips]
        lines.append(f"| {system_label(s)} | | " + " | ".join(row) + " |")
    lines += _rule_of_thumb_lines(result) + _constants_lines(result)
    return "\n".join(lines) + "\n"


def _changed_from_defaults(cfg: GoodputConfig, result: dict) -> list[str]:
    """The constants (and ``quorum``) this run sets away from their defaults, calibrated ones aside."""
    fields = GoodputConfig.model_fields
    return [
        k
        for k in (*result["constants"], "quorum")
        if k in fields
        and k not in (CALIBRATED_FIELDS if result.get("calibration") else ())
        and getattr(cfg, k) != fields[k].default
    ]


def _goodput_rows(cfg: GoodputConfig, chips: list, cell: dict) -> list[str]:
    """The goodput table's rows: per system, predicted ± CI (paper, difference) at each chip count."""
    lines = []
    for s in cfg.systems:
        row = []
        for n in chips:
            c = cell[(s, n)]
            txt = _pm(c["goodput"], c["goodput_ci"])
            if c["paper"] is not None:
                txt += f" ({c['paper']}, {c['diff']:+.1f})"
            row.append(txt)
        role = "calibration" if s in CALIBRATION_ROWS else "prediction"
        lines.append(f"| {system_label(s)} | {role} | " + " | ".join(row) + " |")
    return lines


def _rule_of_thumb_lines(result: dict) -> list[str]:
    """The rule-of-thumb section (none without ``rule_of_thumb`` rows)."""
    if not result.get("rule_of_thumb"):
        return []
    lines = [
        "",
        "## Rule of thumb: M learners at N chips ≈ one elastic job at N/M chips",
        "",
        "| M | N | Decoupled DiLoCo at N | elastic DP at N/M | difference |",
        "|---|---|---|---|---|",
    ]
    for r in result["rule_of_thumb"]:
        lines.append(
            f"| {r['learners']} | {chips_label(r['chips'])} | {_pm(r['diloco'], r['diloco_ci'])} | "
            f"{_pm(r['elastic'], r['elastic_ci'])} ({chips_label(r['elastic_chips'])}) | "
            f"{r['diff']:+.1f} |"
        )
    return lines


def _constants_lines(result: dict) -> list[str]:
    """The constants section: each constant's value and source, then the calibration run if any."""
    fields = GoodputConfig.model_fields
    lines = ["", "## Constants", "", "| constant | value | source |", "|---|---|---|"]
    calibrated = set(result.get("calibrated", ()))
    for k, v in result["constants"].items():
        if k == "mean_recovery_s":
            src = "derived from the recovery distribution"
        elif k in calibrated and result.get("calibration"):
            src = "calibrated on the DP rows in this run"
        elif v != fields[k].default:
            src = f"set for this run (default {fields[k].default:g})"
        elif k in calibrated:
            src = "calibrated on the DP rows (shipped default)"
        else:
            src = "paper" if k == "chip_mtbi_years" else "stated"
        lines.append(f"| `{k}` | {v:g} | {src} |")
    if result.get("calibration"):
        cal = result["calibration"]
        lines += [
            "",
            f"Calibration ran in this job ({cal['wall_s']:.1f} s, {cal['seeds']} seeds × "
            f"{cal['failures_per_run']} interruptions): RMS {cal['rmse']['dp']:.2f} (DP) and "
            f"{cal['rmse']['elastic']:.2f} (elastic) points.",
        ]
    return lines
