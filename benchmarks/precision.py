"""Held-out loss curves of one config under several precision policies, side by side in one run.

    python benchmarks/precision.py                          # configs/tiny.yaml, three policies (~3 min on 2 cores)
    python benchmarks/precision.py --config default --out runs/precision-default
    python benchmarks/precision.py --set train.token_budget=49152

Each policy (config ``precision``: params · compute · optimizer state) is one ``ddiloco run`` of
the config (pretraining only: lm-eval and fine-tuning off; held-out loss every
``--eval-every`` tokens), in a subprocess, one after the other, into ``--out``. Policies:
``float32`` (all float32, the default), ``mixed`` (bfloat16 compute, float32 parameters and
moments: accelerators' mixed precision) and ``bfloat16`` (all three bfloat16).

Prints, per policy and method (DiLoCo, DP): the final held-out loss (nats per token, or per image),
the largest and the final gap to the float32 run's curve at the same tokens, and the method's
training wall time with float32's divided by it. That time is not a speed measure on the tiny
config: a few seconds, most of it compiling and held-out evaluation (it moved 2× between runs);
``benchmarks/device_check.py`` measures the steps' speed-up. Writes ``precision_curves.png`` (both
methods' curves per policy) and ``precision.json`` into ``--out``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = {
    "float32": ("float32", "float32", "float32"),
    "mixed": ("float32", "bfloat16", "float32"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
}
METHODS = ("diloco", "dp")


def policy_sets(out: Path, label: str, eval_every: int, extra: list[str]) -> list[str]:
    """The ``--set`` items of one policy's run (``extra``: the user's, last; a key the user sets replaces
    this list's own item, as ``--set`` refuses a key given twice)."""
    params, compute, opt = POLICIES[label]
    user = {item.partition("=")[0] for item in extra}
    own = [
        f"name=precision-{label}",
        f"run_root={out}",
        "eval.enabled=false",
        "finetune.enabled=false",
        f"train.eval_every_tokens={eval_every}",
        f"precision.params={params}",
        f"precision.compute={compute}",
        f"precision.opt_state={opt}",
    ]
    return [item for item in own if item.partition("=")[0] not in user] + list(extra)


def refusal(config: str, out: Path, policies: list[str], eval_every: int, extra: list[str]) -> str | None:
    """Why these runs cannot start (one line naming the config, field or folder), or None: checked
    before anything is written, as ``ddiloco run`` does."""
    from configs.load import config_path, parse_overrides
    from configs.specs import load_spec

    try:
        for label in policies:
            load_spec("config", config_path(config), parse_overrides(policy_sets(out, label, eval_every, extra)))
    except (ValueError, FileNotFoundError) as exc:
        return str(exc)
    if out.exists() and not out.is_dir():
        return f"--out {out}: exists and is not a folder; choose a new folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--out {out}: cannot create it ({exc.strerror}); choose a writable folder"
    return None


def run_policy(config: str, out: Path, label: str, eval_every: int, extra: list[str]) -> Path:
    """One ``ddiloco run`` of ``config`` under policy ``label``; returns its run directory."""
    name = f"precision-{label}"
    sets = policy_sets(out, label, eval_every, extra)
    cmd = [sys.executable, "-m", "flows.cli", "run", config]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = out / f"{name}.log"
    with log.open("w") as f:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:  # (a refusal is one line: the log's last)
        last = (log.read_text().strip().splitlines() or [""])[-1]
        print(f"{label}: `ddiloco run` exited {code}: {last} (log: {log})", file=sys.stderr)
        raise SystemExit(code)  # (2: refused before any work, as the CLI)
    runs = sorted(out.glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
    return runs[-1]


def curve(run: Path, method: str) -> list[tuple[int, float]]:
    lines = (run / "pretrain" / method / "metrics" / "eval.jsonl").read_text().splitlines()
    return [(int(r["tokens"]), float(r["val/loss"])) for r in map(json.loads, lines)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="a shipped config's name or a path (default: tiny)")
    ap.add_argument("--out", default=None, help="folder for the runs and figures (default: runs/precision-<time>)")
    ap.add_argument("--eval-every", type=int, default=2048, help="held-out loss every this many tokens")
    ap.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        choices=list(POLICIES),
        help="which policies to run (default: all three; float32 is required)",
    )
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (repeat it)",
    )
    args = ap.parse_args()
    if "float32" not in args.policies:
        ap.error("--policies must include float32 (the gaps are measured against it)")
    out = Path(args.out or ROOT / "runs" / time.strftime("precision-%Y%m%d-%H%M%S")).absolute()
    problem = refusal(args.config, out, args.policies, args.eval_every, args.sets)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    runs, curves, walls = {}, {}, {}
    for label in args.policies:
        t = time.monotonic()
        runs[label] = run_policy(args.config, out, label, args.eval_every, args.sets)
        print(f"{label:<9} {runs[label].name}  ({time.monotonic() - t:.0f} s with start-up)", flush=True)
        for m in METHODS:
            curves[label, m] = curve(runs[label], m)
            walls[label, m] = json.loads((runs[label] / "pretrain" / m / "summary.json").read_text())["wall_s"]
    print(f"\nconfig {args.config}; held-out loss (nats per unit); gaps against float32 at the same tokens")
    print(f"{'policy':<10}{'method':<8}{'final':>9}{'max |gap|':>11}{'final gap':>11}{'train s':>9}{'fp32 ÷':>8}")
    rows = []
    for label in args.policies:
        for m in METHODS:
            ref, got = dict(curves["float32", m]), curves[label, m]
            gaps = [loss - ref[t] for t, loss in got if t in ref]
            row = {
                "policy": label,
                "method": m,
                "precision": POLICIES[label],
                "final": got[-1][1],
                "max_abs_gap": max(map(abs, gaps)),
                "final_gap": gaps[-1],
                "wall_s": walls[label, m],
                "float32_wall_over_this": walls["float32", m] / walls[label, m],
                "curve": got,
            }
            rows.append(row)
            print(
                f"{label:<10}{m:<8}{row['final']:>9.4f}{row['max_abs_gap']:>11.4f}{row['final_gap']:>+11.4f}"
                f"{row['wall_s']:>9.1f}{row['float32_wall_over_this']:>8.2f}"
            )
    (out / "precision.json").write_text(json.dumps({"config": args.config, "rows": rows}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, m in zip(axes, METHODS):
        for label in args.policies:
            t, loss = zip(*curves[label, m])
            ax.plot(t, loss, marker=".", label=" · ".join(POLICIES[label]))
        ax.set_title({"diloco": "Decoupled DiLoCo", "dp": "DP"}[m])
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out loss (nats/token)")
    axes[1].legend(title="params · compute · optimizer state", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "precision_curves.png", dpi=120)
    print(f"\n{out / 'precision_curves.png'}")


if __name__ == "__main__":
    main()
