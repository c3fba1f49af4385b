"""Measured, not modelled: both methods across emulated datacenters, beside the interconnect model.

    python benchmarks/emulated.py OUT [--config configs/default.yaml] [--bandwidths none,1,0.3,0.1]
                                      [--no-failures] [--fail-at-s 60] [--restart-delay-s 10] [--set key=value ...]

Each cell is one ``ddiloco run`` of both pretrainings (no evaluation or fine-tuning) with
``network.emulate`` (as root): every DiLoCo learner and DP host (``dp.hosts`` = ``dp.workers``) a
process in a datacenter of its own, links shaped to one bandwidth each way (``none``: unshaped, the
same process layout: its compute is the model's compute term). With failures, each bandwidth also runs
with one real host failure at ``--fail-at-s`` seconds of each method's training clock: DiLoCo's learner
1 SIGKILLed, DP's host 1 SIGKILLed (the whole SPMD job down), each back after ``--restart-delay-s``.
Cells run one at a time into ``OUT/<cell>/``; a cell whose run completed is read, not run again (the
same command resumes). Expect 10-25 minutes a cell on 2 cores with the default config (DP's
all-reduce at 100 Mbit/s adds about half a second a step).

Per cell it prints each method's wall time (measured), the interconnect model's prediction for it
(``reports.interconnect`` on the unshaped cell's measurements, latency 0 as emulated) and its error,
seconds to DP's final held-out loss and to a common target loss (the worse of the two methods' final
losses in the unshaped cell), goodput (``reports.resilience``: measured from each run's events), and
the bytes the links carried beside the run's own count. For the failure cells, the goodput simulator's
prediction for the same failure rate (one failure a run over the M workers) beside it. Prints
figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs.load import load_config, stored_config  # noqa: E402
from reports.interconnect import interconnect_figures, time_to_loss  # noqa: E402
from reports.resilience import diloco_resilience, dp_resilience  # noqa: E402
from run.layout import RunLayout  # noqa: E402
from run.metrics import read_jsonl  # noqa: E402


def cell_name(bw: float | None, failure: bool) -> str:
    return f"{'unshaped' if bw is None else f'{bw:g}gbps'}{'-fail' if failure else ''}"


def run_cell(out: Path, config: str, bw: float | None, failure: bool, args) -> Path:
    """The cell's run directory, run now unless a completed run is there (an unfinished one is kept
    aside as ``<cell>.unfinished-<time>``)."""
    rd = out / cell_name(bw, failure)
    status = rd / "status.json"
    if status.exists() and json.loads(status.read_text()).get("status") == "completed":
        return rd
    if rd.exists():
        rd.rename(rd.with_name(f"{rd.name}.unfinished-{int(time.time())}"))
    sets = ["network.emulate=true", f"network.bandwidth_gbps={'null' if bw is None else bw}", "network.latency_ms=0"]
    sets += ["eval.enabled=false", "finetune.enabled=false", *args.set]
    if not any(s.startswith("dp.hosts=") for s in sets):  # one host per DP replica
        sets.append(f"dp.hosts={load_config(ROOT / config).dp.workers}")
    if failure:
        t, r = args.fail_at_s, args.restart_delay_s
        sets.append(
            f"chaos.events=[{{kind: kill, learner: 1, at_s: {t}, restart_delay_s: {r}}}, "
            f"{{kind: dp_fail, host: 1, at_s: {t}, restart_delay_s: {r}}}]"
        )
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        config,
        "--run-dir",
        str(rd),
        *[a for s in sets for a in ("--set", s)],
    ]
    t0 = time.monotonic()
    with open(out / f"{rd.name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    print(f"{rd.name}: ran in {time.monotonic() - t0:.0f} s (exit {code})", flush=True)
    return rd


def records(rd: Path) -> dict:
    """Per method: its summary, eval curve, events and the figures read from them."""
    layout = RunLayout(rd)
    cfg = stored_config(json.loads(layout.config.read_text()))
    out = {"config": cfg}
    for m in ("diloco", "dp"):
        summary = json.loads(layout.summary("pretrain", m).read_text())
        curve = read_jsonl(layout.metrics("pretrain", m, "eval"))
        if m == "diloco":
            res = diloco_resilience(
                read_jsonl(layout.metrics("pretrain", m, "learners")),
                read_jsonl(layout.metrics("pretrain", m, "merges")),
                None,
            )
        else:
            events = read_jsonl(layout.metrics("pretrain", m, "events"))
            res = dp_resilience(events, read_jsonl(layout.metrics("pretrain", m, "train")), cfg.dp.workers)
        out[m] = {"summary": summary, "curve": curve, "goodput": ((res or {}).get("global") or {}).get("goodput")}
    return out


def predicted_wall(base: dict, bw: float | None) -> dict[str, float | None]:
    """The interconnect model's wall time at ``bw`` (latency 0) from the unshaped cell's measurements."""
    if bw is None:
        return {m: base[m]["summary"]["wall_s"] for m in ("diloco", "dp")}
    raw = base["config"].model_dump(mode="json")
    raw["network"] = {**raw["network"], "emulate": False, "bandwidth_gbps": bw, "latency_ms": 0.0}
    raw["chaos"] = {**raw["chaos"], "events": []}  # (the model reads the network section alone)
    cfg = stored_config(raw)
    figs = interconnect_figures(cfg, base["dp"], base["diloco"]) or {"methods": {}}
    return {m: (figs["methods"].get(m) or {}).get("modelled_wall_s") for m in ("diloco", "dp")}


def curve_s(curve: list[dict], target: float) -> float | None:
    return time_to_loss([{**r, "modelled_s": r["wall_s"]} for r in curve], target)


def simulated(rec: dict, fail_at_s: float, restart_delay_s: float) -> dict | None:
    """The goodput simulator (``sim``) for this cell's failure rate: one failure in the run's span
    over the M workers (per-worker MTBF = M × span), restart delays of about ``restart_delay_s``,
    DP's measured step time, checkpoint interval and restart seconds."""
    from sim.study import simulate_goodput

    cfg = rec["config"]
    M = cfg.diloco.learners
    span = max(rec["dp"]["summary"]["wall_s"], rec["diloco"]["summary"]["wall_s"])
    dp = rec["dp"]["summary"]
    restarts = dp.get("restarts") or []
    restart_s = max(0.0, (restarts[0]["down_s"] or 0.0) - restart_delay_s) if restarts else 0.0
    knobs = {
        "chips": [M],
        "slice_chips": 1,
        "learners": [M],
        "quorum": 1,
        "chip_mtbi_years": M * span / (365.0 * 24 * 3600),
        "detect_s": 0.0,
        "recovery_a": 2.0,
        "recovery_c": 1.5,
        "recovery_scale_s": restart_delay_s * 2.0 / 2.47,  # the chaos law's shape, mean = the delay
        "step_s": dp["wall_s"] / dp["steps"],
        "checkpoint_every_steps": int(cfg.dp_checkpoint_every or dp["steps"]),
        "restart_s": restart_s,
        "downscale_s": 0.0,
        "upscale_s": 0.0,
        "failures_per_run": 200,
        "seeds": 4,
        "seed": 0,
        "rule_of_thumb": False,
    }
    return simulate_goodput(knobs, ["dp", f"diloco-{M}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--bandwidths", default="none,1,0.3,0.1", help="Gbit/s each way; none = unshaped")
    ap.add_argument("--no-failures", action="store_true", help="only the cells without a failure")
    ap.add_argument("--fail-at-s", type=float, default=60.0)
    ap.add_argument("--restart-delay-s", type=float, default=10.0)
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bws = [None if b == "none" else float(b) for b in args.bandwidths.split(",")]
    if None not in bws:
        bws = [None, *bws]
    cells = [(bw, f) for f in ([False] if args.no_failures else [False, True]) for bw in bws]
    dirs = {cell: run_cell(args.out, args.config, *cell, args) for cell in cells}
    recs = {cell: records(rd) for cell, rd in dirs.items()}
    base = recs[(None, False)]
    target = max(base[m]["summary"]["final_val_loss"] for m in ("diloco", "dp"))
    print(f"\ncommon target loss (the worse final loss of the unshaped cell): {target:.4f}\n")
    head = "| cell | method | wall (s, measured) | model (s) | model error | to DP's final (s) | to target (s) "
    print(head + "| goodput | link bytes sent (MB) | run's own count (MB) |")
    print("|" + "---|" * 10)
    for (bw, failure), rec in recs.items():
        model = predicted_wall(recs.get((None, failure), base), bw)
        dp_final = rec["dp"]["summary"]["final_val_loss"]
        for m in ("diloco", "dp"):
            s = rec[m]["summary"]
            wall, pred = s["wall_s"], model[m]
            err = f"{100 * (pred - wall) / wall:+.1f} %" if pred else "—"
            to_dp, to_t = curve_s(rec[m]["curve"], dp_final), curve_s(rec[m]["curve"], target)
            net = s.get("network") or {}
            g = rec[m]["goodput"]
            cells = [
                cell_name(bw, failure),
                m,
                f"{wall:.0f}",
                f"{pred:.0f}" if pred else "—",
                err,
                f"{to_dp:.0f}" if to_dp else "not reached",
                f"{to_t:.0f}" if to_t else "not reached",
                f"{g:.3f}" if g is not None else "—",
                f"{net.get('sent_bytes', 0) / 1e6:.1f}",
                f"{s['bytes_to_syncer'] / 1e6:.1f}",
            ]
            print("| " + " | ".join(cells) + " |")
        if failure:
            sim = simulated(rec, args.fail_at_s, args.restart_delay_s)
            print(
                f"| {cell_name(bw, failure)} | simulator (same failure rate) | | | | | | "
                + ", ".join(f"{k} {v['goodput']:.3f} ± {v['goodput_ci']:.3f}" for k, v in sim.items())
                + " | | |"
            )


if __name__ == "__main__":
    main()
