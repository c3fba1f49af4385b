"""What each engine costs: start-up, exchange seconds and bytes per merge, tokens/s of the whole run.

    python benchmarks/engines.py [--config configs/tiny.yaml] [--engines threads,fsspec,ray,dask]
                                 [--tokens 196608] [--set key=value ...]

Runs the same Decoupled DiLoCo pretraining (the ``pretrain-diloco`` flow, real Prefect tasks) once per
engine, side by side in one process, on data prepared once:

* ``threads``: learner threads and the syncer in this process, the in-memory exchange (the default);
* ``fsspec``: the same threads, fragments through the durable fsspec exchange in the run directory;
* ``ray`` / ``dask``: every learner and the syncer in a worker process of its own (a local cluster
  started for the run), fragments through the fsspec exchange; the flow compiles the learner step
  and the evaluation into the run's compilation cache while the workers start
  (``runtime.compilation_cache``);
* ``ray-uncached`` / ``dask-uncached``: the same with the cache off (every process compiles its own).

Per engine it prints: start-up (seconds from the run's set-up, when the exchange is created, to the
first learner step: the engine's cluster, worker processes importing JAX and compiling), training seconds (first learner
step to the last learner's end) and tokens/s over them, merges, the syncer's seconds in exchange
calls per merge (storage calls, encoding and checksums: draining submissions, publishing, collecting,
granting, the journal), the learners' seconds in exchange calls, bytes moved
per merge (submissions in + the fragment out to every learner), the held-out loss, the start-up's
parts (``startup_timeline``: process start, imports, building and compiling, the start gate), and the ratio of
tokens/s to the thread engine's. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from configs.load import load_config_checked, parse_overrides  # noqa: E402
from configs.schema import ExperimentConfig  # noqa: E402
from data.text import prepare_data  # noqa: E402
from run.layout import RunLayout  # noqa: E402
from run.metrics import read_jsonl  # noqa: E402

ENGINES = {
    "threads": {"engine": "threads"},
    "fsspec": {"engine": "threads", "exchange": "fsspec"},
    "ray": {"engine": "ray"},
    "dask": {"engine": "dask"},
    # the same without the run's compilation cache: every worker process compiles its own steps
    "ray-uncached": {"engine": "ray", "compilation_cache": None},
    "dask-uncached": {"engine": "dask", "compilation_cache": None},
}


def measure(cfg: ExperimentConfig, run_dir: Path) -> dict:
    from flows.pretrain import pretrain_diloco

    t0 = time.perf_counter()
    summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=30.0)
    wall = time.perf_counter() - t0
    layout = RunLayout(run_dir)
    events = read_jsonl(layout.metrics("pretrain", "diloco", "learners"))
    starts = [e["t"] for e in events if e.get("event") == "start"]
    stops = [e["t"] for e in events if e.get("event") == "stop"]
    merges = read_jsonl(layout.metrics("pretrain", "diloco", "merges"))
    train_s = max(stops) - min(starts)
    n = max(len(merges), 1)
    return {
        "wall_s": wall,
        "startup_s": summary["startup_s"],
        "train_s": train_s,
        "tokens": summary["tokens"],
        "tokens_per_s": summary["tokens"] / train_s,
        "merges": len(merges),
        "exchange_s_per_merge": summary["exchange_s"] / n,
        "learner_exchange_s": summary["learner_exchange_s"],
        "bytes_per_merge": statistics.fmean(m["bytes_in"] + m["bytes_out"] for m in merges) if merges else 0.0,
        "val_loss": summary["final_val_loss"],
        "pids": len({e.get("pid") for e in events if e.get("event") == "start"}),
        **startup_timeline([e for e in events if e.get("event") == "start" and e.get("attempt") == 1]),
    }


def startup_timeline(starts: list[dict]) -> dict:
    """Where the start-up went, from the learners' first ``start`` events (run clock, seconds; median
    over learners): ``process`` their process started (shown as 0 when before the run: the flow's
    own process, or a worker started in advance), ``imports`` from then to the task's start
    (importing Prefect, JAX and the project; Prefect's task engine), ``build`` from the task's
    start to a ready model, initial parameters and optimizer state, ``gate`` waiting for the other
    learners. The learner step itself compiles (or loads from the compilation cache) at the first
    step, after the gate: that lands in the training seconds."""
    if not starts or "task_t" not in starts[0]:
        return {}
    med = lambda xs: statistics.median(xs)  # noqa: E731
    return {
        "process_t": med([max(e["process_t"], 0.0) for e in starts]),
        "imports_s": med([max(e["task_t"] - max(e["process_t"], 0.0), 0.0) for e in starts]),
        "build_s": med([e["ready_t"] - e["task_t"] for e in starts]),
        "gate_s": med([e["gate_s"] for e in starts]),
    }


def refuse(message: str) -> None:
    """One line on stderr naming the option and the fix; exit 2 (before any work)."""
    print(message, file=sys.stderr)
    sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--engines", default="threads,fsspec,ray,dask")
    ap.add_argument("--tokens", type=int, default=196_608, help="token budget per run")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="override, e.g. diloco.learners=2")
    args = ap.parse_args()
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in names if e not in ENGINES]
    if unknown:
        refuse(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    try:
        given = parse_overrides(args.sets)
    except ValueError as exc:
        refuse(str(exc))
    if "train.token_budget" in given:
        refuse("--set train.token_budget: give the budget of each run with --tokens")
    # one evaluation at the end and no lm-eval, unless the user asks otherwise
    overrides = {
        "train.eval_every_tokens": args.tokens,
        "eval.enabled": False,
        **given,
        "train.token_budget": args.tokens,
    }
    base = load_config_checked(args.config, overrides)
    root = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    try:
        data_dir = root / "data-run"
        prepare_data(base, data_dir)
        rows = {}
        for name in names:
            cfg = ExperimentConfig.model_validate(
                {**base.model_dump(), "runtime": {**base.runtime.model_dump(exclude={"exchange"}), **ENGINES[name]}}
            )
            run_dir = root / name
            shutil.copytree(data_dir, run_dir)
            rows[name] = measure(cfg, run_dir)
            print(
                f"{name}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[name].items()})}",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    d = base.diloco
    print(
        f"\n{args.config}: M={d.learners}, P={d.fragments}, H={d.sync_every}, {base.tokens_per_learner_step} "
        f"tokens per learner step, {args.tokens:,} tokens per run, {os.cpu_count()} CPU cores"
    )
    ref = rows.get("threads", {}).get("tokens_per_s")
    print(
        f"{'engine':13} {'start-up s':>10} {'train s':>8} {'tokens/s':>9} {'× threads':>9} {'merges':>6} "
        f"{'exch ms/merge':>13} {'learner exch s':>14} {'KiB/merge':>9} {'held-out':>8} {'procs':>5}"
    )
    for name, r in rows.items():
        ratio = f"{r['tokens_per_s'] / ref:.2f}" if ref else "n/a"
        print(
            f"{name:13} {r['startup_s']:10.1f} {r['train_s']:8.1f} {r['tokens_per_s']:9.0f} {ratio:>9} "
            f"{r['merges']:6d} {1e3 * r['exchange_s_per_merge']:13.2f} {r['learner_exchange_s']:14.2f} "
            f"{r['bytes_per_merge'] / 1024:9.1f} "
            f"{r['val_loss']:8.4f} {r['pids']:5d}"
        )
    print(
        "start-up, median over learners (run clock, s): process = its process started (0: before the "
        "run), imports = to the task's start, build = model, parameters and optimizer state ready (the step "
        "compiles or loads at the first step, in train s), gate = waiting for the others"
    )
    print(f"{'engine':13} {'process':>8} {'imports':>8} {'build':>8} {'gate':>8} {'first step':>10}")
    for name, r in rows.items():
        if "build_s" in r:
            print(
                f"{name:13} {r['process_t']:8.1f} {r['imports_s']:8.1f} {r['build_s']:8.1f} {r['gate_s']:8.1f} "
                f"{r['startup_s']:10.1f}"
            )


if __name__ == "__main__":
    main()
