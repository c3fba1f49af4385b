"""What each engine costs: start-up, exchange seconds and bytes per merge, tokens/s of the whole run.

    python benchmarks/engines.py [--config configs/tiny.yaml] [--engines threads,fsspec,ray,dask]
                                 [--tokens 196608] [--set key=value ...] [--s3 s3://bucket/prefix]

Runs the same Decoupled DiLoCo pretraining (the ``pretrain-diloco`` flow, real Prefect tasks) once per
engine, side by side in one process, on data prepared once:

* ``threads``: learner threads and the syncer in this process, the in-memory exchange (the default);
* ``fsspec``: the same threads, fragments through the durable fsspec exchange in the run directory;
* ``ray`` / ``dask``: every learner and the syncer in a worker process of its own (a local cluster
  started for the run), fragments through the fsspec exchange; the flow compiles the learner step
  and the evaluation into the run's compilation cache while the workers start
  (``runtime.compilation_cache``);
* ``ray-uncached`` / ``dask-uncached``: the same with the cache off (every process compiles its own);
* ``fsspec-s3`` / ``dask-s3``: ``fsspec`` and ``dask`` with the exchange on S3 (``runtime.exchange_url``);
* ``dask-apart`` / ``ray-apart``: clusters started apart from the run as docs/scale-out.md shows (``dask
  scheduler`` and M + 1 ``dask worker`` processes; a ``ray start`` head and a second node), reached
  through ``runtime.address``, the exchange on S3 (tests/clusters.py starts them).

S3 is ``--s3 s3://bucket/prefix`` with the credentials in the environment, or by default a local moto
server (tests/s3_endpoint.py: a Python process on loopback, so its latency is the protocol's and
s3fs's, not a remote store's network). With any S3 arm the store's own latency is measured first,
side by side against a local folder: milliseconds per submission written, per submission drained
(listed and read), per fragment published and per fragment read by a learner, with the config's
fragments (``--ops`` times each).

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
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from configs.load import parse_overrides  # noqa: E402
from configs.methods import DiLoCoConfig  # noqa: E402
from configs.schema import ExperimentConfig  # noqa: E402
from configs.specs import load_spec  # noqa: E402
from data.prepare import prepare_data  # noqa: E402
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
    # the exchange on S3 (--s3, or a local moto server)
    "fsspec-s3": {"engine": "threads", "exchange": "fsspec", "s3": True},
    "dask-s3": {"engine": "dask", "s3": True},
    # clusters started apart from the run (tests/clusters.py: the documented commands), exchange on S3
    "dask-apart": {"engine": "dask", "s3": True, "cluster": "dask"},
    "ray-apart": {"engine": "ray", "s3": True, "cluster": "ray"},
}


def store_latency(url: str, initial: list[dict], ops: int) -> dict:
    """Milliseconds per exchange operation at ``url`` (median over ``ops`` of each), with the run's
    fragments ``initial`` (Θ₀ split into P name → float32 array mappings): ``submit`` (a learner's
    submission written), ``drain`` (the syncer lists the inbox and reads one new submission),
    ``publish`` (a new version of a fragment and the pointer), ``latest`` (a learner reads the newest
    version of a fragment); and ``bytes`` of one fragment (the mean)."""
    from diloco.exchange.base import Submission
    from diloco.exchange.fsspec import FsspecExchange

    P = len(initial)
    ex = FsspecExchange.create(url, initial=initial, num_learners=1, token_budget=10**9, grant_tokens=10**6)
    learner, syncer = FsspecExchange.open(url), FsspecExchange.open(url)
    syncer.take_office()
    times: dict[str, list[float]] = {"submit": [], "drain": [], "publish": [], "latest": []}
    for i in range(ops):
        p = i % P
        sub = Submission(learner=0, fragment=p, params=initial[p], tokens=1, steps=1, base_version=i // P,
                         local_step=i + 1, attempt=1)  # fmt: skip
        drained: list = []
        for name, call in (
            ("submit", lambda: learner.submit(sub)),  # noqa: B023 - called at once
            ("drain", lambda: drained.extend(syncer.drain())),  # noqa: B023
            ("publish", lambda: syncer.publish(p, i // P + 1, initial[p])),  # noqa: B023
            ("latest", lambda: (learner.refresh(), learner.latest(p))),  # noqa: B023 - the pointer re-read
        ):
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
        syncer.discard([d.key for d in drained])  # (as the syncer collects merged submissions)
    del ex
    nbytes = statistics.fmean(sum(a.nbytes for a in f.values()) for f in initial)
    return {**{k: 1e3 * statistics.median(v) for k, v in times.items()}, "bytes": nbytes}


def arm_figures(summary: dict, run_dir: Path, wall: float) -> dict:
    """One arm's row from its DiLoCo stage's ``summary``, its logs in ``run_dir`` and its ``wall``
    seconds (the flow's call, set-up included): seconds, tokens/s, merges, exchange seconds and bytes,
    held-out loss, learner processes and the start-up timeline (:func:`startup_timeline`)."""
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
    ap.add_argument("--s3", default=None, help="s3://bucket/prefix for the S3 arms (default: a local moto server)")
    ap.add_argument("--ops", type=int, default=60, help="operations timed per kind in the store latency table")
    args = ap.parse_args()
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in names if e not in ENGINES]
    if unknown:
        refuse(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    if "ray-apart" in names and {"ray", "ray-uncached"} & set(names):
        refuse(
            "--engines: ray-apart cannot share a run with ray or ray-uncached (Ray keeps its token-"
            "authentication settings for the whole process); run them in two runs, each beside threads"
        )
    if args.s3 is not None and not args.s3.startswith("s3://"):
        refuse(f"--s3 {args.s3}: give s3://bucket/prefix (credentials in the environment)")
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
    base = load_spec("config", args.config, overrides)
    root = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    rows, latency = {}, {}
    try:
        with contextlib.ExitStack() as stack:
            s3 = stack.enter_context(s3_root(args.s3, root)) if any(ENGINES[n].get("s3") for n in names) else None
            if any(ENGINES[n].get("cluster") for n in names):
                from flows.server import temporary_server_for_workers

                stack.enter_context(temporary_server_for_workers())
            data_dir = root / "data-run"
            prepare_data(base, data_dir)
            if s3 is not None:
                from training.decoupled.plan import DiLoCoPlan
                from training.decoupled.setup import initial_fragments

                initial = initial_fragments(DiLoCoPlan.of(base), data_dir)
                for store, url in (("local folder", str(root / "latency-local")), ("s3", f"{s3}/latency")):
                    latency[store] = store_latency(url, initial, args.ops)
            from flows.pretrain import pretrain_diloco  # once the arms' Prefect server runs

            for name in names:
                arm = dict(ENGINES[name])
                use_s3, cluster = arm.pop("s3", False), arm.pop("cluster", None)
                runtime = {**base.runtime.model_dump(exclude={"exchange"}), **arm}
                if use_s3:
                    runtime["exchange_url"] = f"{s3}/{name}"
                run_dir = root / name
                shutil.copytree(data_dir, run_dir)
                try:
                    with started_cluster(cluster, base.diloco.learners, root / f"{name}-logs") as address:
                        if address:
                            runtime["address"] = address
                        cfg = ExperimentConfig.model_validate({**base.model_dump(), "runtime": runtime})
                        t0 = time.perf_counter()
                        summary = pretrain_diloco(config=cfg, run_dir=str(run_dir), progress_every_s=30.0)
                        rows[name] = arm_figures(summary, run_dir, time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001 - one arm failing leaves the others' figures
                    print(f"{name}: FAILED ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", flush=True)
                    continue
                print(f"{name}: done ({rows[name]['wall_s']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_tables(base.diloco, base.tokens_per_learner_step, args, rows, latency)


def print_tables(d: DiLoCoConfig, step_tokens: int, args: argparse.Namespace, rows: dict, latency: dict) -> None:
    """The engines table, the start-up table and (with S3 arms) the store latency table, under a line
    naming the arms' DiLoCo settings ``d`` and their ``step_tokens`` tokens per learner step."""
    print(
        f"\n{args.config}: M={d.learners}, P={d.fragments}, H={d.sync_every}, {step_tokens} "
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
    if latency:
        where = args.s3 or "a local moto server (loopback)"
        local = latency["local folder"]
        print(
            f"\nexchange store latency, ms per operation (median of {args.ops}; fragments of "
            f"{local['bytes'] / 1024:.1f} KiB; S3 = {where})"
        )
        print(f"{'store':13} {'submit':>8} {'drain':>8} {'publish':>8} {'latest':>8}")
        for store, r in latency.items():
            print(f"{store:13} " + " ".join(f"{r[k]:8.2f}" for k in ("submit", "drain", "publish", "latest")))
        s3r = latency["s3"]
        print(
            f"{'s3 ÷ local':13} "
            + " ".join(f"{s3r[k] / local[k]:7.1f}×" for k in ("submit", "drain", "publish", "latest"))
        )


@contextlib.contextmanager
def s3_root(url: str | None, root: Path):
    """The S3 prefix of the S3 arms: ``url`` (checked: one line and exit 2 if it cannot be written),
    or a local moto server's bucket (its credentials and endpoint put in this process's environment,
    which the engines' worker processes inherit) for the block."""
    from diloco.exchange.fsspec import check_writable

    if url is not None:
        try:
            check_writable(url)
        except Exception as exc:  # noqa: BLE001 - whatever the store raises
            refuse(f"--s3 {url}: cannot be written ({type(exc).__name__}: {str(exc).splitlines()[0]})")
        yield url.rstrip("/") + f"/engines-{os.getpid()}"
        return
    from tests.s3_endpoint import MotoServer

    with MotoServer(log=root / "moto.log") as server:
        os.environ.update(server.env)
        server.create_bucket("engines-bench")
        yield "s3://engines-bench/run"


@contextlib.contextmanager
def started_cluster(kind: str | None, learners: int, logs: Path):
    """``kind`` dask or ray: a cluster started apart from the run (tests/clusters.py, the documented
    commands) for the block, with room for ``learners`` learners and the syncer, yielding its
    address; None: nothing, yielding None."""
    if kind is None:
        yield None
        return
    from tests import clusters

    logs.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "PREFECT_API_URL"))}
    m = learners
    if kind == "dask":
        with clusters.dask_cluster(m + 1, env, logs) as c:
            yield c["address"]
        return
    import secrets

    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # the head: the syncer and up to all learners; the second node: the learners SPREAD puts there
    with mock.patch.dict(os.environ, token), clusters.ray_cluster((m + 1, m), {**env, **token}, logs) as c:
        yield c["address"]


if __name__ == "__main__":
    main()
